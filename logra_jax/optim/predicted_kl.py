r"""Predicted-KL step control: size each update by the policy change it will cause (docs/algorithm.md §6).

For a candidate update d, one forward-mode pass over a small probe batch gives the logit change
δz = J·d. Per response token, with temperature T, p = softmax(z/T) and u = δz/T,

    KL(π_old ‖ π_new) ≈ ½ Σ_k p_k (u_k − Σ_j p_j u_j)² = ½ Var_{k∼p}(u_k)

(second-order Taylor; the first-order term vanishes because Σ p_k = 1), averaged over response
positions. KL is quadratic in the step, so scaling d by α predicts α²·KL. The controller picks

    budget(k) = b_final + ½ (b₀ − b_final)(1 + cos(π · min(k / (H − 1), 1)))
    m ← (1 − w)·m + w·max(0, mismatch)        B = max(budget − m, ½·budget)
    α = min(α_max, sqrt(B / (ρ·pred)))        (pred = 0 → α = 1)

With the B-parameter trick the tangent of target l is its factor U_l: ΔW is never formed.

Two additions to the reference controller (docs/algorithm.md §6), both on the same probe:

- the safeguard: the α-scaled candidate's exact KL, K = KL(π_old ‖ π_{W+αU·A}), is measured
  through the probes' low-rank branch (the model at W + B·A with B = αU, still without forming
  ΔW), and when K > c·B (c = 1: the budget is a ceiling) the step is scaled back by
  s = sqrt(B / K) before it is merged — nothing to undo, and a factors-sync receiver gets the
  final U. The applied step's prediction is then s²·K, no longer the JVP's;
- the correction: ρ, an EMA in log space of K / (α²·pred) (weight ``kl_correction``), learns how
  far the quadratic prediction is off and sizes the next α by ρ·pred.

``kl_safeguard=inf, kl_correction=0`` is the reference controller.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logra_jax.optim import low_rank
from logra_jax.optim.low_rank import LowRankUpdate
from logra_jax.tree_paths import map_with_paths

_TINY = float(np.finfo(np.float32).tiny)


def _masked_mean(per_token: jax.Array, mask: jax.Array) -> jax.Array:
    mask = jnp.asarray(mask, jnp.float32)
    if mask.shape != per_token.shape:
        raise ValueError(f"response_mask has shape {mask.shape}, the logits give per-token shape "
                         f"{per_token.shape}")
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def predicted_kl_from_tangent(logits: jax.Array, logit_tangent: jax.Array, response_mask: jax.Array,
                              temperature: float = 1.0) -> jax.Array:
    """½·Var_{k∼p}(δz_k/T) per token, averaged over response tokens; in fp32."""
    z = logits.astype(jnp.float32) / temperature
    u = logit_tangent.astype(jnp.float32) / temperature
    p = jax.nn.softmax(z, axis=-1)
    centred = u - jnp.sum(p * u, axis=-1, keepdims=True)
    return _masked_mean(0.5 * jnp.sum(p * jnp.square(centred), axis=-1), response_mask)


def exact_kl(logits_old: jax.Array, logits_new: jax.Array, response_mask: jax.Array,
             temperature: float = 1.0) -> jax.Array:
    """KL(π_old ‖ π_new) per token at temperature T, averaged over response tokens (the realized KL).

    Exact, written for fp32 at the tiny KLs of one RL step: with δ = (z_new − z_old)/T and
    c = δ − E_p[δ],  KL = log E_p[e^c] = log1p(E_p[expm1(c)]). The textbook Σ p·(log p − log q)
    subtracts log-probabilities of size ~1 to get a result of ~1e-6 and loses it to rounding.
    """
    return _masked_mean(_exact_kl_per_token(logits_old, logits_new, temperature), response_mask)


def _exact_kl_per_token(logits_old: jax.Array, logits_new: jax.Array, temperature: float) -> jax.Array:
    z_old = logits_old.astype(jnp.float32) / temperature
    delta = (logits_new.astype(jnp.float32) - logits_old.astype(jnp.float32)) / temperature
    p = jax.nn.softmax(z_old, axis=-1)
    centred = delta - jnp.sum(p * delta, axis=-1, keepdims=True)
    return jnp.log1p(jnp.sum(p * jnp.expm1(centred), axis=-1))


def exact_kl_from_hidden(hidden_old: jax.Array, head_old: jax.Array, hidden_new: jax.Array,
                         head_new: jax.Array, response_mask: jax.Array, temperature: float = 1.0,
                         *, token_chunk: int = 128) -> jax.Array:
    """``exact_kl`` of the logits h·head [b, t, V], formed ``token_chunk`` positions at a time.

    hidden_*: [b, t, d]; head_*: [d, V]. The whole [b, t, V] logits of a probe batch are large at
    LLM vocabularies (2 × 1536 × 152064 fp32 = 1.7 GiB for Qwen2.5) and would sit at the update's
    peak; a chunk of positions holds ``token_chunk / t`` of that. Same value as ``exact_kl``.
    """
    b, t, d = hidden_old.shape
    if hidden_new.shape != (b, t, d) or head_old.shape != head_new.shape or head_old.shape[0] != d:
        raise ValueError(f"exact_kl_from_hidden: hidden {hidden_old.shape} / {hidden_new.shape} and "
                         f"heads {head_old.shape} / {head_new.shape} do not fit together")
    chunk = min(token_chunk, t)
    n = -(-t // chunk)
    pad = n * chunk - t

    def chunks(h):  # [b, t, d] → [n, b, chunk, d], zero positions appended to fill the last chunk
        h = jnp.pad(h.astype(jnp.float32), ((0, 0), (0, pad), (0, 0)))
        return h.reshape(b, n, chunk, d).swapaxes(0, 1)

    head_old, head_new = head_old.astype(jnp.float32), head_new.astype(jnp.float32)

    def per_token(hs):
        h_old, h_new = hs
        return _exact_kl_per_token(h_old @ head_old, h_new @ head_new, temperature)   # [b, chunk]

    kl = jax.lax.map(per_token, (chunks(hidden_old), chunks(hidden_new)))           # [n, b, chunk]
    kl = kl.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
    return _masked_mean(kl, response_mask)


def make_predict_kl(logits_fn: Callable, others, factors: dict[str, jax.Array],
                    response_mask: jax.Array, temperature: float = 1.0, *,
                    others_frozen: bool = False) -> Callable:
    """Builds ``predict_kl(updates) -> scalar`` for ``scale_by_predicted_kl``.

    Args:
      logits_fn: ``logits_fn(others, factors) -> logits (..., vocab)`` on the probe batch: the model
        run with the current weights and probes whose factors are ``factors`` (zero, from
        ``probe_factors(make_probes(params, update_index(opt_state), spec))`` — the same A as the
        candidate's). Target kernels are closed over.
      others: the non-target params (``split_targets(params, spec)[1]``, ``None`` at targets).
      factors: {target path: zero factor}, the primal of the JVP.
      response_mask: (...,) 1 for generated (response) tokens, matching ``logits.shape[:-1]``.
      temperature: sampling temperature T.
      others_frozen: the non-target updates are always zero (the KL variant); skips their tangent.

    The returned function takes the candidate updates (params-shaped: factors U at targets, dense
    updates elsewhere; ``LowRankUpdate`` leaves are read through their factor, their weight decay
    is not part of the prediction) and runs one ``jax.jvp``.
    """
    @jax.named_scope("predicted_kl")  # named for profiles (logra_jax/perf/profiling.py)
    def predict_kl(updates) -> jax.Array:
        target_tangent, other_tangent = _split_candidate(updates, factors, "predict_kl")
        if others_frozen:
            logits, dlogits = jax.jvp(lambda f: logits_fn(others, f), (factors,), (target_tangent,))
        else:
            other_tangent = jax.tree.map(lambda p, t: None if p is None else t.astype(p.dtype),
                                         others, other_tangent, is_leaf=lambda x: x is None)
            logits, dlogits = jax.jvp(logits_fn, (others, factors), (other_tangent, target_tangent))
        return predicted_kl_from_tangent(logits, dlogits, response_mask, temperature)

    return predict_kl


def _split_candidate(updates, factors: dict[str, jax.Array], who: str):
    """({target path: factor U in the factors' dtype}, the non-target updates with None at targets)."""
    target_factors = {}

    def split(path, u):
        if path in factors:
            factor = u.factor if isinstance(u, LowRankUpdate) else u
            target_factors[path] = factor.astype(factors[path].dtype)
            return None
        return u
    other_updates = map_with_paths(split, updates)
    if set(target_factors) != set(factors):
        raise ValueError(f"{who}: the updates hold targets {sorted(target_factors)}, the factors "
                         f"{sorted(factors)}")
    return target_factors, other_updates


def make_candidate_kl(hidden_fn: Callable, others, factors: dict[str, jax.Array],
                      hidden_old: jax.Array, head_old: jax.Array, response_mask: jax.Array,
                      temperature: float = 1.0, *, others_frozen: bool = False) -> Callable:
    """Builds ``candidate_kl(updates) -> scalar``, the safeguard's measurement: the exact
    KL(π_old ‖ π_candidate) on the probe batch, without merging anything.

    Args:
      hidden_fn: ``hidden_fn(others, factors) -> (hidden [b, t, d], head [d, V])`` on the probe:
        the model with the non-target params ``others`` and target probes carrying ``factors`` as
        nonzero B (``with_update_factors``), so target l computes x·W_l + (x·A_lᵀ)·U_lᵀ, the layer
        at W_l + U_l·A_l. Target kernels are closed over.
      others, factors: as for ``make_predict_kl`` (``factors`` gives the targets and their dtype).
      hidden_old, head_old: the current policy's hidden states and head on the probe.
      response_mask, temperature: as for ``make_predict_kl``.
      others_frozen: the non-target updates are zero; ``others`` is used as it is.

    The candidate's non-target updates are added to ``others`` (one temporary copy of them); a
    ``LowRankUpdate``'s weight decay is not part of it (the same approximation as the prediction's).
    """
    @jax.named_scope("predicted_kl")
    def candidate_kl(updates) -> jax.Array:
        target_factors, other_updates = _split_candidate(updates, factors, "candidate_kl")
        others_new = others if others_frozen else jax.tree.map(
            lambda p, u: None if p is None else (p.astype(jnp.float32) + u).astype(p.dtype),
            others, other_updates, is_leaf=lambda x: x is None)
        hidden_new, head_new = hidden_fn(others_new, target_factors)
        return exact_kl_from_hidden(hidden_old, head_old, hidden_new, head_new, response_mask,
                                    temperature)

    return candidate_kl


def kl_budget_schedule(kl_budget: float = 2e-4, kl_budget_final: float = 2e-5,
                       kl_budget_horizon: int = 300) -> Callable[[jax.Array], jax.Array]:
    """budget(k): cosine from ``kl_budget`` to ``kl_budget_final`` over ``kl_budget_horizon`` updates."""
    def schedule(k):
        b0, b_final = jnp.asarray(kl_budget, jnp.float32), jnp.asarray(kl_budget_final, jnp.float32)
        span = jnp.maximum(jnp.asarray(kl_budget_horizon, jnp.float32) - 1.0, 1.0)
        frac = jnp.minimum(jnp.asarray(k, jnp.float32) / span, 1.0)
        return b_final + 0.5 * (b0 - b_final) * (1.0 + jnp.cos(jnp.pi * frac))
    return schedule


class PredictedKLState(NamedTuple):
    """count: updates so far; mismatch: EMA m; candidate_kl: pred of the last candidate (before α);
    alpha: the α applied; effective_budget: the B it aimed at; kl_ratio: ρ, the learned
    realized/predicted correction; checked_kl: the safeguard's exact KL of the α-scaled candidate
    (0 without a check); backoff: the safeguard's s (1: none); jvp_kl: ρ·α²·pred, the JVP's
    prediction for the α-scaled candidate; predicted_kl: the prediction for the update applied
    (compare with the realized KL) — s²·checked_kl when measured, else jvp_kl."""

    count: jax.Array
    mismatch: jax.Array
    candidate_kl: jax.Array
    alpha: jax.Array
    effective_budget: jax.Array
    kl_ratio: jax.Array
    checked_kl: jax.Array
    backoff: jax.Array
    jvp_kl: jax.Array
    predicted_kl: jax.Array
    KEPT_ON_SKIP = ("count", "candidate_kl", "alpha", "effective_budget", "checked_kl", "backoff",
                    "jvp_kl", "predicted_kl")


# ρ stays within these factors of 1: one odd probe must not make the controller freeze or leap.
_KL_RATIO_RANGE = (0.1, 10.0)


# Whether a traced update carries the refusal's host callback (below). A program compiled for a
# machine that is not here (the memory planner's GPU targets) cannot: a host callback lowers only
# for a platform with a runtime client. Such a program never runs, and its α = 0 for a bad
# prediction is in it either way.
_HOST_CHECKS = contextvars.ContextVar("predicted_kl_host_checks", default=True)


@contextlib.contextmanager
def host_checks_left_out():
    """Updates traced inside leave out the refusal's host callback: for programs that are planned
    (compiled for another machine's devices), never run."""
    token = _HOST_CHECKS.set(False)
    try:
        yield
    finally:
        _HOST_CHECKS.reset(token)


def _refuse(bad, pred):
    if bool(bad):
        raise ValueError(f"scale_by_predicted_kl: predict_kl returned {float(pred)!r} (NaN, "
                         f"negative or infinite) for a finite candidate update; refusing the "
                         f"update — check the probe batch, its response_mask and the logits function")


def scale_by_predicted_kl(kl_budget: float = 2e-4, kl_budget_final: float = 2e-5,
                          kl_budget_horizon: int = 300, alpha_max: float = 3.0,
                          mismatch_weight: float = 0.3, kl_safeguard: float = 1.0,
                          kl_correction: float = 0.3) -> optax.GradientTransformationExtraArgs:
    """Scales the candidate update by α so its predicted KL meets the (effective) budget.

    ``update(updates, state, params=None, *, predict_kl, mismatch=None, candidate_kl=None)``:
      predict_kl: ``callable(updates) -> scalar`` predicted KL of the candidate (see make_predict_kl).
      mismatch: optional scalar mean(log π_rollout − log π_trainer) over generated tokens of
        completed responses; feeds the EMA m. None, or NaN (no completed response this step),
        leaves m unchanged: no observation is not an observation of zero (as the reference).
      candidate_kl: optional ``callable(updates) -> scalar``, the exact KL of a candidate on the
        probe (see make_candidate_kl). With it the safeguard and the correction run (module
        docstring); without it α is the reference's.
      kl_safeguard: c, the multiple of the effective budget B above which the measured step is
        scaled back (inf: never). kl_correction: the EMA weight of ρ (0: ρ = 1, the reference).

    A NaN, negative or +inf prediction for a finite candidate refuses the update: eagerly a
    ValueError, under jit the same message as a runtime error from a host callback (and α = 0, so
    even a backend that ignored the callback would apply nothing). A non-finite candidate passes
    through with α = 1, and a non-finite measured KL makes the update NaN, for ``skip_nonfinite``
    to drop.
    """
    for name, value in (("kl_budget", kl_budget), ("kl_budget_final", kl_budget_final),
                        ("alpha_max", alpha_max), ("kl_safeguard", kl_safeguard)):
        if not isinstance(value, jax.core.Tracer) and not float(value) > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    if not isinstance(kl_budget_horizon, jax.core.Tracer) and not int(kl_budget_horizon) >= 1:
        raise ValueError(f"kl_budget_horizon must be ≥ 1, got {kl_budget_horizon!r}")
    for name, value in (("mismatch_weight", mismatch_weight), ("kl_correction", kl_correction)):
        if not isinstance(value, jax.core.Tracer) and not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    budget_at = kl_budget_schedule(kl_budget, kl_budget_final, kl_budget_horizon)

    def init_fn(params):
        del params
        zero, one = jnp.zeros([], jnp.float32), jnp.ones([], jnp.float32)
        return PredictedKLState(count=jnp.zeros([], jnp.int32), mismatch=zero, candidate_kl=zero,
                                alpha=one, effective_budget=zero, kl_ratio=one, checked_kl=zero,
                                backoff=one, jvp_kl=zero, predicted_kl=zero)

    def update_fn(updates, state, params=None, *, predict_kl=None, mismatch=None,
                  candidate_kl=None, **extra_args):
        del params, extra_args
        if predict_kl is None:
            raise ValueError("scale_by_predicted_kl: pass predict_kl=... to update (see "
                             "make_predict_kl), or turn kl_control off")
        m = state.mismatch
        weight = jnp.asarray(mismatch_weight, jnp.float32)
        if mismatch is not None:
            mismatch = jnp.asarray(mismatch, jnp.float32)
            ema = (1.0 - weight) * m + weight * jnp.maximum(mismatch, 0.0)
            m = jnp.where(jnp.isnan(mismatch), m, ema)
        budget = budget_at(state.count)
        effective = jnp.maximum(budget - m, 0.5 * budget)

        pred = jnp.asarray(predict_kl(updates), jnp.float32)
        if pred.shape != ():
            raise ValueError(f"predict_kl must return a scalar, got shape {pred.shape}")
        bad = low_rank.all_finite(updates) & ~((pred >= 0) & (pred < jnp.inf))
        if isinstance(bad, jax.core.Tracer):
            if _HOST_CHECKS.get():
                jax.debug.callback(_refuse, bad, pred)
        else:
            _refuse(np.asarray(bad), np.asarray(pred))
        rho = state.kl_ratio
        corrected = rho * pred
        alpha = jnp.where(corrected > 0, jnp.minimum(jnp.asarray(alpha_max, jnp.float32),
                                                     jnp.sqrt(effective / corrected)), 1.0)
        alpha = jnp.where(bad, 0.0, alpha)
        updates = low_rank.scale_updates(updates, alpha)

        jvp = corrected * jnp.square(alpha)
        checked, backoff, next_rho, predicted = jnp.zeros([], jnp.float32), jnp.ones([], jnp.float32), rho, jvp
        if candidate_kl is not None:
            checked = jnp.asarray(candidate_kl(updates), jnp.float32)
            # The safeguard: s brings K back to B if the KL is quadratic in the step, as it is to
            # second order; a non-finite K turns the update into NaN, which skip_nonfinite drops.
            backoff = jnp.where(checked > kl_safeguard * effective,
                                jnp.sqrt(effective / jnp.maximum(checked, _TINY)), 1.0)
            backoff = jnp.where(jnp.isfinite(checked), backoff, jnp.nan)
            # The correction: ρ ← ρ^(1−w)·(K / (α²·pred))^w, learned only from a usable ratio.
            quadratic = jnp.square(alpha) * pred
            ratio = checked / jnp.maximum(quadratic, _TINY)
            usable = (quadratic > 0) & (checked > 0) & jnp.isfinite(ratio)
            w = jnp.asarray(kl_correction, jnp.float32)
            learned = jnp.exp((1.0 - w) * jnp.log(rho) + w * jnp.log(jnp.where(usable, ratio, 1.0)))
            next_rho = jnp.where(usable, jnp.clip(learned, *_KL_RATIO_RANGE), rho)
            updates = low_rank.scale_updates(updates, backoff)
            predicted = jnp.square(backoff) * checked
        new_state = PredictedKLState(
            count=optax.safe_increment(state.count), mismatch=m, candidate_kl=pred, alpha=alpha,
            effective_budget=effective, kl_ratio=next_rho, checked_kl=checked, backoff=backoff,
            jvp_kl=jvp, predicted_kl=predicted)
        return updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
