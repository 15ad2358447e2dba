"""Policy-gradient losses of the RL loop (docs/algorithm.md §7): GRPO and the KL variant's REINFORCE.

Pure jax functions on arrays, jit-able; string options (``kl_estimator``, ``loss_agg_mode``) are
static Python values. Shapes: ``b`` sequences (prompts × generations, flattened), ``t`` completion
tokens; ``mask[b, t]`` is 1 on generated tokens that count and 0 on padding.

Aggregation (``loss_agg_mode``), for per-token losses ℓ_it and mask m_it:
    token-mean     L = Σ_it m_it ℓ_it / Σ_it m_it          every token weighs the same
    sequence-mean  L = mean_{i: Σ_t m_it > 0} (Σ_t m_it ℓ_it / Σ_t m_it)
                                                          every (non-empty) sequence weighs the same
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "sequence-mean")
# How a ratio ρ = π_θ / π_behaviour above the cap C is corrected (docs/algorithm.md §7):
#   tis  truncated: the weight is min(ρ, C)
#   mis  masked:    the weight is ρ where ρ ≤ C, and the token is dropped (weight 0) where ρ > C
IMPORTANCE_CORRECTIONS: tuple[str, ...] = ("tis", "mis")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_nonnegative(name: str, value) -> None:
    # Hyper-parameters may arrive as tracers (e.g. under optax.inject_hyperparams); only concrete
    # Python numbers can be checked here.
    if isinstance(value, (int, float)) and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _check_token_shapes(mask: jax.Array, **arrays: jax.Array | None) -> None:
    for name, array in arrays.items():
        if array is not None and array.shape != mask.shape:
            raise ValueError(f"{name} has shape {array.shape}, expected the mask's shape {mask.shape}")


def _check_advantages(advantages: jax.Array, mask: jax.Array) -> None:
    if advantages.shape != mask.shape[:1]:
        raise ValueError(f"advantages must have one value per sequence, shape {mask.shape[:1]}, "
                         f"got {advantages.shape}")


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Σ m x / Σ m, and 0 when nothing is unmasked."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
    """max of x over the unmasked entries, and 0 when nothing is unmasked."""
    return jnp.where(jnp.any(mask > 0), jnp.max(jnp.where(mask > 0, x, -jnp.inf)), 0.0)


def importance_ratio(logp: jax.Array, behaviour_logp: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(ρ, finite): ρ = sg(π_θ / π_behaviour) per token, and where log π_θ − log π_behaviour is
    finite; ρ is 1 where it is not (such a token gets weight 0 from `importance_weights`)."""
    log_ratio = jax.lax.stop_gradient(logp) - behaviour_logp
    finite = jnp.isfinite(log_ratio)
    return jnp.exp(jnp.where(finite, log_ratio, 0.0)), finite


def importance_weights(ratio: jax.Array, finite: jax.Array, cap, correction: str) -> jax.Array:
    """The corrected weight of each token (no gradient), for ratio ρ and cap C:
        tis   w = min(ρ, C)
        mis   w = ρ · [ρ ≤ C]
    and w = 0 where the log-ratio is not finite (the sampler could not have drawn the token)."""
    _check_choice("importance correction", correction, IMPORTANCE_CORRECTIONS)
    kept = jnp.minimum(ratio, cap) if correction == "tis" else jnp.where(ratio <= cap, ratio, 0.0)
    return jnp.where(finite, kept, 0.0)


def importance_metrics(ratio: jax.Array, finite: jax.Array, weight: jax.Array, cap,
                       log_ratio_mask: jax.Array, mask: jax.Array, logp: jax.Array,
                       behaviour_logp: jax.Array, *, with_max: bool) -> dict[str, jax.Array]:
    """Token means over ``mask`` of the weights and of the sampler/trainer gap:
        importance_weight/mean         mean w
        importance_weight/max          max ρ (before the correction; only ``with_max``)
        importance_weight/capped_mean  share of tokens with ρ > C
        rollout_mismatch               mean (log π_behaviour − log π_θ) over the finite ones"""
    gap = jnp.where(finite, behaviour_logp - jax.lax.stop_gradient(logp), 0.0)
    metrics = {
        "importance_weight/mean": _masked_mean(weight, mask),
        "importance_weight/capped_mean": _masked_mean(((ratio > cap) & finite).astype(logp.dtype),
                                                      mask),
        "rollout_mismatch": _masked_mean(gap, log_ratio_mask),
    }
    if with_max:
        metrics["importance_weight/max"] = _masked_max(jnp.where(finite, ratio, 0.0), mask)
    return metrics


def aggregate(per_token: jax.Array, mask: jax.Array, loss_agg_mode: str) -> jax.Array:
    """Reduce per-token losses [b, t] to a scalar (token-mean or sequence-mean, module docstring)."""
    _check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    mask = mask.astype(per_token.dtype)
    if loss_agg_mode == "token-mean":
        return _masked_mean(per_token, mask)
    tokens = jnp.sum(mask, axis=-1)
    per_sequence = jnp.sum(per_token * mask, axis=-1) / jnp.maximum(tokens, 1.0)
    return _masked_mean(per_sequence, (tokens > 0).astype(per_token.dtype))


ADVANTAGE_BASELINES: tuple[str, ...] = ("mean", "leave_one_out")


def group_advantages(rewards: jax.Array, num_generations: int, *, scale_by_std: bool = True,
                     baseline: str = "mean", eps: float | None = None) -> jax.Array:
    """Group-relative advantages of GRPO.

    ``rewards`` is flat [n·G], the G generations of each prompt adjacent. Within group g, with
    baseline b_gi and σ_g the unbiased std (ddof = 1) of the group's rewards:
        A_gi = r_gi − b_gi                  (scale_by_std=False)
        A_gi = (r_gi − b_gi) / (σ_g + ε)    (scale_by_std=True)
    baseline="mean": b_gi = mean_j r_gj and ε = 1e-4, as TRL computes it;
    baseline="leave_one_out": b_gi = mean_{j≠i} r_gj (RLOO: a response is never its own baseline)
    and ε = 1e-6, as the reference recipe. A group whose rewards are all equal gets zero advantage
    either way: it carries no learning signal.

    A non-finite reward (a grader that failed) masks its row: the row gets advantage 0 and the
    group's baseline and σ are taken over its finite rewards only.
    """
    _check_choice("baseline", baseline, ADVANTAGE_BASELINES)
    if not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"num_generations must be an int >= 2 for group-relative advantages, "
                         f"got {num_generations!r}")
    if rewards.ndim != 1 or rewards.shape[0] % num_generations:
        raise ValueError(f"rewards must be flat with a multiple of num_generations={num_generations} "
                         f"entries, got shape {rewards.shape}")
    eps = (1e-4 if baseline == "mean" else 1e-6) if eps is None else eps
    groups = rewards.astype(jnp.float32).reshape(-1, num_generations)
    valid = jnp.isfinite(groups)
    groups = jnp.where(valid, groups, 0.0)
    n = jnp.sum(valid, axis=1, keepdims=True).astype(jnp.float32)
    total = jnp.sum(groups, axis=1, keepdims=True)
    mean = total / jnp.maximum(n, 1.0)
    if baseline == "mean":
        b = mean
    else:
        b = (total - groups) / jnp.maximum(n - 1.0, 1.0)
    centred = groups - b
    if scale_by_std:
        var = jnp.sum(jnp.where(valid, jnp.square(groups - mean), 0.0), axis=1, keepdims=True)
        centred = centred / (jnp.sqrt(var / jnp.maximum(n - 1.0, 1.0)) + eps)
    # A row whose group has no other finite reward has nothing to be relative to.
    return jnp.where(valid & (n >= 2), centred, 0.0).reshape(-1)


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman's k1/k2/k3).

    With d = log π_θ − log π_ref at the sampled token:
        k1 = d                      unbiased, high variance, can be negative
        k2 = ½ d²                   biased, low variance
        k3 = exp(−d) − (−d) − 1     unbiased and ≥ 0 (the GRPO default)
    """
    _check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * jnp.square(log_ratio)
    return jnp.exp(-log_ratio) + log_ratio - 1.0


def grpo_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array, *,
              ref_logp: jax.Array | None = None, epsilon: float = 0.2,
              epsilon_high: float | None = None, beta: float = 0.0, kl_estimator: str = "k3",
              loss_agg_mode: str = "token-mean", importance_correction: str | None = None,
              importance_cap: float = 2.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO objective (clipped surrogate + reference KL), as a loss to minimise.

    Per token, with ratio ρ = exp(log π_θ − log π_old) and the sequence's advantage A:
        ℓ = −min(ρ·A, clip(ρ, 1 − ε, 1 + ε_high)·A) + β·KL_est(π_θ ‖ π_ref)
    ε_high defaults to ε (symmetric clipping; ε_high > ε is DAPO's "clip higher"). The KL term is
    ``kl_penalty(logp, ref_logp, kl_estimator)`` and needs ``ref_logp`` when β ≠ 0. The loss is
    ``aggregate(ℓ, mask, loss_agg_mode)``.

    Off-policy (``importance_correction`` given, for rollouts sampled by older weights): π_old is
    the behaviour policy whose log-probs the sampler recorded, and the ratio is corrected at the
    cap C = ``importance_cap`` (ρ_sg: ρ without gradient):
        tis   ℓ = −min(min(ρ, C)·A, clip(ρ, 1 − ε, 1 + ε_high)·A)   (dual clip: for A < 0 the
              unclipped branch is bounded by C·A, where PPO's clip alone leaves it unbounded)
        mis   ℓ = −min(ρ·A, clip(ρ, 1 − ε, 1 + ε_high)·A) · [ρ_sg ≤ C]   (the token is dropped)
    and a token with a non-finite log-ratio contributes nothing. `importance_metrics` then adds
    the weights' mean/max/capped share and the sampler/trainer gap. None: the computation above,
    π_old as given (the on-policy loop passes sg(π_θ), so ρ = 1).

    Metrics (token means over the mask):
        clip_ratio/low_mean   share of tokens with ρ < 1 − ε and A < 0 (the clip stops the push down)
        clip_ratio/high_mean  share of tokens with ρ > 1 + ε_high and A > 0
        kl                    mean KL_est to the reference; 0 when no ``ref_logp`` is given
    """
    _check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    _check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    _check_nonnegative("epsilon", epsilon)
    _check_nonnegative("beta", beta)
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    _check_nonnegative("epsilon_high", epsilon_high)
    _check_token_shapes(mask, logp=logp, old_logp=old_logp, ref_logp=ref_logp)
    _check_advantages(advantages, mask)
    if ref_logp is None and not (isinstance(beta, (int, float)) and beta == 0):
        raise ValueError(f"beta={beta} needs ref_logp for the reference KL term; pass ref_logp "
                         "or set beta=0")

    if importance_correction is not None:
        _check_choice("importance_correction", importance_correction, IMPORTANCE_CORRECTIONS)
        if isinstance(importance_cap, (int, float)) and not importance_cap > 0:
            raise ValueError(f"importance_cap must be > 0, got {importance_cap}")

    mask = mask.astype(logp.dtype)
    adv = advantages.astype(logp.dtype)[:, None]
    extra = {}
    if importance_correction is None:
        ratio = jnp.exp(logp - old_logp)
        clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
        per_token = -jnp.minimum(ratio * adv, clipped * adv)
    else:
        ratio_sg, finite = importance_ratio(logp, old_logp)
        log_ratio = jnp.where(finite, logp - old_logp, 0.0)
        ratio = jnp.exp(log_ratio)   # differentiable; 1 where the log-ratio is not finite
        clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
        if importance_correction == "tis":
            unclipped, keep = jnp.minimum(ratio, importance_cap), finite
        else:
            unclipped, keep = ratio, finite & (ratio_sg <= importance_cap)
        # where, not ·keep: a dropped token's loss may be inf·0.
        per_token = jnp.where(keep, -jnp.minimum(unclipped * adv, clipped * adv), 0.0)
        weight = importance_weights(ratio_sg, finite, importance_cap, importance_correction)
        extra = importance_metrics(ratio_sg, finite, weight, importance_cap, mask * finite, mask,
                                   logp, old_logp, with_max=True)

    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        per_token = per_token + beta * kl
        mean_kl = _masked_mean(kl, mask)
    else:
        mean_kl = jnp.zeros((), logp.dtype)

    loss = aggregate(per_token, mask, loss_agg_mode)
    low = ((ratio < 1.0 - epsilon) & (adv < 0)).astype(logp.dtype)
    high = ((ratio > 1.0 + epsilon_high) & (adv > 0)).astype(logp.dtype)
    metrics = {
        "clip_ratio/low_mean": _masked_mean(low, mask),
        "clip_ratio/high_mean": _masked_mean(high, mask),
        "kl": mean_kl,
        **extra,
    }
    return loss, metrics


def reinforce_loss(logp: jax.Array, rollout_logp: jax.Array, advantages: jax.Array,
                   mask: jax.Array, *, is_cap: float = 2.0, loss_agg_mode: str = "token-mean",
                   correction: str = "tis", with_max: bool = False,
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """REINFORCE with truncated importance weights: the KL variant's loss (docs/algorithm.md §7).

    The rollout engine's policy π_rollout sampled the tokens; the trainer's π_θ differs slightly
    (numerics, stale weights). Per token, with the outcome advantage A = outcome − baseline:
        w = sg(min(π_θ / π_rollout, is_cap)) = sg(min(exp(log π_θ − log π_rollout), is_cap))
        ℓ = −w · A · log π_θ
    (``correction="tis"``; ``"mis"`` masks instead of truncating: w = sg(ρ)·[ρ ≤ is_cap],
    `importance_weights`). With rollouts sampled by older weights (``rl.max_lag`` ≥ 1) π_rollout
    is that older behaviour policy, and ``with_max`` adds importance_weight/max (max ρ).
    sg = stop_gradient: the weight corrects the sampling distribution and is not differentiated,
    so ∇ℓ = −w·A·∇log π_θ. Aggregated with ``loss_agg_mode`` (the KL variant uses token-mean).
    A token with a non-finite log-prob on either side (log π_rollout = −inf: the sampler could
    not have drawn it) gets w = 0, as in the reference, and contributes nothing.

    Metrics (token means over the mask):
        importance_weight/mean        mean w
        importance_weight/capped_mean share of tokens whose ratio exceeded is_cap
        rollout_mismatch              mean (log π_rollout − log π_θ): the trainer/sampler gap
                                      that the predicted-KL controller subtracts (§6)
    """
    _check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    _check_choice("correction", correction, IMPORTANCE_CORRECTIONS)
    if isinstance(is_cap, (int, float)) and not is_cap > 0:
        raise ValueError(f"is_cap must be > 0, got {is_cap}")
    _check_token_shapes(mask, logp=logp, rollout_logp=rollout_logp)
    _check_advantages(advantages, mask)

    mask = mask.astype(logp.dtype)
    ratio, finite = importance_ratio(logp, rollout_logp)
    weight = importance_weights(ratio, finite, is_cap, correction)
    # where, not w·(…): 0·log π_θ would be NaN at log π_θ = −inf.
    per_token = jnp.where(weight > 0, -weight * advantages.astype(logp.dtype)[:, None] * logp, 0.0)
    loss = aggregate(per_token, mask, loss_agg_mode)
    return loss, importance_metrics(ratio, finite, weight, is_cap, mask * finite, mask, logp,
                                    rollout_logp, with_max=with_max)


def update_baseline(baseline: jax.Array | float, outcomes: jax.Array,
                    momentum: float = 0.9) -> jax.Array:
    """Running baseline of the KL variant: b ← momentum·b + (1 − momentum)·mean(outcomes).

    Apply AFTER computing this step's advantages (A = outcome − b uses the old b), so a response
    never serves as its own baseline. Non-finite outcomes are masked (as the reference): the mean
    is over the finite ones, and a batch without any leaves b as it was.
    """
    if isinstance(momentum, (int, float)) and not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum must lie in [0, 1], got {momentum}")
    outcomes = jnp.asarray(outcomes, jnp.float32)
    baseline = jnp.asarray(baseline, jnp.float32)
    valid = jnp.isfinite(outcomes)
    n = jnp.sum(valid)
    mean = jnp.sum(jnp.where(valid, outcomes, 0.0)) / jnp.maximum(n, 1)
    return jnp.where(n > 0, momentum * baseline + (1.0 - momentum) * mean, baseline)
