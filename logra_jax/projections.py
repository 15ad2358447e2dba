"""Seeded random projections A_l(k) and the zero sketch probe B_l (docs/algorithm.md §2–3).

The contract between models/ (a target layer computes x·Aᵀ and takes the probe B) and optim/
(which sketches with A and merges U·A): both import it, neither imports the other's internals.

A projection is never stored. It is regenerated wherever it is needed (the forward pass of a
target layer, the optimizer's merge ΔW = −η·D·A, the rollout engine's receiver) from

    key(l, k, i) = fold_in(fold_in(fold_in(PRNGKey(seed), layer_id(path_l)), k), i)

where ``path_l`` is the target's parameter path (e.g. ``"layers/attn/q_proj/kernel"``), ``k`` the
update index and ``i`` the index of the layer inside a stacked (scanned) weight. Entries are
±1/√r (Rademacher) or N(0, 1/r) (Gaussian), so E[AᵀA] = I.

How a Rademacher A is drawn from its key (``"rademacher"``): entry (a, j) is the top bit of a
counter-based hash,

    sign(a, j) = top bit of  mix(mix(c ⊕ s₀) ⊕ s₁),   c = a·in + j,   (s₀, s₁) = bits(key)

where ``mix`` is a 32-bit integer finaliser (xor-shift, multiply, xor-shift, multiply, xor-shift)
and (s₀, s₁) are two threefry words of the key. Every entry is one elementwise expression of its
own index — no loop, no state — so XLA fuses it into whatever reads A, and integer arithmetic gives
the same bits on every backend. Why not threefry for every entry: XLA:CPU runs threefry as a loop
of rounds whose carried state it copies each round, measured at 5 % of a LoGRA update at width
2048 (``launch.step_time --profile``). ``"rademacher_threefry"`` keeps jax.random.rademacher's
stream (what the reference implementation draws, for side-by-side checks).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

Distribution = Literal["rademacher", "gaussian", "rademacher_threefry"]
DISTRIBUTIONS: tuple[str, ...] = ("rademacher", "gaussian", "rademacher_threefry")
SIGN_DISTRIBUTIONS: tuple[str, ...] = ("rademacher", "rademacher_threefry")   # entries ±1/√r


def layer_id(path: str) -> int:
    """A stable 31-bit id for a parameter path (same on every host, run and Python version)."""
    return zlib.crc32(path.encode("utf-8")) & 0x7FFFFFFF


def projection_keys(seed: int, path: str, update_index: jax.Array | int,
                    stack_shape: tuple[int, ...] = ()) -> jax.Array:
    """PRNG keys for A of target ``path`` at update ``update_index``.

    Returns one key (``stack_shape == ()``) or an array of keys of shape ``stack_shape``, one per
    layer of a stacked weight, so every layer of a scanned stack gets its own A.
    """
    with jax.named_scope("logra_projection"):  # named for profiles (logra_jax/perf/profiling.py)
        key = jax.random.fold_in(jax.random.PRNGKey(seed), layer_id(path))
        key = jax.random.fold_in(key, jnp.asarray(update_index, jnp.uint32))
        if not stack_shape:
            return key
        num = 1
        for d in stack_shape:
            num *= d
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num, dtype=jnp.uint32))
        return keys.reshape(stack_shape + keys.shape[1:])


def projection_keys_of(seed: int, targets: dict[str, tuple[int, ...]],
                       update_index: jax.Array | int) -> dict[str, jax.Array]:
    """{path: projection_keys(seed, path, update_index, stack_shape)} for every target at once.

    The same keys, bit for bit (threefry is integer arithmetic, so batching it changes nothing),
    from one batched fold_in of k over all targets and one over all their layers: a compiled
    program then derives the keys of every target in a couple of kernels rather than a few per
    target (XLA:GPU launches each separately).
    """
    paths = list(targets)
    if not paths:
        return {}
    with jax.named_scope("logra_projection"):
        ids = jnp.asarray([layer_id(path) for path in paths], jnp.uint32)
        index = jnp.asarray(update_index, jnp.uint32)
        base = jax.vmap(lambda i: jax.random.fold_in(
            jax.random.fold_in(jax.random.PRNGKey(seed), i), index))(ids)            # (T, 2)
        # Layers per target; an unstacked target's key is its base key (no layer folded in).
        sizes = [math.prod(targets[path]) if targets[path] else 0 for path in paths]
        owner = np.repeat(np.arange(len(paths)), sizes)
        layer = np.concatenate([np.arange(n, dtype=np.uint32) for n in sizes])
        layered = (jax.vmap(jax.random.fold_in)(base[owner], jnp.asarray(layer)) if len(layer)
                   else base[:0])
        keys, start = {}, 0
        for t, path in enumerate(paths):
            stack = tuple(targets[path])
            if not stack:
                keys[path] = base[t]
                continue
            keys[path] = layered[start:start + sizes[t]].reshape(stack + base.shape[1:])
            start += sizes[t]
        return keys


def projection_parts(key: jax.Array, rank: int, in_dim: int,
                     distribution: Distribution = "rademacher",
                     words: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(unit, scale) with A = unit·scale: unit (rank, in_dim) holds ±1 or N(0, 1) draws, scale = 1/√r.

    The merge (low_rank.order_free_matmul) uses the parts: a ±1 matrix has one significant bit,
    which is what lets it multiply without rounding. ``words``: ``hash_words(key)``, if already
    derived (a "rademacher" A only).
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    # Named for profiles (logra_jax/perf/profiling.py): where regenerating A costs time.
    with jax.named_scope("logra_projection"):
        if distribution == "rademacher":
            bits = hashed_bits(key, (rank, in_dim), words)
            unit = jnp.where(bits >> 31 == 0, 1.0, -1.0).astype(jnp.float32)
        elif distribution == "rademacher_threefry":
            unit = jax.random.rademacher(key, (rank, in_dim), dtype=jnp.float32)
        else:
            unit = jax.random.normal(key, (rank, in_dim), dtype=jnp.float32)
    return unit, 1.0 / jnp.sqrt(jnp.asarray(rank, jnp.float32))


def _mix32(x: jax.Array) -> jax.Array:
    """A bijective 32-bit finaliser (xor-shift-multiply; constants of C. Wellons' "lowbias32"
    search): every input bit reaches every output bit, with low bias."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x21F0AAAD)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0xD35A2D97)
    return x ^ (x >> 15)


def hashed_bits(key: jax.Array, shape: tuple[int, ...], words: jax.Array | None = None) -> jax.Array:
    """uint32 random bits of ``shape``: the entry at row-major position c is
    mix(mix(c ⊕ s₀) ⊕ s₁), (s₀, s₁) = `hash_words` of ``key`` (for (rows, cols): c = a·cols + j)."""
    check_counter_range(shape)
    return hash_positions(key, jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape), words)


def hash_words(key: jax.Array) -> jax.Array:
    """(s₀, s₁), uint32 (2,): the two threefry words of ``key`` that `hash_positions` mixes in.
    Derived ahead for many keys at once (vmapped), they spare a program one small threefry
    kernel per A it regenerates (XLA:GPU launches each; inside a layer loop, once per layer)."""
    return jax.random.bits(key, (2,), jnp.uint32)


def hash_positions(key: jax.Array, positions: jax.Array, words: jax.Array | None = None) -> jax.Array:
    """The bits `hashed_bits` gives the entries at row-major ``positions`` (uint32, any shape):
    for an array laid out in another order than the one its bits are defined in. ``words``:
    ``hash_words(key)``, if already derived."""
    s = hash_words(key) if words is None else words
    return _mix32(_mix32(positions ^ s[0]) ^ s[1])


def check_counter_range(shape: tuple[int, ...]) -> None:
    """Raises if ``shape`` has more entries than the 32-bit counter of `hashed_bits` can tell apart."""
    size = math.prod(shape)
    if size > 2 ** 32:
        raise ValueError(f"{' × '.join(map(str, shape))} = {size} entries are more than 2³²; "
                         f"the hashed counter would repeat")


def projection(key: jax.Array, rank: int, in_dim: int, distribution: Distribution = "rademacher",
               dtype=jnp.float32, words: jax.Array | None = None) -> jax.Array:
    """A of shape (rank, in_dim) with E[AᵀA] = I: entries ±1/√r or N(0, 1/r). ``words``:
    ``hash_words(key)``, if already derived."""
    unit, scale = projection_parts(key, rank, in_dim, distribution, words)
    return (unit * scale).astype(dtype)


@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """Which axes of a kernel form the matrices LoGRA trains, when they are not (*stack, in, out).

    A target's kernel is viewed as (*stack, in, out): ``stack`` axes index separate matrices (the
    layers of a scanned stack), ``inputs`` are the axes the layer contracts with its input (in, in
    this order, flattened), ``outputs`` the axes it produces (out, flattened). Flax's Linear needs
    none (the default view: every leading axis is stack, then in, then out). LinearGeneral and
    Einsum kernels do, e.g. attention's (*stack, embed, heads, head_dim): in = embed,
    out = heads·head_dim. The axes are a permutation of the kernel's; ``to_matrix`` and
    ``from_matrix`` move between the two forms (only reshapes when the axes are in that order).
    """

    stack: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    def __post_init__(self):
        axes = self.stack + self.inputs + self.outputs
        if sorted(axes) != list(range(len(axes))) or not self.inputs or not self.outputs:
            raise ValueError(f"KernelLayout{self.stack, self.inputs, self.outputs}: stack, inputs "
                             f"and outputs must split the kernel's axes, with at least one in and "
                             f"one out axis")

    @property
    def ndim(self) -> int:
        return len(self.stack) + len(self.inputs) + len(self.outputs)

    def matrix_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """(*stack, in, out) of a kernel of this ``shape``."""
        if len(shape) != self.ndim:
            raise ValueError(f"a kernel of shape {tuple(shape)} does not have the {self.ndim} "
                             f"axes of {self}")
        return (tuple(shape[a] for a in self.stack) + (math.prod(shape[a] for a in self.inputs),)
                + (math.prod(shape[a] for a in self.outputs),))

    def to_matrix(self, kernel: jax.Array) -> jax.Array:
        """The kernel as (*stack, in, out)."""
        order = self.stack + self.inputs + self.outputs
        moved = kernel if order == tuple(range(kernel.ndim)) else jnp.transpose(kernel, order)
        return moved.reshape(self.matrix_shape(kernel.shape))

    def from_matrix(self, matrix: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """A (*stack, in, out) matrix back in the kernel's own ``shape``."""
        order = self.stack + self.inputs + self.outputs
        moved = matrix.reshape(tuple(shape[a] for a in order))
        if order == tuple(range(len(order))):
            return moved
        return jnp.transpose(moved, tuple(order.index(a) for a in range(len(order))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SketchProbe:
    """What a target linear layer needs to emit its gradient sketch (docs/algorithm.md §3).

    ``factor`` is the zero probe parameter B (out × r) — its gradient is S = G·Aᵀ — and ``key``
    regenerates A (r × in). For a stacked weight both carry the stack's leading dims, and a
    ``jax.lax.scan`` over layers slices them like any other per-layer input.

    ``factor_is_zero`` is a static promise that B's *value* is 0 (``make_probes`` makes it; a probe
    keeps it through ``with_factors``, which only swaps in traced copies of those zeros). It lets
    the linear layer skip the branch (x·Aᵀ)·Bᵀ, whose value and x-gradient are then zero, and keep
    only its derivative in B. Without the promise the layer computes the branch as written.
    """

    key: jax.Array
    factor: jax.Array
    distribution: str = dataclasses.field(default="rademacher", metadata=dict(static=True))
    factor_is_zero: bool = dataclasses.field(default=False, metadata=dict(static=True))
    words: jax.Array | None = None   # hash_words of each key, derived ahead ("rademacher" only)

    tree_path_leaf = True  # one leaf for tree_paths.leaves_with_paths, not its key and factor

    @property
    def rank(self) -> int:
        return self.factor.shape[-1]

    def projection(self, in_dim: int, dtype=jnp.float32) -> jax.Array:
        return projection(self.key, self.rank, in_dim, self.distribution, dtype, self.words)
