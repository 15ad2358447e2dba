"""``logra(...)``: the whole LoGRA optimizer as one optax transformation, plus what a trainer reads
from its state (``update_index``, ``logra_metrics``).

    tx = logra(variant="learning_rate", learning_rate=1e-6)
    opt_state = tx.init(params)
    probes = make_probes(params, update_index(opt_state), SketchSpec())   # same sketch kwargs
    grads = ...  # params-shaped: sketches at targets (or dense kernel gradients), dense elsewhere
    updates, opt_state = tx.update(grads, opt_state, params)   # + predict_kl=... with kl_control
    params = apply_updates(params, updates)                     # or optax.apply_updates
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from logra_jax.optim.predicted_kl import PredictedKLState, scale_by_predicted_kl
from logra_jax.optim.row_adam import RowAdamState, scale_by_row_adam
from logra_jax.optim.targets import DEFAULT_TARGETS, SketchSpec
from logra_jax.tree_paths import map_with_paths
from logra_jax.optim.transforms import (LowRankState, ReconstructedNormState, SkipNonFiniteState,
                                        UpdateRatioState, clip_by_reconstructed_norm,
                                        scale_by_step_size, scale_by_update_ratio, skip_nonfinite,
                                        to_low_rank_updates)

# Integer arguments that fix shapes or seeds: keep them static under optax.inject_hyperparams,
# e.g. ``optax.inject_hyperparams(logra, static_args=LOGRA_STATIC_ARGS)(learning_rate=...)``.
LOGRA_STATIC_ARGS = ("rank", "seed", "kl_budget_horizon", "others_warmup_steps")

_TARGET_LABEL, _OTHER_LABEL = "logra", "others"


def _concrete(value) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _check_static_int(name: str, value):
    if isinstance(value, (jax.Array, np.ndarray)):
        raise ValueError(f"{name} must be a Python int, got an array; with optax.inject_hyperparams "
                         f"pass static_args=LOGRA_STATIC_ARGS")


def _check(name: str, value, ok, requirement: str):
    """A schedule is checked at its first update (a NaN or negative rate would otherwise only
    show as every update being skipped)."""
    if callable(value):
        first = value(0)
        if _concrete(first) and not ok(float(first)):
            raise ValueError(f"{name} must be {requirement}; the schedule gives {float(first)!r} "
                             f"at update 0")
        return
    if value is None or not _concrete(value):
        return
    if not ok(float(value)):
        raise ValueError(f"{name} must be {requirement}, got {value!r}")


WARMUP_START = 0.1   # the reference recipe's warmup starts at 0.1·lr (docs/algorithm.md §5)


def warmup_constant(learning_rate: optax.ScalarOrSchedule, warmup_steps,
                    start: float = WARMUP_START) -> optax.Schedule:
    """lr(t)·(s + (1 − s)·min(1, t / W)): linear warmup from s·lr to lr over W = warmup_steps
    updates (t counts updates), s = 0.1 as in the reference recipe, so the first update already
    moves the weights (from 0, it would only feed its gradient into the moments).

    Written with jnp so that warmup_steps may be an array (optax.linear_schedule needs an int).
    """
    def schedule(count):
        lr = learning_rate(count) if callable(learning_rate) else learning_rate
        warm = jnp.asarray(warmup_steps, jnp.float32)
        ramp = jnp.minimum(1.0, count / jnp.maximum(warm, 1.0))
        frac = jnp.where(warm > 0, start + (1.0 - start) * ramp, 1.0)
        return jnp.asarray(lr, jnp.float32) * frac
    return schedule


_FACTOR_DTYPES = {None: None, "": None, "float32": None, "bfloat16": jnp.bfloat16}


def variant_defaults(variant: str, others: str | None, kl_control: bool | None) -> tuple[str, bool]:
    """(others, kl_control) with None replaced by the variant's own choice (docs/algorithm.md §1, §6):
    the learning-rate variant trains the non-targets with AdamW and runs without KL control, the KL variant
    freezes them and sizes every update by its predicted KL."""
    if others is None:
        others = "adamw" if variant == "learning_rate" else "frozen"
    if kl_control is None:
        kl_control = variant == "kl"
    return others, bool(kl_control)


def clip_norm_default(variant: str, max_grad_norm: float | None) -> float | None:
    """The clipping threshold, None for none: the learning-rate variant clips at 1.0 unless told otherwise;
    the KL variant does not clip (the reference never does: its step is sized by update_ratio and
    the KL controller, §5). ``inf`` means no clipping for either."""
    if max_grad_norm is None:
        return 1.0 if variant == "learning_rate" else None
    if _concrete(max_grad_norm) and float(max_grad_norm) == float("inf"):
        return None
    return max_grad_norm


def logra(*, variant: str = "learning_rate",
          learning_rate: optax.ScalarOrSchedule = 1e-6,
          weight_decay: float = 0.0,
          max_grad_norm: float | None = None,
          rank: int = 256, b2: float = 0.95, eps: float = 1e-8, seed: int = 42,
          refresh: bool = True, distribution: str = "rademacher", targets: str = DEFAULT_TARGETS,
          layouts=(),
          others: str | None = None,
          others_learning_rate: optax.ScalarOrSchedule = 5e-6, others_weight_decay: float = 0.01,
          others_warmup_steps: int = 50,
          kl_control: bool | None = None,
          kl_budget: float = 2e-4, kl_budget_final: float = 2e-5, kl_budget_horizon: int = 300,
          alpha_max: float = 3.0, mismatch_weight: float = 0.3,
          kl_safeguard: float = 1.0, kl_correction: float = 0.3,
          update_ratio: float = 6e-5,
          factor_dtype: str | None = None,
          merge_rounding: str = "stochastic",
          exact_merge: bool = True) -> optax.GradientTransformationExtraArgs:
    """LoGRA: sketched RowAdam for the projection matrices, AdamW or freezing for the rest.

    Args:
      variant: how a step is sized (docs/algorithm.md §5–6). "learning_rate" (the paper's GRPO
        variant) — ΔW = −lr(t)·D·A with decoupled weight decay and clipping on the reconstructed
        norm; "kl" — no learning rate: one global c = update_ratio·‖W‖/‖ΔW‖, then the KL
        controller's α, then U rounded to bf16.
      learning_rate: η, float or schedule (variant "learning_rate" only; in the reference the targets
        take the AdamW group's lr, weight decay and schedule — 1e-6 here is a usual RL
        post-training rate). weight_decay: decoupled, W ← (1 − η·wd)·W (learning_rate only).
      max_grad_norm: clip on the reconstructed global norm (grad_norm is reported either way);
        None: the variant's default — 1.0 for learning_rate, no clipping for kl (as the reference);
        inf: no clipping.
      rank, b2, eps, seed, refresh, distribution, targets, layouts: the sketch (SketchSpec) and
        RowAdam; ``layouts`` ({path: KernelLayout}) only for kernels that are not (*stack, in, out),
        as ``logra_jax.nnx_sketch`` finds them (``NNXSketch.logra_kwargs()`` passes all of these).
      others: "adamw" (default for learning_rate) or "frozen" (default for kl) for non-target params;
        others_learning_rate / others_weight_decay / others_warmup_steps configure that AdamW.
      kl_control: scale every update by the predicted-KL α (default: on for "kl", off for "learning_rate");
        then ``update`` needs ``predict_kl=`` (and optionally ``mismatch=``). α scales the gradient
        step of every parameter; the learning-rate variant's decoupled weight decay is neither predicted nor scaled.
      kl_budget, kl_budget_final, kl_budget_horizon, alpha_max, mismatch_weight: the controller.
      kl_safeguard, kl_correction: the measured-KL safeguard and the learned correction of the
        prediction (``scale_by_predicted_kl``; they run when ``update`` gets ``candidate_kl=``);
        inf and 0 give the reference controller.
      update_ratio: relative size of the KL variant's proposed step.
      factor_dtype: round the learning-rate variant's factor U to this dtype ("bfloat16") before the merge,
        so a rollout engine receiving U (§8) applies exactly the trainer's update with half the
        bytes of an fp32 U (≤ r/in of the bf16 weights). The KL variant always rounds to bf16.
      merge_rounding: how the fp32 merge result W + U·A becomes a bf16 target kernel (fp32
        kernels are exact): "stochastic" — unbiased, E[SR(x)] = x, with bits from a key derived
        from A's, so a resumed run or a factors receiver gets the same bf16 weights — or
        "nearest", which loses every change below half a bf16 ulp (most of an RL step).
      exact_merge: merge U·A order-free (the same bits on every mesh and CPU kind: what a rollout
        engine replaying the factors needs, §8; two exact dots per layer for a Rademacher A) or,
        False, with one plain fp32 dot (last bits depend on the backend's summation order; fine
        where the merged weights are the only copy — `rl.build.replays_merge`).

    Update kwargs: ``predict_kl``, ``mismatch`` and ``candidate_kl`` (kl_control), ``num_tokens`` (variant "kl": the
    number of valid generated tokens the sketches sum over; default 1 = already a token mean).
    Target gradients may be sketches (memory-saving) or dense (drop-in; saves state only).
    Returned target updates are ``LowRankUpdate``; apply with ``apply_updates`` (in place)
    or ``optax.apply_updates`` (materialises each leaf's ΔW).
    """
    if variant not in ("learning_rate", "kl"):
        raise ValueError(f"variant must be 'learning_rate' or 'kl', got {variant!r}")
    if factor_dtype not in _FACTOR_DTYPES:
        raise ValueError(f"factor_dtype must be one of {sorted(_FACTOR_DTYPES, key=str)}, got "
                         f"{factor_dtype!r}")
    for name, value in (("rank", rank), ("seed", seed)):
        _check_static_int(name, value)
    if not isinstance(exact_merge, bool):
        raise ValueError(f"exact_merge must be True or False, got {exact_merge!r}")
    others, kl_control = variant_defaults(variant, others, kl_control)
    if others not in ("adamw", "frozen"):
        raise ValueError(f"others must be 'adamw' or 'frozen', got {others!r}")
    _check("b2", b2, lambda x: 0.0 <= x < 1.0, "in [0, 1)")
    _check("eps", eps, lambda x: x >= 0.0, "≥ 0")
    finite_nonnegative = lambda x: 0.0 <= x < float("inf")  # noqa: E731
    _check("learning_rate", learning_rate, finite_nonnegative, "finite and ≥ 0")
    _check("weight_decay", weight_decay, finite_nonnegative, "finite and ≥ 0")
    _check("others_learning_rate", others_learning_rate, finite_nonnegative, "finite and ≥ 0")
    _check("others_weight_decay", others_weight_decay, finite_nonnegative, "finite and ≥ 0")
    _check("others_warmup_steps", others_warmup_steps, lambda x: x >= 0.0, "≥ 0")
    if variant == "kl" and _concrete(weight_decay) and float(weight_decay) != 0.0:
        raise ValueError("weight_decay applies only to variant='learning_rate' (the KL variant has no "
                         f"learning rate to scale it by), got weight_decay={weight_decay!r}")
    spec = SketchSpec(targets=targets, rank=rank, seed=seed, distribution=distribution,
                      refresh=refresh, layouts=layouts)

    if variant == "learning_rate":
        target_tx = optax.chain(scale_by_row_adam(spec, variant="learning_rate", b2=b2, eps=eps,
                                                  check_finite=False),
                                scale_by_step_size(learning_rate))
        wrap = to_low_rank_updates(spec, learning_rate=learning_rate, weight_decay=weight_decay,
                                   factor_dtype=_FACTOR_DTYPES[factor_dtype],
                                   merge_rounding=merge_rounding, exact_merge=exact_merge)
    else:
        target_tx = optax.chain(scale_by_row_adam(spec, variant="kl", b2=b2, eps=eps,
                                                  check_finite=False),
                                scale_by_update_ratio(spec, update_ratio))
        wrap = to_low_rank_updates(spec, factor_dtype=jnp.bfloat16, merge_rounding=merge_rounding,
                                   exact_merge=exact_merge)
    if others == "adamw":
        other_tx = optax.adamw(warmup_constant(others_learning_rate, others_warmup_steps),
                               weight_decay=others_weight_decay)
    else:
        other_tx = optax.set_to_zero()

    def labels(tree):
        return map_with_paths(lambda path, x: None if x is None else (
            _TARGET_LABEL if spec.is_target(path) else _OTHER_LABEL), tree)

    parts = [clip_by_reconstructed_norm(spec, clip_norm_default(variant, max_grad_norm)),
             optax.partition({_TARGET_LABEL: target_tx, _OTHER_LABEL: other_tx}, labels)]
    if kl_control:
        parts.append(scale_by_predicted_kl(kl_budget, kl_budget_final, kl_budget_horizon,
                                           alpha_max, mismatch_weight, kl_safeguard, kl_correction))
    parts.append(wrap)
    tx = _scalars_on_params_mesh(skip_nonfinite(optax.chain(*parts), gradient_by_norm=True))
    _SPECS[tx.update] = spec
    return tx


# The SketchSpec of each transformation `logra` made (keyed by its update function, which lives as
# long as the transformation), so that gradients sketched elsewhere — logra_jax.nnx_sketch — can
# be checked to draw the same A as the optimizer that reconstructs them.
_SPECS: "weakref.WeakKeyDictionary[Any, SketchSpec]" = weakref.WeakKeyDictionary()


def sketch_spec_of(tx) -> SketchSpec | None:
    """The SketchSpec (targets, rank, seed, distribution, refresh, layouts) of a transformation
    made by `logra`; None for any other."""
    update = getattr(tx, "update", None)
    try:
        return _SPECS.get(update)
    except TypeError:   # not weak-referenceable: not ours
        return None


def _scalars_on_params_mesh(tx: optax.GradientTransformationExtraArgs):
    """Puts the state's scalars (counters, metrics) replicated on the params' mesh at init.

    Otherwise they start on one device and come back from the first jitted update replicated on
    the mesh: a sharding change, and a second compilation on the second call.
    """
    def init_fn(params):
        state = tx.init(params)
        shardings = [x.sharding for x in jax.tree.leaves(params)
                     if isinstance(getattr(x, "sharding", None), NamedSharding)
                     and not isinstance(x, jax.core.Tracer)]
        if not shardings:
            return state
        replicated = NamedSharding(shardings[0].mesh, PartitionSpec())
        return jax.tree.map(lambda x: jax.device_put(x, replicated)
                            if x.ndim == 0 and not isinstance(x, jax.core.Tracer) else x, state)
    return optax.GradientTransformationExtraArgs(init_fn, tx.update)


_INDEXED_STATES = (ReconstructedNormState, RowAdamState, UpdateRatioState, LowRankState)


def _find_states(opt_state, types) -> list:
    found = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, types))
    return [x for x in found if isinstance(x, types)]


def update_index(opt_state) -> jax.Array:
    """k for the NEXT gradient's probes (``make_probes(params, k, spec)``); 0 forever without refresh.

    Every LoGRA transform holding A keeps this counter; they advance together once per update.
    """
    states = _find_states(opt_state, _INDEXED_STATES)
    if not states:
        raise ValueError("update_index: opt_state holds no LoGRA state (was it made by logra(...) "
                         "or a chain containing its transforms?)")
    return states[0].update_index


def skip_metrics(opt_state, prefix: str = "") -> dict[str, Any]:
    """{skipped: the last update was dropped as non-finite, num_skipped: how many so far} of a
    ``skip_nonfinite`` or ``skip_nonfinite_gradients`` state in ``opt_state`` ({} without one)."""
    for state in _find_states(opt_state, SkipNonFiniteState)[:1]:
        return {f"{prefix}skipped": state.skipped, f"{prefix}num_skipped": state.num_skipped}
    return {}


def logra_metrics(opt_state) -> dict[str, Any]:
    """Scalars describing the last update, read from the optimizer state (jit-friendly).

    grad_norm: reconstructed global gradient norm; logra/update_index; logra/skipped (last update
    dropped as non-finite) and logra/num_skipped; with KL control: logra/candidate_kl (predicted KL
    of the unscaled candidate), logra/jvp_kl (ρ·α²·candidate: the JVP's prediction of the
    α-scaled step), logra/predicted_kl (the prediction for the applied update, s²·checked_kl
    with the safeguard — compare with the realized KL), logra/alpha, logra/effective_budget,
    logra/mismatch, and with the safeguard logra/checked_kl (measured KL of the α-scaled
    candidate), logra/backoff (s) and logra/kl_ratio (ρ learned for the next update).
    """
    metrics: dict[str, Any] = {}
    for state in _find_states(opt_state, ReconstructedNormState)[:1]:
        metrics["grad_norm"] = state.grad_norm
    for state in _find_states(opt_state, _INDEXED_STATES)[:1]:
        metrics["logra/update_index"] = state.update_index
    metrics.update(skip_metrics(opt_state, prefix="logra/"))
    for state in _find_states(opt_state, PredictedKLState)[:1]:
        metrics["logra/candidate_kl"] = state.candidate_kl
        metrics["logra/jvp_kl"] = state.jvp_kl
        metrics["logra/predicted_kl"] = state.predicted_kl
        metrics["logra/alpha"] = state.alpha
        metrics["logra/effective_budget"] = state.effective_budget
        metrics["logra/mismatch"] = state.mismatch
        metrics["logra/checked_kl"] = state.checked_kl
        metrics["logra/backoff"] = state.backoff
        metrics["logra/kl_ratio"] = state.kl_ratio
    return metrics
