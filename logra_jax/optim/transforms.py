"""The optax pieces around RowAdam that turn a sketch into a weight update (docs/algorithm.md §5).

Order inside ``logra(...)``::

    clip_by_reconstructed_norm   sketch dense target grads; global norm ‖g‖ over the reconstructed
                                 gradient S·A of targets and the dense rest; optional clipping
    partition  targets: scale_by_row_adam → scale_by_step_size (learning_rate)
                                          | scale_by_update_ratio (kl)
               others:  AdamW | frozen
    scale_by_predicted_kl        optional (§6): α on everything, still in sketch space
    to_low_rank_updates          U → LowRankUpdate(U, key of A, weight_scale); bf16 U for "kl"
  all wrapped in skip_nonfinite.

Each transform that needs A_l(k) keeps its own ``update_index``; all advance once per update call,
skipped or not, so they agree with each other and with ``update_index(opt_state)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from logra_jax.optim import low_rank
from logra_jax.optim.low_rank import LowRankUpdate
from logra_jax.optim.rounding import ROUNDINGS
from logra_jax.optim.row_adam import as_sketch
from logra_jax.optim.targets import SketchSpec, require_params
from logra_jax.tree_paths import leaves_with_paths, map_with_paths

_TINY = float(jnp.finfo(jnp.float32).tiny)


def _f32(value) -> jax.Array:
    """A hyperparameter (or a schedule's value) as an fp32 array, so the arithmetic is the same
    for Python floats and for arrays injected by optax.inject_hyperparams."""
    return jnp.asarray(value, jnp.float32)


def _at(schedule, count) -> jax.Array:
    return _f32(schedule(count) if callable(schedule) else schedule)


def _sq_norm(x) -> jax.Array:
    return jnp.sum(jnp.square(jnp.asarray(x, jnp.float32)))


def _zero_index(spec: SketchSpec) -> jax.Array:
    return spec.projection_index(jnp.zeros([], jnp.int32))


class ReconstructedNormState(NamedTuple):
    """update_index: k of the next gradient; grad_norm: reconstructed ‖g‖ of the last one."""

    update_index: jax.Array
    grad_norm: jax.Array
    KEPT_ON_SKIP = ("update_index", "grad_norm")


def clip_by_reconstructed_norm(spec: SketchSpec = SketchSpec(),
                               max_norm: float | None = None) -> optax.GradientTransformationExtraArgs:
    r"""Sketches dense target gradients and (optionally) clips by the reconstructed global norm.

        ‖g‖² = Σ_l ‖S_l A_l‖²_F + Σ_others ‖g‖² ,   ‖S A‖²_F = trace(S (A Aᵀ) Sᵀ)  (r × r Grams)

    This is the norm of the gradient the update is actually built from (S·A, not G), as in the
    reference. With ``max_norm`` every leaf is scaled by min(1, max_norm/‖g‖). The norm is kept in
    state for metrics (``grad_norm``). Output target leaves are always sketches.
    """
    if max_norm is not None and not isinstance(max_norm, jax.core.Tracer) and float(max_norm) <= 0:
        raise ValueError(f"max_grad_norm must be positive or None, got {max_norm!r}")

    def init_fn(params):
        spec.find_targets(params)
        return ReconstructedNormState(update_index=_zero_index(spec),
                                      grad_norm=jnp.zeros([], jnp.float32))

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        targets = spec.find_targets(require_params(params, "clip_by_reconstructed_norm"))
        k = state.update_index
        sketches = {path: as_sketch(g, targets[path], spec, k)
                    for path, g in leaves_with_paths(updates) if path in targets}
        keys = spec.keys_of({path: targets[path] for path in sketches}, k)
        sq = low_rank.reconstructed_sq_norm_sum(
            ((s, keys[path], targets[path].in_dim, targets[path].stack_shape)
             for path, s in sketches.items()), spec.distribution)
        for path, g in leaves_with_paths(updates):
            if path not in targets:
                sq += _sq_norm(g)
        norm = jnp.sqrt(sq)
        if max_norm is None:
            scale = jnp.ones([], jnp.float32)
        else:
            scale = jnp.minimum(1.0, _f32(max_norm) / jnp.maximum(norm, _TINY))

        def out(path, g):
            g = sketches.get(path, g)
            return (g * scale).astype(g.dtype)
        return (map_with_paths(out, updates),
                ReconstructedNormState(update_index=spec.next_index(k), grad_norm=norm))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class StepSizeState(NamedTuple):
    count: jax.Array
    KEPT_ON_SKIP = ("count",)


def scale_by_step_size(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformationExtraArgs:
    """u ← −lr(t)·u on every leaf (the learning-rate variant's η, applied to D in sketch space).

    Same as ``optax.scale_by_learning_rate``, except that its counter advances on skipped steps like
    every LoGRA counter, so lr(t) here and the weight decay of ``to_low_rank_updates`` stay in step.
    """
    def init_fn(params):
        del params
        return StepSizeState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        lr = _at(learning_rate, state.count)
        updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
        return updates, StepSizeState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class UpdateRatioState(NamedTuple):
    update_index: jax.Array
    KEPT_ON_SKIP = ("update_index",)


def scale_by_update_ratio(spec: SketchSpec = SketchSpec(),
                          update_ratio: float = 6e-5) -> optax.GradientTransformationExtraArgs:
    r"""The KL variant's step size: U_l = −c·D_l with one global c for all targets (§5).

        c = update_ratio · ‖W‖ / ‖ΔW_prop‖,   ‖W‖² = Σ_l ‖W_l‖²_F,   ‖ΔW_prop‖² = Σ_l trace(D_l A_l A_lᵀ D_lᵀ)

    so the proposed change of all target weights together has relative size ``update_ratio``.
    Includes the descent sign. Non-target leaves pass unchanged; needs params.
    """
    if not isinstance(update_ratio, jax.core.Tracer) and float(update_ratio) <= 0:
        raise ValueError(f"update_ratio must be positive, got {update_ratio!r}")

    def init_fn(params):
        spec.find_targets(params)
        return UpdateRatioState(update_index=_zero_index(spec))

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        params = require_params(params, "scale_by_update_ratio")
        targets = spec.find_targets(params)
        k = state.update_index
        weight_sq = sum(_sq_norm(p) for path, p in leaves_with_paths(params) if path in targets)
        keys = spec.keys_of(targets, k)
        delta_sq = low_rank.reconstructed_sq_norm_sum(
            ((d, keys[path], targets[path].in_dim, targets[path].stack_shape)
             for path, d in leaves_with_paths(updates) if path in targets), spec.distribution)
        delta_norm = jnp.sqrt(delta_sq)
        c = jnp.where(delta_norm > 0,
                      _f32(update_ratio) * jnp.sqrt(weight_sq) / jnp.maximum(delta_norm, _TINY), 0.0)
        updates = map_with_paths(
            lambda path, u: (-c * u).astype(u.dtype) if path in targets else u, updates)
        return updates, UpdateRatioState(update_index=spec.next_index(k))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class LowRankState(NamedTuple):
    count: jax.Array
    update_index: jax.Array
    KEPT_ON_SKIP = ("count", "update_index")


def to_low_rank_updates(spec: SketchSpec = SketchSpec(), *,
                        learning_rate: optax.ScalarOrSchedule | None = None,
                        weight_decay: float = 0.0,
                        factor_dtype=None,
                        merge_rounding: str = "nearest",
                        exact_merge: bool = True) -> optax.GradientTransformationExtraArgs:
    """Wraps each target's factor U (*stack, out, r) as ``LowRankUpdate(U, key of A_l(k), ws)``.

    ``weight_scale`` ws = 1 − lr(t)·weight_decay (decoupled decay, learning-rate variant) or 1.
    ``factor_dtype`` rounds U (the KL variant uses bfloat16, so a receiver applying the same bf16
    factor with the same A reproduces the trainer's merge exactly, §8). ``merge_rounding``: how a
    bf16 kernel receives the fp32 merge result ("nearest" | "stochastic", ``LowRankUpdate``).
    ``exact_merge``: an order-free U·A (``LowRankUpdate.exact``), which a receiver replaying the
    merge needs; False: one plain fp32 dot, half the merge's multiplications.
    Must be the last LoGRA transform: later transforms would see ``LowRankUpdate`` leaves.
    """
    if merge_rounding not in ROUNDINGS:
        raise ValueError(f"merge_rounding must be one of {ROUNDINGS}, got {merge_rounding!r}")
    def init_fn(params):
        spec.find_targets(params)
        return LowRankState(count=jnp.zeros([], jnp.int32), update_index=_zero_index(spec))

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        targets = spec.find_targets(require_params(params, "to_low_rank_updates"))
        k = state.update_index
        if learning_rate is None:
            weight_scale = jnp.ones([], jnp.float32)
        else:
            weight_scale = 1.0 - _at(learning_rate, state.count) * _f32(weight_decay)

        keys = spec.keys_of(targets, k)

        def wrap(path, u):
            if path not in targets:
                return u
            info = targets[path]
            if tuple(u.shape) != info.sketch_shape:
                raise ValueError(f"to_low_rank_updates: update of target {path!r} has shape "
                                 f"{tuple(u.shape)}, expected the factor shape {info.sketch_shape}; "
                                 f"put it after scale_by_row_adam in the chain")
            factor = u if factor_dtype is None else u.astype(factor_dtype)
            return LowRankUpdate(factor=factor, key=keys[path], weight_scale=weight_scale,
                                 distribution=spec.distribution, rounding=merge_rounding,
                                 exact=exact_merge, layout=info.layout)

        return (map_with_paths(wrap, updates),
                LowRankState(count=optax.safe_increment(state.count), update_index=spec.next_index(k)))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class SkipNonFiniteState(NamedTuple):
    """inner_state; skipped: whether the last update was dropped; num_skipped: how many so far."""

    inner_state: Any
    skipped: jax.Array
    num_skipped: jax.Array


def _keeps_fields(x) -> bool:
    return hasattr(type(x), "KEPT_ON_SKIP") and hasattr(x, "_fields")


def _select_state(ok: jax.Array, new, old):
    """new where ok, else old — except LoGRA's counters and metrics (KEPT_ON_SKIP), always new."""
    def pick(n, o):
        if _keeps_fields(n):
            return type(n)(*[getattr(n, f) if f in n.KEPT_ON_SKIP else _select_state(ok, getattr(n, f), getattr(o, f))
                             for f in n._fields])
        return jnp.where(ok, n, o)
    return jax.tree.map(pick, new, old, is_leaf=_keeps_fields)


def skip_nonfinite(inner: optax.GradientTransformation, *,
                   gradient_by_norm: bool = False) -> optax.GradientTransformationExtraArgs:
    """Drops a whole update whose gradient or result is not finite: nothing reaches the weights.

    The update becomes zero (``LowRankUpdate`` factor 0, weight_scale 1), the inner state is kept as
    it was — except LoGRA's counters, which advance so A stays in sync with the trainer's probes —
    and ``skipped``/``num_skipped`` record it.

    ``gradient_by_norm``: ``inner`` holds a `clip_by_reconstructed_norm`, whose ``grad_norm`` sums
    the square of every gradient entry, so the gradient is finite iff that norm is (a squared norm
    past fp32's range, ‖g‖ > ~1.8e19, counts as non-finite too): the gradient is not read a second
    time, leaf by leaf (on a GPU one or two reduction kernels per leaf).
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return SkipNonFiniteState(inner_state=inner.init(params), skipped=jnp.zeros([], jnp.bool_),
                                  num_skipped=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
        gradient_ok = (jnp.isfinite(optax.tree.get(new_inner, "grad_norm")) if gradient_by_norm
                       else low_rank.all_finite(updates))
        ok = gradient_ok & low_rank.all_finite(new_updates)
        zeros = low_rank.zero_updates(new_updates)
        out = jax.tree.map(lambda n, z: jnp.where(ok, n, z), new_updates, zeros)
        return out, SkipNonFiniteState(
            inner_state=_select_state(ok, new_inner, state.inner_state), skipped=~ok,
            num_skipped=state.num_skipped + (~ok).astype(jnp.int32))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def skip_nonfinite_gradients(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` only on a finite gradient; otherwise the update is zero and the state kept.

    For dense optimizers (the AdamW baseline): a ``lax.cond`` executes one branch, so, unlike
    ``skip_nonfinite``'s select, old and new moments never need to exist side by side (that select
    costs a second copy of AdamW's state). What it cannot see is a finite gradient that ``inner``
    turns into a non-finite update; the trainer's weight checks stop such a run before it is saved.
    State and metrics as ``skip_nonfinite`` (``SkipNonFiniteState``).
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return SkipNonFiniteState(inner_state=inner.init(params), skipped=jnp.zeros([], jnp.bool_),
                                  num_skipped=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        ok = low_rank.all_finite(updates)

        def apply(operands):
            grads, inner_state = operands
            return inner.update(grads, inner_state, params, **extra_args)

        def skip(operands):
            grads, inner_state = operands
            return jax.tree.map(jnp.zeros_like, grads), inner_state

        out, new_inner = jax.lax.cond(ok, apply, skip, (updates, state.inner_state))
        return out, SkipNonFiniteState(inner_state=new_inner, skipped=~ok,
                                       num_skipped=state.num_skipped + (~ok).astype(jnp.int32))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
