"""§6: the JVP-predicted KL against the exact KL of a tiny model, and the α controller."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.optim import (LowRankUpdate, SketchSpec, apply_updates, exact_kl,
                             exact_kl_from_hidden, kl_budget_schedule, make_candidate_kl,
                             make_predict_kl, make_probes, merge_targets, probe_factors,
                             scale_by_predicted_kl, split_targets, with_factors, with_update_factors)
from optim_tiny_lm import build

SPEC = SketchSpec(rank=4, seed=11)
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def setup():
    _, params, logits_fn = build(vocab=32, d=8, f=16, num_layers=2, seed=2)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 8), 0, 32)
    mask = jnp.zeros((2, 8)).at[0, 3:].set(1.0).at[1, 5:7].set(1.0)   # response tokens only
    probes = make_probes(params, 5, SPEC)
    target_kernels, others = split_targets(params, SPEC)

    def probe_logits(others, factors):
        return logits_fn(merge_targets(others, target_kernels), tokens, with_factors(probes, factors))

    predict = jax.jit(make_predict_kl(probe_logits, others, probe_factors(probes), mask, TEMPERATURE))

    @jax.jit
    def realized(new_params):
        return exact_kl(logits_fn(params, tokens), logits_fn(new_params, tokens), mask, TEMPERATURE)

    rng = np.random.default_rng(0)
    direction = {"factors": {p: jnp.asarray(rng.normal(size=pr.factor.shape), jnp.float32)
                             for p, pr in probes.items()},
                 "others": jax.tree.map(lambda x: None if x is None else jnp.asarray(
                     rng.normal(size=x.shape), jnp.float32), others, is_leaf=lambda x: x is None)}

    def candidate(scale, with_others=True):
        """Params-shaped factor-space update: U at targets, dense elsewhere."""
        other_part = jax.tree.map(lambda x: None if x is None else (x * scale if with_others else 0 * x),
                                  direction["others"], is_leaf=lambda x: x is None)
        return merge_targets(other_part, {p: u * scale for p, u in direction["factors"].items()})

    def apply(updates):
        """What the optimizer's last transform and apply_updates do with factor-space updates."""
        wrapped = {p: LowRankUpdate(factor=updates_leaf(updates, p), key=probes[p].key,
                                    weight_scale=jnp.float32(1.0)) for p in probes}
        _, dense_others = split_targets(updates, SPEC)
        return apply_updates(params, merge_targets(dense_others, wrapped))

    def updates_leaf(updates, path):
        node = updates
        for part in path.split("/"):
            node = node[part]
        return node

    # The safeguard's measurement with the logits as "hidden states" and the identity as head:
    # exact_kl_from_hidden then is exact_kl of the candidate model's logits.
    eye = jnp.eye(32, dtype=jnp.float32)

    def probe_hidden(others_, factors_):
        return logits_fn(merge_targets(others_, target_kernels), tokens,
                         with_update_factors(probes, factors_)), eye
    checked = jax.jit(make_candidate_kl(probe_hidden, others, probe_factors(probes),
                                        logits_fn(params, tokens), eye, mask, TEMPERATURE))

    return dict(params=params, predict=predict, realized=realized, candidate=candidate,
                apply=apply, probe_logits=probe_logits, others=others, probes=probes, mask=mask,
                checked=checked)


@pytest.mark.parametrize("scale", [1e-3, 3e-4])
def test_predicted_kl_matches_exact_kl_after_a_small_step(setup, scale):
    update = setup["candidate"](scale)
    pred = float(setup["predict"](update))
    exact = float(setup["realized"](setup["apply"](update)))
    assert exact > 0
    assert abs(pred - exact) / exact <= 1e-2, (pred, exact)


def test_frozen_others_skips_their_tangent(setup):
    """With others_frozen the candidate's other-weights updates (nonzero here) are not part of
    the prediction: it is the prediction of the same targets' update alone — and that differs
    from the prediction with the other weights, so ignoring the flag would show."""
    update = setup["candidate"](1e-3)
    targets_only = float(setup["predict"](setup["candidate"](1e-3, with_others=False)))
    frozen = make_predict_kl(setup["probe_logits"], setup["others"],
                             probe_factors(setup["probes"]), setup["mask"], TEMPERATURE,
                             others_frozen=True)
    np.testing.assert_allclose(float(frozen(update)), targets_only, rtol=1e-5)
    assert abs(float(setup["predict"](update)) - targets_only) > 0.1 * targets_only


def test_alpha_brings_the_realized_kl_to_the_budget(setup):
    budget = 2e-4
    tx = scale_by_predicted_kl(kl_budget=budget, kl_budget_final=budget / 10)
    unit = float(setup["predict"](setup["candidate"](1e-3)))
    # a candidate whose predicted KL is a quarter of the budget: α should be ≈ 2
    update = setup["candidate"](1e-3 * math.sqrt(budget / 4 / unit))
    scaled, state = tx.update(update, tx.init(None), predict_kl=setup["predict"])
    assert 1.9 < float(state.alpha) < 2.1
    realized = float(setup["realized"](setup["apply"](scaled)))
    assert abs(realized - budget) / budget <= 0.05, realized
    # α²·pred, what the metrics call the applied update's predicted KL, is what happened
    assert abs(float(state.alpha) ** 2 * float(state.candidate_kl) - realized) / realized <= 0.03


@pytest.mark.parametrize("scale", [1e-3, 3e-2])
def test_candidate_kl_through_the_probes_is_the_kl_of_the_merged_model(setup, scale):
    """W + U·A run through the low-rank branch, before any merge, is the model after the merge."""
    update = setup["candidate"](scale)
    checked = float(setup["checked"](update))
    realized = float(setup["realized"](setup["apply"](update)))
    assert realized > 0
    np.testing.assert_allclose(checked, realized, rtol=1e-3)


def test_safeguard_scales_back_a_step_the_prediction_undershot(setup):
    """A prediction 10× too small makes α too large; the measured KL exceeds c·B and the step is
    brought back to B (to the quadratic model's accuracy) before anything is merged."""
    budget = 2e-4
    update = setup["candidate"](1e-3)
    undershoot = lambda u: setup["predict"](u) / 10.0
    for safeguard, backs_off in ((1.0, True), (float("inf"), False)):
        tx = scale_by_predicted_kl(kl_budget=budget, kl_budget_final=budget, alpha_max=1e3,
                                   kl_safeguard=safeguard, kl_correction=0.0)
        scaled, state = tx.update(update, tx.init(None), predict_kl=undershoot,
                                  candidate_kl=setup["checked"])
        realized = float(setup["realized"](setup["apply"](scaled)))
        np.testing.assert_allclose(float(state.checked_kl), 10 * budget, rtol=0.05)
        if backs_off:
            np.testing.assert_allclose(float(state.backoff), math.sqrt(0.1), rtol=0.03)
            assert abs(realized - budget) / budget <= 0.05, realized
            # the applied step's prediction is s²·K; the JVP's (of the α-scaled step) was B
            np.testing.assert_allclose(float(state.predicted_kl), budget, rtol=1e-5)
            np.testing.assert_allclose(float(state.jvp_kl), budget, rtol=1e-5)
        else:
            assert float(state.backoff) == 1.0
            assert realized > 8 * budget


def test_correction_learns_a_biased_prediction(setup):
    """A prediction always 4× too small: ρ learns the factor, and the realized KL of each step
    approaches the budget without any back-off (safeguard off to isolate the correction)."""
    budget = 2e-4
    update = setup["candidate"](1e-3)
    undershoot = lambda u: setup["predict"](u) / 4.0
    tx = scale_by_predicted_kl(kl_budget=budget, kl_budget_final=budget, alpha_max=1e3,
                               kl_safeguard=float("inf"), kl_correction=0.5)
    state = tx.init(None)
    step = jax.jit(lambda state: tx.update(update, state, predict_kl=undershoot,
                                           candidate_kl=setup["checked"]))
    apply = jax.jit(setup["apply"])
    errors = []
    for _ in range(8):
        scaled, state = step(state)
        realized = float(setup["realized"](apply(scaled)))
        errors.append(abs(realized - float(state.jvp_kl)) / realized)
    assert errors[0] > 0.7                      # the first step trusts the raw prediction: 4× off
    assert errors[-1] < 0.05, errors
    np.testing.assert_allclose(float(state.kl_ratio), 4.0, rtol=0.05)


def test_reference_controller_without_safeguard_or_correction(setup):
    """kl_safeguard=inf, kl_correction=0: the measured KL changes nothing (α as the reference)."""
    update = setup["candidate"](1e-3)
    plain = scale_by_predicted_kl()
    reference = scale_by_predicted_kl(kl_safeguard=float("inf"), kl_correction=0.0)
    a, sa = plain.update(update, plain.init(None), predict_kl=setup["predict"])
    b, sb = reference.update(update, reference.init(None), predict_kl=setup["predict"],
                             candidate_kl=setup["checked"])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert float(sb.kl_ratio) == 1.0 and float(sb.backoff) == 1.0 and float(sb.checked_kl) > 0


def test_nonfinite_measured_kl_makes_the_update_nan_for_the_guard(setup):
    tx = scale_by_predicted_kl()
    update = setup["candidate"](1e-3)
    scaled, state = tx.update(update, tx.init(None), predict_kl=setup["predict"],
                              candidate_kl=lambda u: jnp.float32(jnp.inf))
    assert np.isnan(float(state.backoff))
    assert all(bool(jnp.all(jnp.isnan(x))) for x in jax.tree.leaves(scaled))
    assert float(state.kl_ratio) == 1.0      # nothing learned from it


def _controller_step(tx, state, pred, mismatch=None):
    update = {"w": jnp.ones((3,))}
    return tx.update(update, state, predict_kl=lambda u: jnp.float32(pred), mismatch=mismatch)


def test_alpha_rule_budget_schedule_and_mismatch_ema():
    b0, bf, horizon, amax, w = 2e-4, 2e-5, 5, 3.0, 0.3
    tx = scale_by_predicted_kl(b0, bf, horizon, amax, w)
    state = tx.init(None)
    m = 0.0
    preds = [1e-4, 0.0, 1e-9, 5.0, 2e-5, 3e-5, 1e-5, 1e-5]
    # NaN: a batch without a completed response; the reference leaves m as it was.
    mismatches = [None, 4e-5, -1.0, 1e-4, None, 2e-4, float("nan"), 0.0]
    for k, (pred, mm) in enumerate(zip(preds, mismatches)):
        out, state = _controller_step(tx, state, pred, mm)
        budget = bf + 0.5 * (b0 - bf) * (1 + math.cos(math.pi * min(k / (horizon - 1), 1)))
        if mm is not None and not math.isnan(mm):
            m = (1 - w) * m + w * max(0.0, mm)
        effective = max(budget - m, 0.5 * budget)
        alpha = 1.0 if pred == 0 else min(amax, math.sqrt(effective / pred))
        np.testing.assert_allclose(float(state.effective_budget), effective, rtol=1e-5)
        np.testing.assert_allclose(float(state.mismatch), m, rtol=1e-5, atol=1e-12)
        np.testing.assert_allclose(float(state.alpha), alpha, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(out["w"]), alpha, rtol=1e-5)
        np.testing.assert_allclose(float(kl_budget_schedule(b0, bf, horizon)(k)), budget, rtol=1e-5)
    assert int(state.count) == len(preds)


@pytest.mark.parametrize("bad", [float("nan"), -1e-6, float("inf")])
def test_nan_negative_or_infinite_prediction_is_refused(bad):
    """The reference raises for all three; α = sqrt(B/inf) = 0 would skip the step silently."""
    tx = scale_by_predicted_kl()
    with pytest.raises(ValueError, match="NaN, negative or infinite"):
        _controller_step(tx, tx.init(None), bad)
    jitted = jax.jit(lambda u, s: tx.update(u, s, predict_kl=lambda _: jnp.float32(bad)))
    with pytest.raises(Exception, match="NaN, negative or infinite"):
        out, _ = jitted({"w": jnp.ones((3,))}, tx.init(None))
        jax.block_until_ready(out)


def test_nonfinite_candidate_is_left_to_the_guard():
    tx = scale_by_predicted_kl()
    update = {"w": jnp.array([1.0, jnp.nan])}
    out, state = tx.update(update, tx.init(None), predict_kl=lambda u: jnp.sum(u["w"]))
    assert float(state.alpha) == 1.0 and np.isnan(float(state.candidate_kl))


def test_missing_predict_kl_and_bad_arguments_raise():
    tx = scale_by_predicted_kl()
    with pytest.raises(ValueError, match="predict_kl"):
        tx.update({"w": jnp.ones(2)}, tx.init(None))
    for kwargs, name in [(dict(kl_budget=0.0), "kl_budget"), (dict(alpha_max=-1.0), "alpha_max"),
                         (dict(kl_budget_horizon=0), "kl_budget_horizon"),
                         (dict(mismatch_weight=1.5), "mismatch_weight"),
                         (dict(kl_safeguard=0.0), "kl_safeguard"),
                         (dict(kl_correction=-0.1), "kl_correction")]:
        with pytest.raises(ValueError, match=name):
            scale_by_predicted_kl(**kwargs)


def test_exact_kl_matches_float64_textbook_formula():
    rng = np.random.default_rng(4)
    old = rng.normal(size=(3, 4, 50)) * 3
    mask = np.array([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1]], np.float32)
    for step in (1.0, 1e-2, 1e-4):
        new = old + step * rng.normal(size=old.shape)

        def log_softmax(z):
            z = z / TEMPERATURE
            return z - np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1, keepdims=True)) - z.max(-1, keepdims=True)
        lp, lq = log_softmax(old), log_softmax(new)
        per_token = np.sum(np.exp(lp) * (lp - lq), axis=-1)
        expected = np.sum(per_token * mask) / mask.sum()
        got = float(exact_kl(jnp.asarray(old, jnp.float32), jnp.asarray(new, jnp.float32),
                             jnp.asarray(mask), TEMPERATURE))
        # fp32 logits carry ~1e-7 relative noise into δ, hence the looser bound at the tiniest step
        np.testing.assert_allclose(got, expected, rtol=1e-4 if step > 1e-3 else 1e-3)


@pytest.mark.parametrize("token_chunk", [1, 3, 4, 7])
def test_exact_kl_from_hidden_equals_exact_kl_of_the_full_logits(token_chunk):
    """Chunks that divide the positions, that do not (a padded last chunk), and one covering all."""
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    h_old = jax.random.normal(keys[0], (2, 5, 8))
    h_new = h_old + 0.1 * jax.random.normal(keys[1], h_old.shape)
    head_old = jax.random.normal(keys[2], (8, 30))
    head_new = head_old + 0.1 * jax.random.normal(keys[3], head_old.shape)
    mask = jnp.array([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]], jnp.float32)
    want = exact_kl(h_old @ head_old, h_new @ head_new, mask, TEMPERATURE)
    got = exact_kl_from_hidden(h_old, head_old, h_new, head_new, mask, TEMPERATURE,
                               token_chunk=token_chunk)
    assert float(want) > 1e-3
    np.testing.assert_allclose(got, want, rtol=1e-5)
    with pytest.raises(ValueError, match="do not fit together"):
        exact_kl_from_hidden(h_old, head_old, h_new[:, :4], head_new, mask)
