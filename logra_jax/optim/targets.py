"""Which weights LoGRA sketches, and the trainer-facing plumbing around them (docs/algorithm.md §1–3).

A *target* is a parameter whose '/'-joined path matches ``SketchSpec.targets`` (by default the
q/k/v/o/gate/up/down projection kernels). Its leaf has Flax kernel layout (*stack, in, out) with
W = kernelᵀ; a scanned stack of layers adds leading ``stack`` dims and every layer gets its own A.
A kernel of another shape (LinearGeneral, Einsum: e.g. (embed, heads, head_dim)) is named in
``SketchSpec.layouts`` by a ``KernelLayout`` that says which of its axes are stack, in and out.

One gradient step of a trainer, with these helpers::

    spec = SketchSpec(rank=256)                       # the same spec logra(...) was built with
    probes = make_probes(params, update_index(opt_state), spec)    # {target path: SketchProbe}
    target_kernels, others = split_targets(params, spec)
    def loss(others, factors):                        # the model reads probes by kernel path
        return loss_fn(merge_targets(others, target_kernels), with_factors(probes, factors))
    other_grads, sketches = jax.grad(loss, argnums=(0, 1))(others, probe_factors(probes))
    grads = merge_targets(other_grads, sketches)      # params-shaped: S at targets, dense elsewhere
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import optax

from logra_jax.projections import (DISTRIBUTIONS, KernelLayout, SketchProbe, hash_words,
                                   projection_keys, projection_keys_of)
from logra_jax.sharding import sharding_without_in_dim
from logra_jax.tree_paths import leaves_with_paths, map_with_paths, path_str

# The attention and MLP projections of Llama-family models, by the end of their kernel path.
DEFAULT_TARGETS = r"(^|/)(q|k|v|o|gate|up|down)_proj/kernel$"


@dataclasses.dataclass(frozen=True)
class TargetInfo:
    """Static facts about one target: kernel (*stack, in, out), sketch (*stack, out, rank).

    With a ``layout`` the kernel has its own ``shape`` and is the (*stack, in, out) matrix
    ``layout.to_matrix(kernel)``; in and out are then products of several of its axes.
    """

    path: str
    stack_shape: tuple[int, ...]
    in_dim: int
    out_dim: int
    rank: int
    layout: KernelLayout | None = None
    shape: tuple[int, ...] | None = None

    @property
    def kernel_shape(self) -> tuple[int, ...]:
        if self.shape is not None:
            return self.shape
        return self.stack_shape + (self.in_dim, self.out_dim)

    def to_matrix(self, kernel: jax.Array) -> jax.Array:
        """A kernel-shaped array (the kernel, its dense gradient) as (*stack, in, out)."""
        return kernel if self.layout is None else self.layout.to_matrix(kernel)

    @property
    def sketch_shape(self) -> tuple[int, ...]:
        return self.stack_shape + (self.out_dim, self.rank)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of RowAdam's v: one value per output row of every layer in the stack."""
        return self.stack_shape + (self.out_dim,)


@dataclasses.dataclass(frozen=True)
class SketchSpec:
    """Everything that decides A_l(k) — shared by logra(...) and make_probes so they agree.

    Attributes:
      targets: regex searched in each parameter path; matches are sketched (§1).
      rank: r, below every target's input width (`find_targets` refuses one that is not,
        naming the targets): a sketch G·Aᵀ with r ≥ in compresses nothing (it is at least as wide
        as the gradient), and a square kernel's sketch would have the kernel's shape. One rule
        for every path in (``logra(...)``, ``nnx_sketch.prepare``, ``launch.train``), never a
        rank lowered quietly for the narrow layers.
      seed: base seed of every projection.
      distribution: "rademacher" (±1/√r from hashed signs, default), "rademacher_threefry" (±1/√r,
        jax.random.rademacher's stream) or "gaussian" (N(0, 1/r)).
      refresh: draw a fresh A after every update (k advances); False keeps A at k = 0 forever.
      layouts: {target path: KernelLayout} for kernels that are not (*stack, in, out) — what
        ``logra_jax.nnx_sketch`` finds for LinearGeneral and Einsum layers (stored as sorted pairs).
    """

    targets: str = DEFAULT_TARGETS
    rank: int = 256
    seed: int = 42
    distribution: str = "rademacher"
    refresh: bool = True
    layouts: tuple[tuple[str, KernelLayout], ...] = ()

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"rank must be a positive Python int (it fixes array shapes), "
                             f"got {self.rank!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be a Python int, got {self.seed!r}")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {self.distribution!r}")
        if not isinstance(self.targets, str):
            raise ValueError(f"targets must be a regex string, got {self.targets!r}")
        try:
            re.compile(self.targets)
        except re.error as err:
            raise ValueError(f"targets is not a valid regex ({err}): {self.targets!r}") from None
        if not isinstance(self.refresh, bool):
            raise ValueError(f"refresh must be a bool, got {self.refresh!r}")
        layouts = dict(self.layouts or ())
        for path, layout in layouts.items():
            if not isinstance(path, str) or not isinstance(layout, KernelLayout):
                raise ValueError(f"layouts must map target paths to KernelLayouts, got "
                                 f"{path!r}: {layout!r}")
        object.__setattr__(self, "layouts", tuple(sorted(layouts.items())))

    def is_target(self, path: str) -> bool:
        return re.search(self.targets, path) is not None

    def info(self, path: str, shape: tuple[int, ...]) -> TargetInfo:
        """TargetInfo of a target leaf; ValueError if it is not a (stack of) matrices."""
        layout = dict(self.layouts).get(path)
        if layout is not None:
            *stack, in_dim, out_dim = layout.matrix_shape(tuple(int(d) for d in shape))
            return TargetInfo(path, tuple(stack), in_dim, out_dim, min(self.rank, in_dim),
                              layout=layout, shape=tuple(int(d) for d in shape))
        if len(shape) < 2:
            raise ValueError(f"target {path!r} has shape {tuple(shape)}, not a matrix: the targets "
                             f"pattern {self.targets!r} must match only 2-D (or stacked) kernels")
        *stack, in_dim, out_dim = (int(d) for d in shape)
        return TargetInfo(path, tuple(stack), in_dim, out_dim, min(self.rank, in_dim))

    def find_targets(self, params) -> dict[str, TargetInfo]:
        """{path: TargetInfo} of every target in ``params`` (ordered as the tree flattens).

        Raises ValueError when nothing matches — LoGRA must never silently train nothing — or when
        ``rank`` is not below a target's input width (`SketchSpec`'s rank), naming those targets.
        """
        leaves = leaves_with_paths(params)
        found = {p: self.info(p, tuple(x.shape)) for p, x in leaves if self.is_target(p)}
        if not found:
            examples = ", ".join(repr(p) for p, _ in leaves[:6])
            raise ValueError(f"targets pattern {self.targets!r} matched no parameter; "
                             f"parameter paths look like: {examples}")
        stray = [path for path, _ in self.layouts if path not in found]
        if stray:
            raise ValueError(f"layouts name {stray}, which are not targets of these params")
        narrow = [info for info in found.values() if self.rank >= info.in_dim]
        if narrow:
            narrowest = min(info.in_dim for info in narrow)
            named = ", ".join(f"{info.path!r} ({info.in_dim})" for info in narrow[:4])
            more = f" and {len(narrow) - 4} more" if len(narrow) > 4 else ""
            raise ValueError(
                f"rank {self.rank} is not below the input width of {len(narrow)} target"
                f"{'s' if len(narrow) > 1 else ''}: {named}{more}; a sketch of rank r ≥ in "
                f"compresses nothing, so no target's rank is lowered for it: lower rank below "
                f"{narrowest} (or exclude those targets)")
        for info in found.values():   # a layout's matrix view: the same ambiguity, stated
            if info.sketch_shape == info.kernel_shape:
                raise ValueError(
                    f"target {info.path!r}: its sketch shape {info.sketch_shape} equals its kernel "
                    f"shape, so a gradient leaf cannot tell dense from sketched; lower rank below "
                    f"{info.in_dim} (or exclude this target)")
        return found

    def projection_index(self, count: jax.Array | int) -> jax.Array:
        """k for the gradient that follows ``count`` updates: count with refresh, else 0."""
        count = jnp.asarray(count, jnp.int32)
        return count if self.refresh else jnp.zeros_like(count)

    def next_index(self, update_index: jax.Array) -> jax.Array:
        """k after one more update: k + 1 with refresh, else k stays 0."""
        return optax.safe_increment(update_index) if self.refresh else update_index

    def keys(self, info: TargetInfo, update_index: jax.Array | int) -> jax.Array:
        """PRNG key data of A for every layer of the target: shape (*stack, 2)."""
        return projection_keys(self.seed, info.path, update_index, info.stack_shape)

    def keys_of(self, targets: dict[str, TargetInfo], update_index: jax.Array | int) -> dict[str, jax.Array]:
        """{path: ``keys(info, update_index)``} of all ``targets``, derived together (the same keys;
        `projection_keys_of`)."""
        return projection_keys_of(self.seed, {path: info.stack_shape for path, info in targets.items()},
                                  update_index)


def make_probes(params, update_index: jax.Array | int, spec: SketchSpec,
                dtype=jnp.float32) -> dict[str, SketchProbe]:
    """{target path: SketchProbe(key of A_l(k), zero factor B (*stack, out, r))} for one gradient.

    ``update_index`` is ``update_index(opt_state)``: the k the optimizer will use for this
    gradient. The factor is sharded like the kernel's out (and stack) dims when params are sharded.
    """
    k = spec.projection_index(update_index)
    kernels = dict(leaves_with_paths(params))
    targets = spec.find_targets(params)
    keys = spec.keys_of(targets, k)
    words = _hash_words_of(keys) if spec.distribution == "rademacher" else {}
    probes = {}
    for path, info in targets.items():
        factor = jnp.zeros(info.sketch_shape, dtype, device=sharding_without_in_dim(
            kernels[path], keep_last=True, layout=info.layout))
        probes[path] = SketchProbe(key=keys[path], factor=factor, distribution=spec.distribution,
                                   factor_is_zero=True, words=words.get(path))
    return probes


def _hash_words_of(keys: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """{path: hash_words of every key of the target} for all targets in one batched program: a
    layer loop (the backward pass) then reads its layer's words instead of deriving them."""
    if not keys:
        return {}
    paths = list(keys)
    flat = jnp.concatenate([keys[path].reshape(-1, keys[path].shape[-1]) for path in paths])
    words = jax.vmap(hash_words)(flat)
    out, start = {}, 0
    for path in paths:
        n = math.prod(keys[path].shape[:-1])
        out[path] = words[start:start + n].reshape(keys[path].shape[:-1] + words.shape[1:])
        start += n
    return out


def probe_factors(probes: dict[str, SketchProbe]) -> dict[str, jax.Array]:
    """{path: B}: the differentiable part of the probes (their gradients are the sketches)."""
    return {path: probe.factor for path, probe in probes.items()}


def with_factors(probes: dict[str, SketchProbe], factors: dict[str, jax.Array]) -> dict[str, SketchProbe]:
    """The probes with their factors replaced by the traced ones inside a loss or a JVP.

    The factors must be the probes' own values (zeros from ``make_probes``), only traced: a probe
    made by ``make_probes`` promises B = 0 (``SketchProbe.factor_is_zero``) and the linear layer
    relies on it.
    """
    missing = set(probes) ^ set(factors)
    if missing:
        raise ValueError(f"probes and factors disagree on targets: {sorted(missing)}")
    return {path: dataclasses.replace(probe, factor=factors[path]) for path, probe in probes.items()}


def with_update_factors(probes: dict[str, SketchProbe],
                        factors: dict[str, jax.Array]) -> dict[str, SketchProbe]:
    """The probes carrying nonzero factors B = U: target l then computes x·W_l + (x·A_lᵀ)·U_lᵀ,
    the layer at W_l + U_l·A_l, without forming U_l·A_l (the predicted-KL safeguard runs the
    candidate update this way before it is merged)."""
    missing = set(probes) ^ set(factors)
    if missing:
        raise ValueError(f"probes and factors disagree on targets: {sorted(missing)}")
    return {path: dataclasses.replace(probe, factor=factors[path], factor_is_zero=False)
            for path, probe in probes.items()}


def split_targets(tree, spec: SketchSpec) -> tuple[dict[str, Any], Any]:
    """(targets {path: leaf}, others: the same tree with ``None`` at every target)."""
    targets = {}

    def keep_other(path, leaf):
        if spec.is_target(path):
            targets[path] = leaf
            return None
        return leaf

    others = map_with_paths(keep_other, tree)
    if not targets:
        spec.find_targets(tree)
    return targets, others


def merge_targets(others, targets: dict[str, Any]):
    """Fill the ``None`` holes of ``others`` from ``targets`` {path: leaf} (inverse of split)."""
    used = set()

    def fill(path, leaf):
        if leaf is None and path in targets:
            used.add(path)
            return targets[path]
        return leaf

    merged = jax.tree_util.tree_map_with_path(lambda kp, x: fill(path_str(kp), x), others,
                                              is_leaf=lambda x: x is None)
    unused = set(targets) - used
    if unused:
        raise ValueError(f"merge_targets: no hole for {sorted(unused)} in the tree (paths must "
                         f"match the params' '/'-joined key paths)")
    return merged


def require_params(params, transform: str):
    """LoGRA's transforms read target shapes (and, for the KL variant, weights) from params."""
    if params is None:
        raise ValueError(f"{transform}: update(...) needs params (target shapes come from them); "
                         f"call tx.update(grads, opt_state, params)")
    return params
