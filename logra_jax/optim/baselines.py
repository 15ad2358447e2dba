"""The dense-gradient optimizers a user would pick instead of LoGRA, as optax chains in our loop.

Each forms the full gradient of every trained parameter (what LoGRA's sketches avoid) and is

    skip_nonfinite_gradients( clip_by_global_norm(max_grad_norm) → optimizer )

so a non-finite gradient is skipped as for LoGRA (transforms.py), and clipping is the same.

  adamw      optax.adamw: fp32 m and v per parameter (2 × the weights).
  adafactor  optax.adafactor (Shazeer & Stern 2018): for an (n × m) matrix the second moment is
             factored into row and column statistics, V ≈ R·C / sum(R) (n + m numbers instead of
             n·m), no first moment by default, updates clipped to RMS ≤ clipping_threshold.
  galore     GaLore (Zhao et al. 2024; optim/galore.py, optax.contrib.galore's math): for each
             target matrix G (in × out) a projector P (G's top r singular vectors, recomputed
             every update_proj_gap steps by an SVD or, for TPUs, a randomized range finder) maps
             the gradient to R = Pᵀ·G (or G·P), Adam runs on R (2·r·max(in, out) moments) and
             the update P·Adam(R)·scale returns to full size. Targets are the LoGRA targets; the
             rest get AdamW. GaLore projects 2-D arrays, and our kernels are stacked
             (L, in, out), so `over_layers` runs it on one layer at a time (each layer its own
             projector, as in the paper), under lax.map so the refresh's lax.cond stays a branch.
"""

from __future__ import annotations

import optax
import jax

from logra_jax.optim.galore import galore
from logra_jax.optim.targets import DEFAULT_TARGETS, SketchSpec
from logra_jax.optim.transforms import skip_nonfinite_gradients
from logra_jax.tree_paths import map_with_paths


def _guarded(tx: optax.GradientTransformation, max_grad_norm: float) -> optax.GradientTransformation:
    clip = optax.clip_by_global_norm(max_grad_norm) if max_grad_norm > 0 else optax.identity()
    # skip_nonfinite_gradients, not skip_nonfinite: selecting between old and new moments keeps
    # both alive (+9 GiB per device at 7B for AdamW, measured); a cond runs one branch.
    return skip_nonfinite_gradients(optax.chain(clip, tx))


def adamw_baseline(learning_rate, *, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
                   max_grad_norm=1.0) -> optax.GradientTransformation:
    return _guarded(optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay),
                    max_grad_norm)


def adafactor_baseline(learning_rate, *, decay_rate=0.8, min_dim_size_to_factor=128,
                       clipping_threshold=1.0, multiply_by_parameter_scale=False, momentum=None,
                       weight_decay_rate=None, max_grad_norm=1.0) -> optax.GradientTransformation:
    """``multiply_by_parameter_scale`` off by default: the learning rate then means what it means
    for AdamW (an absolute step), so the same rate compares like with like."""
    return _guarded(optax.adafactor(learning_rate, decay_rate=decay_rate,
                                    min_dim_size_to_factor=min_dim_size_to_factor,
                                    clipping_threshold=clipping_threshold,
                                    multiply_by_parameter_scale=multiply_by_parameter_scale,
                                    momentum=momentum, weight_decay_rate=weight_decay_rate),
                    max_grad_norm)


def over_layers(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` applied to each slice [l] of stacked leaves (L, ...) separately, one after the
    other (lax.map): per-layer state, and control flow inside ``inner`` stays control flow."""
    def init_fn(params):
        return jax.lax.map(inner.init, params)

    def update_fn(updates, state, params=None):
        def one(args):
            g, s, p = args
            return inner.update(g, s, p)
        return jax.lax.map(one, (updates, state, params))

    return optax.GradientTransformation(init_fn, update_fn)


def galore_baseline(learning_rate, *, rank=128, update_proj_gap=200, scale=1.0, b1=0.9, b2=0.999,
                    eps=1e-8, weight_decay=0.0, targets=DEFAULT_TARGETS, projector="svd",
                    max_grad_norm=1.0) -> optax.GradientTransformation:
    """GaLore on the target projections (each layer its own projector), AdamW on the rest.
    ``projector``: "svd" (the paper's) or "randomized" (compiles in seconds for TPU; galore.py)."""
    is_target = SketchSpec(targets=targets).is_target

    def labels(params):
        return map_with_paths(lambda path, _: "galore" if is_target(path) else "adamw", params)

    projected = over_layers(galore(learning_rate, rank=rank, update_proj_gap=update_proj_gap,
                                   scale=scale, weight_decay=weight_decay, projector=projector,
                                   base_optimizer=optax.scale_by_adam(b1=b1, b2=b2, eps=eps)))
    rest = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    return _guarded(optax.partition({"galore": projected, "adamw": rest}, labels), max_grad_norm)
