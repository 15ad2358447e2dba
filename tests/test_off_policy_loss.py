"""The off-policy corrections of the losses (rl.max_lag ≥ 1): TIS and MIS weights against values
computed here by hand in numpy, GRPO's clip binding once π_old is the behaviour policy, and the
on-policy GRPO path untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.rl import losses

# Two rows of four tokens; the last token of row 1 is padding. log π_θ and the behaviour's log π_b
# differ so that the ratios ρ = π_θ / π_b straddle the clip (0.8, 1.2) and the cap C = 2.
LOGP = np.log(np.array([[0.5, 0.2, 0.9, 0.3], [0.4, 0.6, 0.1, 0.7]], np.float32))
BEHAVIOUR = np.log(np.array([[0.5, 0.05, 0.5, 0.6], [0.1, 0.6, 0.2, 0.7]], np.float32))
MASK = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.float32)
ADV = np.array([1.0, -1.0], np.float32)
CAP, EPS = 2.0, 0.2
F32_EPS = float(np.finfo(np.float32).eps)


def _ratios():
    return np.exp(LOGP.astype(np.float64) - BEHAVIOUR)


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_reinforce_weights_match_the_hand_computed_ones(correction):
    rho = _ratios()   # [[1, 4, 1.8, 0.5], [4, 1, 0.5, 1]]
    w = np.minimum(rho, CAP) if correction == "tis" else np.where(rho <= CAP, rho, 0.0)
    per_token = -w * ADV[:, None] * LOGP
    want_loss = (per_token * MASK).sum() / MASK.sum()
    loss, metrics = losses.reinforce_loss(jnp.asarray(LOGP), jnp.asarray(BEHAVIOUR),
                                          jnp.asarray(ADV), jnp.asarray(MASK), is_cap=CAP,
                                          correction=correction, with_max=True)
    # Seven float32 terms of size ≤ 4·|log 0.05|: a few ulps of the sum.
    tol = 8 * 7 * F32_EPS * np.abs(per_token).max()
    np.testing.assert_allclose(float(loss), want_loss, rtol=0, atol=tol)
    np.testing.assert_allclose(float(metrics["importance_weight/mean"]),
                               (w * MASK).sum() / MASK.sum(), rtol=8 * 7 * F32_EPS)
    np.testing.assert_allclose(float(metrics["importance_weight/max"]), rho[MASK > 0].max(),
                               rtol=8 * F32_EPS)
    assert float(metrics["importance_weight/capped_mean"]) == pytest.approx(
        ((rho > CAP) * MASK).sum() / MASK.sum(), abs=F32_EPS)
    np.testing.assert_allclose(float(metrics["rollout_mismatch"]),
                               ((BEHAVIOUR - LOGP) * MASK).sum() / MASK.sum(),
                               rtol=0, atol=8 * 7 * F32_EPS * np.abs(BEHAVIOUR - LOGP).max())


def _grpo(logp, correction):
    return losses.grpo_loss(logp, jnp.asarray(BEHAVIOUR), jnp.asarray(ADV), jnp.asarray(MASK),
                            epsilon=EPS, importance_correction=correction, importance_cap=CAP)


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_grpo_against_the_behaviour_policy_clips_and_corrects(correction):
    """Against π_b the ratios are not 1: the clip binds (ρ = 4, 1.8 with A > 0; ρ = 0.5 with
    A < 0) and a clipped token gets no gradient; the cap bounds (tis) or drops (mis) ρ = 4 with
    A < 0, which PPO's clip alone leaves unbounded."""
    rho = _ratios()
    clipped = np.clip(rho, 1 - EPS, 1 + EPS)
    unclipped = np.minimum(rho, CAP) if correction == "tis" else rho
    keep = np.ones_like(rho) if correction == "tis" else (rho <= CAP)
    per_token = -np.minimum(unclipped * ADV[:, None], clipped * ADV[:, None]) * keep
    want = (per_token * MASK).sum() / MASK.sum()
    (loss, metrics), grad = jax.value_and_grad(_grpo, has_aux=True)(jnp.asarray(LOGP), correction)
    np.testing.assert_allclose(float(loss), want, rtol=0, atol=8 * 7 * F32_EPS * CAP)

    # d ℓ / d log π_θ: −A·ρ where the unclipped, uncapped branch is the one taken, else 0.
    takes_ratio = (unclipped * ADV[:, None] <= clipped * ADV[:, None]) & (rho < CAP) & (keep > 0)
    want_grad = np.where(takes_ratio, -ADV[:, None] * rho, 0.0) * MASK / MASK.sum()
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=0, atol=8 * F32_EPS * CAP)
    assert np.count_nonzero(np.asarray(grad)) < MASK.sum()   # the clip binds somewhere
    high = ((rho > 1 + EPS) & (ADV[:, None] > 0) & (MASK > 0)).sum() / MASK.sum()
    low = ((rho < 1 - EPS) & (ADV[:, None] < 0) & (MASK > 0)).sum() / MASK.sum()
    assert float(metrics["clip_ratio/high_mean"]) == pytest.approx(high, abs=F32_EPS)
    assert float(metrics["clip_ratio/low_mean"]) == pytest.approx(low, abs=F32_EPS)
    assert high > 0 and low > 0


def test_on_policy_grpo_is_the_computation_it_always_was():
    """Without a correction (rl.max_lag = 0) the loss is −min(ρA, clip(ρ)A) with ρ from the π_old
    given, exactly: the sequential loop's bits (it passes sg(π_θ), so ρ = 1)."""
    logp = jnp.asarray(LOGP)
    loss, metrics = losses.grpo_loss(logp, jax.lax.stop_gradient(logp), jnp.asarray(ADV),
                                     jnp.asarray(MASK), epsilon=EPS)
    ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
    old = losses.aggregate(-jnp.minimum(ratio * ADV[:, None],
                                        jnp.clip(ratio, 1 - EPS, 1 + EPS) * ADV[:, None]),
                           jnp.asarray(MASK), "token-mean")
    assert float(loss) == float(old)
    assert set(metrics) == {"clip_ratio/low_mean", "clip_ratio/high_mean", "kl"}


def test_grpo_reads_the_behaviour_policy_only_when_the_rollouts_lag():
    """`rl.algorithm=grpo`'s loss as a run builds it: at rl.max_lag = 0 π_old = sg(π_θ) (ρ = 1,
    nothing clipped); at 1 π_old is the batch's rollout_logp and the clip binds."""
    from types import SimpleNamespace

    from configs import base
    from logra_jax.rl import algorithms
    seqs = SimpleNamespace(completion_mask=jnp.asarray(MASK))
    batch = SimpleNamespace(seqs=seqs, advantages=jnp.asarray(ADV),
                            rollout_logp=jnp.asarray(BEHAVIOUR), ref_logp=jnp.zeros_like(MASK))
    for lag in (0, 1):
        rl = base.get_config().rl
        rl.max_lag = lag
        _, metrics = algorithms.get("grpo").loss(rl)(jnp.asarray(LOGP), batch)
        clipped = float(metrics["clip_ratio/high_mean"]) + float(metrics["clip_ratio/low_mean"])
        assert (clipped > 0) == (lag == 1), (lag, metrics)
        assert ("importance_weight/max" in metrics) == (lag == 1)
