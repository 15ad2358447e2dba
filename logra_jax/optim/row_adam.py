r"""RowAdam: Adam's second moment kept per output row of each sketched matrix (docs/algorithm.md §4).

For a target with sketch S (out × r) at update t (1-based):

    v_i ← β₂·v_i + (1 − β₂)·mean_j S_ij²                 (v: out, fp32 — the only state)

- ``"learning_rate"``: D_i = S_i / (sqrt(v_i / (1 − β₂ᵗ)) + ε)
- ``"kl"``:    S̃ = S / n_tokens (v is accumulated from S̃);  ρ_i = sqrt(v_i / (1 − β₂ᵗ));
               d_i = ρ_i + max(ε·mean_k ρ_k, tiny)   (ε relative to the typical row scale);
               D = diag(1/d)·S̃ · ‖S̃‖_F / ‖diag(1/d)·S̃‖_F   (only the direction changes, not the norm)
- ``"sgd"``:   D = S (a numerical reference; v stays 0)

There is no first moment, and v is indexed by output row rather than by sketch column, so nothing
has to be carried over when A is redrawn. Every reduction is per matrix: each layer of a stacked
target is its own S.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from logra_jax.optim import low_rank
from logra_jax.optim.targets import SketchSpec, TargetInfo, require_params
from logra_jax.sharding import sharding_without_in_dim
from logra_jax.tree_paths import leaves_with_paths, map_with_paths

VARIANTS = ("learning_rate", "kl", "sgd")
_TINY = float(jnp.finfo(jnp.float32).tiny)


class RowAdamState(NamedTuple):
    """count: updates so far (t − 1); update_index: k of the next gradient's A; v per target."""

    count: jax.Array
    update_index: jax.Array
    v: optax.Updates


def as_sketch(grad: jax.Array, info: TargetInfo, spec: SketchSpec, update_index) -> jax.Array:
    """The target's sketch S (*stack, out, r) in fp32, sketching a dense gradient if given one.

    A gradient leaf of kernel shape (*stack, in, out) is dense (drop-in optax use: saves optimizer
    state but not gradient memory); one of shape (*stack, out, r) is already a sketch.
    """
    shape = tuple(grad.shape)
    if shape == info.sketch_shape:
        return grad.astype(jnp.float32)
    if shape == info.kernel_shape:
        keys = spec.keys(info, update_index)
        return low_rank.sketch_dense(info.to_matrix(grad), keys, info.rank, spec.distribution,
                                     info.stack_shape)
    raise ValueError(f"gradient of target {info.path!r} has shape {shape}; expected the sketch "
                     f"{info.sketch_shape} (from make_probes) or the dense kernel gradient "
                     f"{info.kernel_shape}")


def row_adam_direction(s: jax.Array, v: jax.Array, t: jax.Array, *, variant: str, b2, eps,
                       num_tokens=1.0) -> tuple[jax.Array, jax.Array]:
    """(D, new v) for one target's sketch S (*stack, out, r) and row moments v (*stack, out)."""
    if variant == "sgd":
        return s, v
    # Hyperparameters as fp32 arrays: the same arithmetic whether they are Python floats or
    # arrays injected by optax.inject_hyperparams (1 − β₂ in float64 then rounded ≠ in fp32).
    b2, eps = jnp.asarray(b2, jnp.float32), jnp.asarray(eps, jnp.float32)
    if variant == "kl":
        s = s / jnp.asarray(num_tokens, jnp.float32)
    v = b2 * v + (1.0 - b2) * jnp.mean(jnp.square(s), axis=-1)
    rho = jnp.sqrt(v / (1.0 - b2 ** t))
    if variant == "learning_rate":
        return s / (rho + eps)[..., None], v
    denom = rho + jnp.maximum(eps * jnp.mean(rho, axis=-1, keepdims=True), _TINY)
    d = s / denom[..., None]
    norm_s = jnp.sqrt(jnp.sum(jnp.square(s), axis=(-2, -1), keepdims=True))
    norm_d = jnp.sqrt(jnp.sum(jnp.square(d), axis=(-2, -1), keepdims=True))
    return d * (norm_s / jnp.maximum(norm_d, _TINY)), v


def scale_by_row_adam(spec: SketchSpec = SketchSpec(), *, variant: str = "learning_rate", b2: float = 0.95,
                      eps: float = 1e-8, check_finite: bool = True) -> optax.GradientTransformationExtraArgs:
    """Sketch → RowAdam direction D (*stack, out, r) for every target; other leaves pass unchanged.

    Target gradients may be sketches S (the memory-saving path) or dense kernel gradients, which
    are sketched here with A_l(k) — that saves optimizer state, not gradient memory. A non-finite
    sketch is dropped whole: D = 0 for every target, v unchanged, counters still advance.
    ``check_finite=False`` leaves that to a guard around the chain (``logra(...)``'s
    ``skip_nonfinite``, which drops the whole update when any D is non-finite): the check reads
    every sketch once more, and on a GPU launches a reduction per target.

    Update kwargs: ``num_tokens`` (``"kl"``: the number of valid generated tokens the sketch sums
    over; default 1, i.e. the loss is already a token mean).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    _check_b2(b2)

    def init_fn(params):
        targets = spec.find_targets(params)

        def zeros(path, p):
            if path not in targets:
                return optax.MaskedNode()
            return jnp.zeros(targets[path].row_shape, jnp.float32,
                             device=sharding_without_in_dim(p, keep_last=False,
                                                            layout=targets[path].layout))
        zero = jnp.zeros([], jnp.int32)
        return RowAdamState(count=zero, update_index=spec.projection_index(zero),
                            v=map_with_paths(zeros, params))

    def update_fn(updates, state, params=None, *, num_tokens=None, **extra_args):
        del extra_args
        targets = spec.find_targets(require_params(params, "scale_by_row_adam"))
        sketches = {path: as_sketch(g, targets[path], spec, state.update_index)
                    for path, g in leaves_with_paths(updates) if path in targets}
        finite = low_rank.all_finite(sketches) if check_finite else jnp.asarray(True)
        t = (state.count + 1).astype(jnp.float32)
        tokens = 1.0 if num_tokens is None else num_tokens
        directions, moments = {}, {}
        for path, v in leaves_with_paths(state.v):
            d, new_v = row_adam_direction(sketches[path], v, t, variant=variant, b2=b2, eps=eps,
                                          num_tokens=tokens)
            directions[path] = jnp.where(finite, d, 0.0)
            moments[path] = jnp.where(finite, new_v, v)

        new_updates = map_with_paths(lambda path, g: directions.get(path, g), updates)
        new_v = map_with_paths(lambda path, v: moments[path], state.v)
        count = optax.safe_increment(state.count)
        return new_updates, RowAdamState(count=count, update_index=spec.projection_index(count),
                                         v=new_v)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_b2(b2):
    if isinstance(b2, jax.core.Tracer):
        return
    if not 0.0 <= float(b2) < 1.0:
        raise ValueError(f"b2 must be in [0, 1), got {b2!r}")
