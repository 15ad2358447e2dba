"""GRPO / REINFORCE losses against direct float64 numpy transcriptions of their equations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.rl import losses
from logra_jax.rl.algorithms.grpo import GroupAdvantages
from logra_jax.rl.algorithms.reinforce import RunningBaselineAdvantages

B, T, G = 6, 5, 3  # 2 prompts × 3 generations, 5 completion tokens


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    logp = -np.abs(rng.normal(1.0, 0.8, (B, T)))
    # Old/ref/rollout log-probs differ by ~±0.4 so ratios land on both sides of both clips.
    old_logp = logp + rng.normal(0.0, 0.4, (B, T))
    ref_logp = logp + rng.normal(0.0, 0.3, (B, T))
    advantages = np.array([-1.3, 0.7, 0.4, -0.5, 1.1, -0.9])  # both signs on non-empty rows
    lengths = np.array([5, 3, 0, 1, 4, 5])  # one empty sequence: it must not count
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    return dict(logp=logp, old_logp=old_logp, ref_logp=ref_logp, advantages=advantages, mask=mask)


def aggregation_weights(mask, mode):
    """∂L/∂ℓ_it of the aggregation: m/Σm (token-mean) or m/(T_i·#non-empty) (sequence-mean)."""
    if mode == "token-mean":
        return mask / mask.sum()
    tokens = mask.sum(axis=1, keepdims=True)
    return np.where(tokens > 0, mask / np.maximum(tokens, 1), 0.0) / (tokens > 0).sum()


def np_kl(d, estimator):
    """(value, d value / d logp) of the KL estimator at d = logp − ref."""
    if estimator == "k1":
        return d, np.ones_like(d)
    if estimator == "k2":
        return 0.5 * d**2, d
    return np.exp(-d) + d - 1, 1 - np.exp(-d)


def np_grpo(logp, old_logp, ref_logp, advantages, mask, eps, eps_high, beta, estimator, mode):
    a = advantages[:, None]
    ratio = np.exp(logp - old_logp)
    clipped = np.clip(ratio, 1 - eps, 1 + eps_high)
    unclipped_active = ratio * a <= clipped * a
    kl, dkl = np_kl(logp - ref_logp, estimator)
    per_token = -np.minimum(ratio * a, clipped * a) + beta * kl
    d_per_token = np.where(unclipped_active, -ratio * a, 0.0) + beta * dkl
    w = aggregation_weights(mask, mode)
    metrics = {
        "clip_ratio/low_mean": (((ratio < 1 - eps) & (a < 0)) * mask).sum() / mask.sum(),
        "clip_ratio/high_mean": (((ratio > 1 + eps_high) & (a > 0)) * mask).sum() / mask.sum(),
        "kl": (kl * mask).sum() / mask.sum(),
    }
    return (w * per_token).sum(), w * d_per_token, metrics


GRPO_CASES = [
    dict(epsilon=0.2, epsilon_high=None, beta=0.0, kl_estimator="k3", loss_agg_mode="token-mean"),
    dict(epsilon=0.2, epsilon_high=0.28, beta=0.04, kl_estimator="k3", loss_agg_mode="token-mean"),
    dict(epsilon=0.1, epsilon_high=None, beta=0.1, kl_estimator="k2", loss_agg_mode="sequence-mean"),
    dict(epsilon=0.2, epsilon_high=0.3, beta=0.5, kl_estimator="k1", loss_agg_mode="sequence-mean"),
]


@pytest.mark.parametrize("case", GRPO_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_grpo_loss_value_gradient_metrics(batch, case):
    def loss_fn(logp):
        return losses.grpo_loss(logp, jnp.asarray(batch["old_logp"], jnp.float32),
                                jnp.asarray(batch["advantages"], jnp.float32),
                                jnp.asarray(batch["mask"] > 0), ref_logp=jnp.asarray(
                                    batch["ref_logp"], jnp.float32), **case)

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(
        jnp.asarray(batch["logp"], jnp.float32))
    eps_high = case["epsilon"] if case["epsilon_high"] is None else case["epsilon_high"]
    want_loss, want_grad, want_metrics = np_grpo(
        batch["logp"], batch["old_logp"], batch["ref_logp"], batch["advantages"], batch["mask"],
        case["epsilon"], eps_high, case["beta"], case["kl_estimator"], case["loss_agg_mode"])
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_grpo_fixture_exercises_both_clips(batch):
    """Guard for the test above: the random batch really hits low and high clipping."""
    _, _, metrics = np_grpo(batch["logp"], batch["old_logp"], batch["ref_logp"],
                            batch["advantages"], batch["mask"], 0.2, 0.2, 0.0, "k3", "token-mean")
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0


def test_grpo_on_policy_gradient_is_advantage_weighted_logp_gradient(batch):
    """At old = current policy the clipped surrogate's gradient is −A·m/Σm per token."""
    logp = jnp.asarray(batch["logp"], jnp.float32)
    grad = jax.grad(lambda lp: losses.grpo_loss(
        lp, jax.lax.stop_gradient(lp), jnp.asarray(batch["advantages"], jnp.float32),
        jnp.asarray(batch["mask"]))[0])(logp)
    want = -batch["advantages"][:, None] * batch["mask"] / batch["mask"].sum()
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_grpo_without_reference_reports_zero_kl_and_needs_ref_for_beta(batch):
    args = [jnp.asarray(batch[k], jnp.float32) for k in ("logp", "old_logp", "advantages", "mask")]
    _, metrics = losses.grpo_loss(*args)
    assert float(metrics["kl"]) == 0.0
    with pytest.raises(ValueError, match="ref_logp"):
        losses.grpo_loss(*args, beta=0.01)


def test_grpo_jit_compiles_once_for_new_values(batch):
    step = jax.jit(losses.grpo_loss, static_argnames=("kl_estimator", "loss_agg_mode"))
    args = [jnp.asarray(batch[k], jnp.float32) for k in ("logp", "old_logp", "advantages", "mask")]
    ref = jnp.asarray(batch["ref_logp"], jnp.float32)
    first, _ = step(*args, ref_logp=ref, beta=0.01, epsilon=0.2)
    second, _ = step(args[0] - 0.1, *args[1:], ref_logp=ref, beta=0.02, epsilon=0.3)
    assert step._cache_size() == 1
    assert float(first) != float(second)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(loss_agg_mode="seq-sum"), "loss_agg_mode"),
    (dict(epsilon=-0.1), "epsilon"),
])
def test_grpo_rejects_bad_options(batch, kwargs, match):
    args = [jnp.asarray(batch[k], jnp.float32) for k in ("logp", "old_logp", "advantages", "mask")]
    with pytest.raises(ValueError, match=match):
        losses.grpo_loss(*args, **kwargs)


def test_grpo_rejects_mismatched_shapes(batch):
    logp = jnp.asarray(batch["logp"], jnp.float32)
    mask = jnp.asarray(batch["mask"])
    with pytest.raises(ValueError, match="old_logp"):
        losses.grpo_loss(logp, logp[:, :-1], jnp.zeros(B), mask)
    with pytest.raises(ValueError, match="advantages"):
        losses.grpo_loss(logp, logp, jnp.zeros(B + 1), mask)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_matches_definitions(batch, estimator):
    got = losses.kl_penalty(jnp.asarray(batch["logp"], jnp.float32),
                            jnp.asarray(batch["ref_logp"], jnp.float32), estimator)
    want, _ = np_kl(batch["logp"] - batch["ref_logp"], estimator)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if estimator in ("k2", "k3"):
        assert bool(jnp.all(got >= 0))


def test_kl_penalty_rejects_unknown_estimator(batch):
    with pytest.raises(ValueError, match="kl_estimator"):
        losses.kl_penalty(jnp.zeros(3), jnp.zeros(3), "k5")


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_group_advantages_match_numpy(scale_by_std):
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 1.0])  # middle group: all equal
    got = losses.group_advantages(jnp.asarray(rewards), G, scale_by_std=scale_by_std)
    groups = rewards.reshape(-1, G)
    want = groups - groups.mean(axis=1, keepdims=True)
    if scale_by_std:
        want = want / (groups.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[G:2 * G], 0.0)


@pytest.mark.parametrize("rewards, num_generations, match", [
    (np.zeros(7), 3, "multiple of num_generations"),
    (np.zeros((2, 3)), 3, "flat"),
    (np.zeros(4), 1, "num_generations"),
])
def test_group_advantages_rejects_bad_shapes(rewards, num_generations, match):
    with pytest.raises(ValueError, match=match):
        losses.group_advantages(jnp.asarray(rewards), num_generations)


@pytest.mark.parametrize("mode", ["token-mean", "sequence-mean"])
def test_reinforce_loss_value_detached_weight_gradient_metrics(batch, mode):
    cap = 1.2  # low enough that some weights are capped
    rollout = batch["old_logp"]

    def loss_fn(logp):
        return losses.reinforce_loss(logp, jnp.asarray(rollout, jnp.float32),
                                     jnp.asarray(batch["advantages"], jnp.float32),
                                     jnp.asarray(batch["mask"]), is_cap=cap, loss_agg_mode=mode)

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(
        jnp.asarray(batch["logp"], jnp.float32))
    ratio = np.exp(batch["logp"] - rollout)
    weight = np.minimum(ratio, cap)
    a = batch["advantages"][:, None]
    w = aggregation_weights(batch["mask"], mode)
    mask = batch["mask"]
    np.testing.assert_allclose(loss, (w * -weight * a * batch["logp"]).sum(), rtol=1e-5, atol=1e-6)
    # The weight is a constant for differentiation: ∇ℓ = −w·A·∇log π.
    np.testing.assert_allclose(grad, w * -weight * a, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["importance_weight/mean"],
                               (weight * mask).sum() / mask.sum(), rtol=1e-5)
    capped = ((ratio > cap) * mask).sum() / mask.sum()
    assert 0 < capped < 1
    np.testing.assert_allclose(metrics["importance_weight/capped_mean"], capped, rtol=1e-5)
    np.testing.assert_allclose(metrics["rollout_mismatch"],
                               ((rollout - batch["logp"]) * mask).sum() / mask.sum(), rtol=1e-5)


def test_reinforce_loss_rejects_bad_options(batch):
    logp = jnp.asarray(batch["logp"], jnp.float32)
    mask = jnp.asarray(batch["mask"])
    with pytest.raises(ValueError, match="is_cap"):
        losses.reinforce_loss(logp, logp, jnp.zeros(B), mask, is_cap=0.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        losses.reinforce_loss(logp, logp, jnp.zeros(B), mask, loss_agg_mode="sum")


def test_update_baseline_is_an_ema_of_batch_means():
    outcomes = [np.array([1.0, 0.0, 1.0, 1.0]), np.array([-0.01, -0.01, 1.0, -0.01])]
    b, want = 0.0, 0.0
    for batch_outcomes in outcomes:
        b = losses.update_baseline(b, jnp.asarray(batch_outcomes))
        want = 0.9 * want + 0.1 * batch_outcomes.mean()
        np.testing.assert_allclose(b, want, rtol=1e-6)
    np.testing.assert_allclose(losses.update_baseline(0.5, jnp.ones(3), momentum=0.0), 1.0)
    with pytest.raises(ValueError, match="momentum"):
        losses.update_baseline(0.0, jnp.ones(3), momentum=1.5)


def test_advantages_of_both_algorithms():
    r = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    adv, baseline = RunningBaselineAdvantages(momentum=0.9)(r, 0.5)
    np.testing.assert_allclose(adv, r - 0.5)                        # the baseline before its update
    np.testing.assert_allclose(baseline, 0.9 * 0.5 + 0.1 * r.mean(), rtol=1e-6)
    adv, baseline = GroupAdvantages(2, scale_by_std=False)(r, 0.5)
    np.testing.assert_allclose(adv, [0.5, -0.5, 0.0, 0.0])          # centred within each group
    assert baseline == 0.5                                          # GRPO keeps no baseline


# ---------------------------------------------------------------- the reference recipe's details
def test_leave_one_out_baseline_and_std_as_the_reference():
    """RLOO: b_i = mean of the other responses' rewards; scaled by the group's unbiased std + 1e-6.
    Group [1, 0, 0, 1]: b = 1/3 for the ones, 2/3 for the zeros, σ = sqrt(1/3), so A = ±(2/3)/σ."""
    got = losses.group_advantages(jnp.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]), 4,
                                  baseline="leave_one_out")
    a = (2 / 3) / (math.sqrt(1 / 3) + 1e-6)
    np.testing.assert_allclose(got, [a, -a, -a, a, 0, 0, 0, 0], rtol=1e-6)
    unscaled = losses.group_advantages(jnp.asarray([1.0, 0.0, 0.0, 0.5]), 4, scale_by_std=False,
                                       baseline="leave_one_out")
    np.testing.assert_allclose(unscaled, [1 - 0.5 / 3, -1.5 / 3, -1.5 / 3, 0.5 - 1 / 3], rtol=1e-6)
    adv, _ = GroupAdvantages(4, baseline="leave_one_out")(
        np.array([1.0, 0.0, 0.0, 1.0], np.float32), 0.0)
    np.testing.assert_allclose(adv, got[:4], rtol=1e-6)
    with pytest.raises(ValueError, match="baseline"):
        losses.group_advantages(jnp.zeros(4), 4, baseline="median")


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
def test_nonfinite_rewards_are_masked_from_group_advantages(baseline):
    """A NaN reward gets advantage 0 and is left out of its group's statistics: the group
    [1, NaN, 0, 1] gives the advantages of the group [1, 0, 1] to its other rows."""
    got = losses.group_advantages(jnp.asarray([1.0, np.nan, 0.0, 1.0]), 4, baseline=baseline)
    three = losses.group_advantages(jnp.asarray([1.0, 0.0, 1.0]), 3, baseline=baseline)
    np.testing.assert_allclose(got, [three[0], 0.0, three[1], three[2]], rtol=1e-6)
    lone = losses.group_advantages(jnp.asarray([np.nan, np.nan, np.inf, 1.0]), 4, baseline=baseline)
    np.testing.assert_array_equal(lone, 0.0)   # one finite reward: nothing to compare it with


def test_nonfinite_rewards_are_masked_from_the_running_baseline():
    """The reference masks the row: b ← 0.9·0.5 + 0.1·mean(1, 0) = 0.5; all-NaN leaves b."""
    np.testing.assert_allclose(losses.update_baseline(0.5, jnp.asarray([1.0, np.nan, 0.0])), 0.5,
                               rtol=1e-6)
    np.testing.assert_allclose(losses.update_baseline(0.25, jnp.asarray([np.nan, np.nan])), 0.25)
    adv, baseline = RunningBaselineAdvantages()(np.array([1.0, np.nan], np.float32), 0.5)
    np.testing.assert_allclose(adv, [0.5, 0.0])
    np.testing.assert_allclose(baseline, 0.9 * 0.5 + 0.1 * 1.0, rtol=1e-6)


def test_truncated_importance_weight_is_zero_for_an_impossible_rollout_token():
    """log π_rollout = −inf (the sampler gave the token probability 0): w = 0, as the reference
    (exp(logp + inf) capped would give is_cap = 2); log π_θ = −inf too: no NaN in loss or gradient."""
    logp = jnp.asarray([[-1.0, -2.0, -np.inf]], jnp.float32)
    rollout = jnp.asarray([[-1.0, -np.inf, -0.5]], jnp.float32)
    mask = jnp.ones((1, 3))

    def loss_fn(lp):
        return losses.reinforce_loss(lp, rollout, jnp.asarray([1.0]), mask, is_cap=2.0)
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp)
    np.testing.assert_allclose(loss, -1.0 * 1.0 * -1.0 / 3, rtol=1e-6)   # only token 0 counts
    np.testing.assert_allclose(grad, [[-1.0 / 3, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(metrics["importance_weight/mean"], 1.0 / 3, rtol=1e-6)
    np.testing.assert_allclose(metrics["rollout_mismatch"], 0.0, atol=1e-7)
