"""Sketch-space arithmetic that needs A: sketching a dense gradient, reconstructed norms, and
merging a low-rank update into the weights (docs/algorithm.md §3, §5, §8).

The merge's product U·A is order-free by default (order_free.py): the same bits wherever it runs,
which is what makes a factors sync exact. Where no receiver replays the merge, one plain fp32 dot
does (``LowRankUpdate.exact``): the order-free product costs a second dot. Sketches and norms need
no such guarantee and use plain fp32 dots.

All of it regenerates A_l(k) from its key, and runs over a stack of layers in steps: one layer a
step where the program is compiled for a CPU or a TPU (a loop whose iterations cost no launch,
holding one layer's A and ΔW at a time), several on a GPU, where XLA:GPU launches every operation
of a loop body once per iteration: there a step is one batched program over as many layers as
keep its fp32 ΔW under `GPU_STEP_BYTES` (`layers_per_step`). Each layer's arithmetic is the same
elementwise operations and the same dots either way, so the order-free merge gives the same bits
in any step size; only the plain dot (``exact=False``) may round differently in a batched kernel,
as it may on any other backend.

Notation (Flax layout): kernel K = Wᵀ has shape (in, out); G = dense gradient of W (out × in), so
the kernel's gradient is Gᵀ; S = G·Aᵀ (out × r); a factor U (out × r) means ΔW = U·A, i.e.
K += Aᵀ·Uᵀ.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from logra_jax.optim.order_free import order_free_matmul, rounded
from logra_jax.optim.rounding import round_to
from logra_jax.projections import SIGN_DISTRIBUTIONS, KernelLayout, projection, projection_parts

_HIGHEST = jax.lax.Precision.HIGHEST  # fp32 arithmetic on every backend (no TF32/bf16 passes)


def map_layers(fn, stack_shape: tuple[int, ...], *arrays, chunk: int = 1):
    """fn(*per_layer_slices) over the flattened leading ``stack_shape`` dims, ``chunk`` layers per step.

    ``chunk`` = 1: ``lax.map``, a sequential loop, so temporaries such as A exist for one layer
    only; larger: each step is ``fn`` vmapped over that many layers (a batched program: one kernel
    per operation for all of them), and ``chunk`` ≥ the layer count is one step with no loop.
    Outputs get the stack dims back in front.
    """
    if not stack_shape:
        return fn(*arrays)
    n = math.prod(stack_shape)
    flat = [a.reshape((n,) + a.shape[len(stack_shape):]) for a in arrays]
    if chunk >= n:
        out = jax.vmap(fn)(*flat)
    else:
        out = jax.lax.map(lambda xs: fn(*xs), tuple(flat), batch_size=chunk if chunk > 1 else None)
    return jax.tree.map(lambda o: o.reshape(stack_shape + o.shape[1:]), out)


# Where a stack program (merge, norms, dense sketches) is batched over layers: on GPUs, where
# XLA:GPU launches every operation of a loop body once per layer (a per-layer loop over 7 targets ×
# 28 layers made Qwen2.5-1.5B's optimizer 3,910 kernel launches), as many layers per step as keep
# the step's largest temporary (its fp32 U·A, or the layers' A) within `GPU_STEP_BYTES` per device.
# What a step may hold is what is free at the merges, below the update's peak (the backward pass),
# once the dense updates are applied first (`_dense_first`): for Qwen2.5-1.5B on one H200, all 28
# layers of each target in one step, XLA:GPU plans 2.0 GiB fewer temporaries than with the merges
# beside the dense updates' temporaries. Elsewhere one layer per step: XLA:CPU and the TPU compiler
# run a loop's iterations without a launch each.
_BATCHED_PLATFORMS = ("cuda", "rocm")
GPU_STEP_BYTES = 2 * 2 ** 30


def layers_per_step(n: int, layer_bytes: float, platform: str) -> int:
    """Layers of an ``n``-layer stack one step handles on ``platform`` ("cpu", "cuda", "rocm",
    "tpu"), when one layer's largest temporary takes ``layer_bytes`` on a device: steps of equal
    size, as few as keep a step's under `GPU_STEP_BYTES` on a GPU; one layer elsewhere."""
    if platform not in _BATCHED_PLATFORMS or n <= 1:
        return 1
    steps = max(1, math.ceil(n * layer_bytes / GPU_STEP_BYTES))
    return math.ceil(n / steps)


def by_platform(fn, stack_shape: tuple[int, ...], layer_bytes: int, *args):
    """``fn(*args, chunk=c)``, c = `layers_per_step` of the platform the program is lowered for
    (``jax.lax.platform_dependent``: a deviceless GPU compile on a CPU host gets the GPU's form,
    and each platform's program holds only its own). ``layer_bytes``: one layer's largest
    temporary, the whole array's; a device holds its share of the mesh traced under (FSDP and
    tensor parallelism split every target), all of it outside one."""
    n = math.prod(stack_shape)
    chunks = {p: layers_per_step(n, _per_device(layer_bytes), p)
              for p in ("cpu", "tpu", *_BATCHED_PLATFORMS)}
    default = chunks.pop("cpu")
    others = {p: c for p, c in chunks.items() if c != default}
    if not others:
        return fn(*args, chunk=default)
    return jax.lax.platform_dependent(
        *args, default=lambda *a: fn(*a, chunk=default),
        **{p: (lambda c: lambda *a: fn(*a, chunk=c))(c) for p, c in others.items()})


def _per_device(nbytes: float) -> float:
    """A device's share of ``nbytes`` of a target-shaped array: FSDP and tensor parallelism split
    every target over the mesh traced under; outside one a device holds it all."""
    mesh = jax.sharding.get_abstract_mesh()
    return nbytes / (1 if mesh.empty else mesh.size)


def sketch_dense(kernel_grad: jax.Array, keys: jax.Array, rank: int, distribution: str,
                 stack_shape: tuple[int, ...]) -> jax.Array:
    """S = G·Aᵀ (*stack, out, r) from a dense kernel gradient Gᵀ (*stack, in, out).

    This is the drop-in path: it saves optimizer state, but the dense gradient already exists, so
    it saves no gradient memory (the probe path of targets.make_probes does).
    """
    def one(g_t, key):
        a = projection(key, rank, g_t.shape[0], distribution)                  # (r, in)
        return jnp.matmul(a, g_t.astype(jnp.float32), precision=_HIGHEST).T   # (out, r)
    return by_platform(lambda g, k, chunk: map_layers(one, stack_shape, g, k, chunk=chunk),
                       stack_shape, 4 * rank * kernel_grad.shape[-2], kernel_grad, keys)


def reconstructed_sq_norm(factor: jax.Array, keys: jax.Array, in_dim: int, distribution: str,
                          stack_shape: tuple[int, ...]) -> jax.Array:
    """Σ_layers ‖S·A‖²_F computed as Σ trace(S (A Aᵀ) Sᵀ): r×r Gram matrices, never S·A itself."""
    rank = factor.shape[-1]

    def one(s, key):
        a = projection(key, rank, in_dim, distribution)
        gram = jnp.matmul(a, a.T, precision=_HIGHEST)                            # (r, r)
        s = s.astype(jnp.float32)
        return jnp.sum(jnp.matmul(s, gram, precision=_HIGHEST) * s)
    return by_platform(lambda f, k, chunk: jnp.sum(map_layers(one, stack_shape, f, k, chunk=chunk)),
                       stack_shape, 4 * rank * in_dim, factor, keys)


def reconstructed_sq_norm_sum(parts, distribution: str) -> jax.Array:
    """Σ over targets of `reconstructed_sq_norm`; ``parts``: (S, keys, in_dim, stack_shape) of each.

    On a GPU the targets whose A has one shape (r × in: q, k, v, o, gate and up of a decoder) share
    one batched program for their Gram matrices G = A·Aᵀ, and the sum is read at once over all of
    them as Σ G ∘ (SᵀS) (= Σ trace(S G Sᵀ), G and SᵀS symmetric): a few kernels in all instead of
    a Gram program and reductions per target. Elsewhere each target's own `reconstructed_sq_norm`.
    Plain fp32 dots either way; the two may round the sum differently.
    """
    parts = list(parts)
    if not parts:
        return jnp.zeros([], jnp.float32)
    flat = [x for s, keys, _, _ in parts for x in (s, keys)]

    def separately(*flat):
        return sum((reconstructed_sq_norm(s, keys, in_dim, distribution, stack)
                    for s, keys, (_, _, in_dim, stack) in zip(flat[::2], flat[1::2], parts)),
                   jnp.zeros([], jnp.float32))

    def grouped(*flat):
        groups = {}
        for s, keys, (_, _, in_dim, stack) in zip(flat[::2], flat[1::2], parts):
            n = math.prod(stack)
            groups.setdefault((in_dim, s.shape[-1]), []).append(
                (s.reshape((n,) + s.shape[-2:]).astype(jnp.float32),
                 keys.reshape((n,) + keys.shape[len(stack):])))
        total = jnp.zeros([], jnp.float32)
        for (in_dim, rank), members in groups.items():
            keys = jnp.concatenate([k for _, k in members])

            def gram(key):
                a = projection(key, rank, in_dim, distribution)
                return jnp.matmul(a, a.T, precision=_HIGHEST)                    # (r, r)
            chunk = layers_per_step(keys.shape[0], _per_device(4 * rank * in_dim), "cuda")
            grams = map_layers(gram, (keys.shape[0],), keys, chunk=chunk)
            s_t_s = jnp.concatenate([jnp.einsum("lor,los->lrs", s, s, precision=_HIGHEST)
                                     for s, _ in members])
            total += jnp.sum(grams * s_t_s)
        return total
    return jax.lax.platform_dependent(*flat, default=separately,
                                      **{p: grouped for p in _BATCHED_PLATFORMS})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowRankUpdate:
    """A target's update in compact form: K ← weight_scale·K + Aᵀ·Uᵀ  (W ← weight_scale·W + U·A).

    Attributes:
      factor: U (*stack, out, r); the descent sign and every step-size factor are already inside.
      key: PRNG key data (*stack, 2) regenerating A (r × in) of each layer.
      weight_scale: fp32 scalar; 1 − lr·wd for decoupled weight decay, else 1.
      distribution: static; how A is drawn from its key.
      rounding: static; how the fp32 merge result becomes a bf16 kernel: "nearest", or
        "stochastic" (unbiased, with random bits derived from A's key — rounding.py). fp32
        kernels are not rounded.
      exact: static; True — U·A is order-free (order_free.py: the same bits on every mesh,
        backend and CPU kind, two exact dots for a Rademacher A), which a receiver that replays
        the merge (a factors sync) needs; False — one plain fp32 dot, whose last bits depend on
        how the backend sums over r (fine where the merged weights are the only copy).
      layout: static; for a kernel that is not (*stack, in, out) (SketchSpec.layouts), which of
        its axes are stack, in and out: the merge works on ``layout.to_matrix(kernel)`` and gives
        the kernel back in its own shape (a transposed copy when the in axes are not all before
        the out axes, e.g. an Einsum kernel (heads, embed, head_dim); else reshapes only).

    ``params + update`` (what ``optax.apply_updates`` does) materialises this leaf's ΔW; use
    ``apply_updates`` of this module to merge in place, layers in steps, instead. Transforms placed after
    LoGRA in a chain must leave these leaves alone: scaling ``key`` would corrupt A.
    """

    factor: jax.Array
    key: jax.Array
    weight_scale: jax.Array
    distribution: str = dataclasses.field(default="rademacher", metadata=dict(static=True))
    rounding: str = dataclasses.field(default="nearest", metadata=dict(static=True))
    exact: bool = dataclasses.field(default=True, metadata=dict(static=True))
    layout: KernelLayout | None = dataclasses.field(default=None, metadata=dict(static=True))

    __array_ufunc__ = None  # make numpy defer `ndarray + LowRankUpdate` to __radd__
    tree_path_leaf = True   # one leaf for tree_paths.leaves_with_paths, not its factor and key

    @property
    def stack_shape(self) -> tuple[int, ...]:
        return self.factor.shape[:-2]

    def delta_kernel(self, in_dim: int) -> jax.Array:
        """ΔK = Aᵀ·Uᵀ (*stack, in, out) in fp32 — the whole leaf at once (the drop-in path only)."""
        _check_key(self)
        def one(u, key):
            return _delta_one(u, key, in_dim, self.distribution, self.exact)
        return by_platform(lambda f, k, chunk: map_layers(one, self.stack_shape, f, k, chunk=chunk),
                           self.stack_shape, _delta_bytes((in_dim, self.factor.shape[-2]), self.exact),
                           self.factor, self.key)

    def merge_into(self, kernel: jax.Array) -> jax.Array:
        """weight_scale·K + ΔK in place (with donation), in K's dtype, layers in steps
        (`layers_per_step`)."""
        return self.merge_counting_changes(kernel)[0]

    def merge_counting_changes(self, kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``merge_into`` and the fraction of K's entries whose stored value changed (fp32 scalar).

        The count is taken inside the merge (new ≠ old of each layer), so it costs one comparison
        per entry and no copy of the old weights. For bf16 kernels under
        round-to-nearest it shows how much of an update vanished below half an ulp.
        """
        if self.layout is not None:
            merged, changed = dataclasses.replace(self, layout=None).merge_counting_changes(
                self.layout.to_matrix(kernel))
            return self.layout.from_matrix(merged, kernel.shape), changed
        _check_kernel(kernel, self)
        if not self.stack_shape:
            merged = _merge_one(kernel, self.factor, self.key, self.weight_scale,
                                self.distribution, self.rounding, self.exact)
            return merged, _changed_fraction(merged, kernel)
        n = math.prod(self.stack_shape)
        kernels = kernel.reshape((n,) + kernel.shape[-2:])
        factors = self.factor.reshape((n,) + self.factor.shape[-2:])
        keys = self.key.reshape((n,) + self.key.shape[len(self.stack_shape):])

        def merge_one(old, factor, key):
            return _merge_one(old, factor, key, self.weight_scale, self.distribution,
                              self.rounding, self.exact)
        kernels, changed = by_platform(
            lambda k, f, keys_, chunk: _merge_stack(merge_one, k, f, keys_, chunk),
            self.stack_shape, _delta_bytes(kernel.shape[-2:], self.exact), kernels, factors, keys)
        return kernels.reshape(kernel.shape), changed

    def __radd__(self, kernel):
        if self.layout is not None:
            kernel = jnp.asarray(kernel)
            merged = dataclasses.replace(self, layout=None).__radd__(self.layout.to_matrix(kernel))
            return self.layout.from_matrix(merged, kernel.shape)
        _check_kernel(kernel, self)
        kernel = jnp.asarray(kernel)
        delta = self.delta_kernel(kernel.shape[-2])
        return (rounded(self.weight_scale * kernel.astype(jnp.float32)) + delta).astype(kernel.dtype)

    __add__ = __radd__


def _merge_stack(merge_one, kernels, factors, keys, chunk: int):
    """(kernels with every layer i ← merge_one(kernels[i], factors[i], keys[i]), the mean over
    layers of the fraction of entries that changed), ``chunk`` layers per step (`map_layers`).

    Written in place: a loop over steps reads and rewrites its layers of the stack's buffer
    (fori_loop + dynamic_update_slice; a scan emitting a new stack would hold a second copy of all
    target weights), and with one step for all layers each entry's new value is an elementwise
    function of its old one, which XLA writes over the donated buffer.
    """
    n = kernels.shape[0]
    if chunk >= n:
        merged = jax.vmap(merge_one)(kernels, factors, keys)
        return merged, jnp.sum(jax.vmap(_changed_fraction)(merged, kernels)) / n
    if chunk == 1:
        def body(i, carry):
            kernels, changed = carry
            old = jax.lax.dynamic_index_in_dim(kernels, i, keepdims=False)
            new = merge_one(old, factors[i], keys[i])
            return (jax.lax.dynamic_update_index_in_dim(kernels, new, i, 0),
                    changed + _changed_fraction(new, old) / n)
        return jax.lax.fori_loop(0, n, body, (kernels, jnp.zeros((), jnp.float32)))

    def merge_layers(kernels, changed, start, size):
        old = jax.lax.dynamic_slice_in_dim(kernels, start, size)
        new = jax.vmap(merge_one)(old, jax.lax.dynamic_slice_in_dim(factors, start, size),
                                  jax.lax.dynamic_slice_in_dim(keys, start, size))
        return (jax.lax.dynamic_update_slice_in_dim(kernels, new, start, 0),
                changed + jnp.sum(jax.vmap(_changed_fraction)(new, old)) / n)

    steps, tail = divmod(n, chunk)
    kernels, changed = jax.lax.fori_loop(
        0, steps, lambda i, c: merge_layers(*c, i * chunk, chunk), (kernels, jnp.zeros((), jnp.float32)))
    if tail:
        kernels, changed = merge_layers(kernels, changed, steps * chunk, tail)
    return kernels, changed


def _delta_bytes(shape: tuple[int, int], exact: bool) -> int:
    """Bytes a layer's ΔK (in, out) holds while it is formed: the fp32 product, and for the
    order-free one also the running sum its exact slice products are added to."""
    return 4 * math.prod(shape) * (2 if exact else 1)


def _check_key(update: LowRankUpdate):
    """A's key must still be PRNG key data: a transform chained after ``logra(...)`` that maps
    every leaf (``optax.scale(0.5)``) turns it into floats, and JAX's own error ("invalid PRNG key
    data") does not say why."""
    dtype = getattr(update.key, "dtype", None)
    if dtype is not None and dtype != jnp.uint32:
        raise ValueError(
            f"a LowRankUpdate's key (the seed of its projection A) is {dtype}, not uint32: a "
            f"transformation placed after logra(...) in an optax chain changed it (optax.scale "
            f"and the like multiply every leaf of the update, A's key and weight_scale "
            f"included). logra(...) must be the last transformation of the chain: put the other "
            f"one before it, e.g. optax.chain(optax.scale(0.5), logra(...)), or scale logra's "
            f"learning_rate (docs/optax_api.md)")


def _check_kernel(kernel, update: LowRankUpdate):
    _check_key(update)
    expected = update.stack_shape + (update.factor.shape[-2],)
    if kernel.ndim < 2 or tuple(kernel.shape[:-2]) + (kernel.shape[-1],) != expected:
        raise ValueError(f"a LowRankUpdate with factor {update.factor.shape} cannot update a kernel "
                         f"of shape {tuple(kernel.shape)} (expected (*stack, in, out) with "
                         f"(*stack, out) = {expected})")


def _delta_one(u, key, in_dim, distribution, exact=True):
    """ΔK = Aᵀ·Uᵀ (in, out) in fp32, as unitᵀ·(s·U)ᵀ with A = s·unit.

    ``exact``: the product is `order_free_matmul`: its bits do not depend on how a backend sums
    over r, so a receiver on another mesh, CPU kind or kernel library merges exactly what the
    trainer merged. U is taken exactly as it is (as sent: `rounded` keeps a compiler from folding
    a preceding cast to bf16 into the fp32 product, as GPU backends may with excess precision), and
    s·U is rounded once, before the product (no fused multiply-add can skip that rounding).
    Otherwise one fp32 dot: as accurate as a plain product, at half the order-free one's cost for
    a Rademacher A (one dot instead of two; measured in launch/step_time.py --merge). Its operands
    are materialised transposed (unitᵀ is generated in that order: the hash fuses into the
    transpose) so that the product is canonical, (in × r)·(r × out), which XLA:CPU runs through
    YNNPACK; written as unitᵀ·(s·U)ᵀ over the untransposed arrays it is an Eigen dot (the merge
    alone at width 2048: 0.93 of the time; docs/results/step_time.md).
    """
    unit, scale = projection_parts(key, u.shape[-1], in_dim, distribution)    # (r, in)
    scaled = rounded(rounded(u).astype(jnp.float32) * scale)
    if not exact:
        barrier = jax.lax.optimization_barrier
        return jnp.matmul(barrier(unit.T), barrier(scaled.T), precision=_HIGHEST)
    return order_free_matmul(unit.T, scaled.T, x_is_sign=distribution in SIGN_DISTRIBUTIONS)


# Folded into A's key for the rounding bits: a key of its own, a function of (seed, target, k, layer).
_ROUNDING_SALT = 0x5352


def _merge_one(kernel, u, key, weight_scale, distribution, rounding="nearest", exact=True):
    """ws·K + ΔK in K's dtype; ws·K is rounded before the add, as on every side of a sync. To a
    bf16 K the fp32 sum is rounded by ``rounding``, stochastically with a key derived from A's."""
    with jax.named_scope("logra_merge"):  # named for profiles (logra_jax/perf/profiling.py)
        delta = _delta_one(u, key, kernel.shape[0], distribution, exact)
        merged = rounded(weight_scale * kernel.astype(jnp.float32)) + delta
        return round_to(merged, kernel.dtype, rounding,
                        jax.random.fold_in(key, _ROUNDING_SALT) if rounding == "stochastic" else None)


def _changed_fraction(new: jax.Array, old: jax.Array) -> jax.Array:
    # A mean of 0/1 in fp32: exact enough for a fraction, and no int32 overflow on large layers.
    return jnp.mean((new != old).astype(jnp.float32))


def _is_low_rank(x) -> bool:
    return isinstance(x, LowRankUpdate)


def apply_updates(params, updates):
    """params + updates, merging LowRankUpdate leaves in place, a stack's layers in steps.

    Drop-in for ``optax.apply_updates``; jit it with ``donate_argnums=0`` so every target is
    updated in place and no ΔW larger than one step's layers ever exists (one layer on a CPU or a
    TPU; `GPU_STEP_BYTES` of layers on a GPU).
    """
    return apply_updates_counting_changes(params, updates)[0]


def _dense_first(params, updates):
    """(params, updates), on a GPU only once the dense updates are applied: the merges' batched
    steps then start after the dense leaves' gradients and updates (an embedding's are a
    parameter-sized pair) are freed, instead of holding their temporaries beside them."""
    if not any(isinstance(u, LowRankUpdate) for u in jax.tree.leaves(updates, is_leaf=_is_low_rank)):
        return params, updates
    return jax.lax.platform_dependent(
        (params, updates), default=lambda x: x,
        **{p: jax.lax.optimization_barrier for p in _BATCHED_PLATFORMS})


def apply_updates_counting_changes(params, updates):
    """``apply_updates`` and the fraction of low-rank-updated entries whose stored value changed.

    The fraction is over all entries of all LowRankUpdate targets, weighted by size; NaN when the
    tree has no LowRankUpdate (a dense optimizer: there is nothing low rank to count).
    """
    changed, total = [], []

    def add(p, u):
        if p is None or u is None or isinstance(u, LowRankUpdate):
            return p
        return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)

    def merge(p, u):
        if isinstance(u, LowRankUpdate) and p is not None:
            merged, fraction = u.merge_counting_changes(p)
            changed.append(fraction * float(p.size))   # a Python float: sizes pass int32 at 7B
            total.append(float(p.size))
            return merged
        return p
    params = jax.tree.map(add, params, updates, is_leaf=lambda x: x is None)
    params, updates = _dense_first(params, updates)
    params = jax.tree.map(merge, params, updates, is_leaf=lambda x: x is None)
    fraction = (sum(changed) / sum(total)).astype(jnp.float32) if total else jnp.float32(jnp.nan)
    return params, fraction


def scale_updates(updates, scale: jax.Array):
    """updates·scale, where a LowRankUpdate scales its ΔW: U·s and weight_scale 1 + s·(ws − 1)."""
    def one(u):
        if isinstance(u, LowRankUpdate):
            return dataclasses.replace(u, factor=(u.factor * scale).astype(u.factor.dtype),
                                       weight_scale=1.0 + scale * (u.weight_scale - 1.0))
        return (u * scale).astype(u.dtype)
    return jax.tree.map(one, updates, is_leaf=_is_low_rank)


def zero_updates(updates):
    """Updates that change nothing (factor 0, weight_scale 1, dense 0), same structure and dtypes."""
    def one(u):
        if isinstance(u, LowRankUpdate):
            return dataclasses.replace(u, factor=jnp.zeros_like(u.factor),
                                       weight_scale=jnp.ones_like(u.weight_scale))
        return jnp.zeros_like(u)
    return jax.tree.map(one, updates, is_leaf=_is_low_rank)


def all_finite(tree) -> jax.Array:
    """True iff every float entry of the tree (LowRankUpdate factors and scales included) is finite."""
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)
