"""Stochastic rounding to bf16: unbiased, exact on bf16 values, never inf from finite, per key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.optim.rounding import round_to, stochastic_round_bf16

N = 40_000


@pytest.mark.parametrize("lo", [1.0, -3.140625, 2.0 ** -130, 6.5e4])
@pytest.mark.parametrize("fraction", [0.03, 0.5, 0.9])
def test_the_mean_of_many_draws_is_the_value(lo, fraction):
    """x between bf16 neighbours lo and hi: the mean of SR(x) is x within 5 standard errors,
    (hi − lo)·sqrt(p(1 − p)/N); a subnormal, a negative and a large value among them."""
    lo32 = np.float32(jnp.asarray(lo, jnp.bfloat16).astype(jnp.float32))
    hi32 = np.float32(jnp.nextafter(jnp.asarray(lo32, jnp.bfloat16),
                                    jnp.asarray(np.sign(lo32) * np.inf, jnp.bfloat16)).astype(jnp.float32))
    x = np.float32(lo32 + fraction * (hi32 - lo32))
    assert lo32 != x != hi32
    draws = np.asarray(stochastic_round_bf16(jnp.full((N,), x), jax.random.PRNGKey(0)), np.float64)
    assert set(np.unique(draws)) <= {lo32, hi32}
    p = (x - lo32) / (hi32 - lo32)
    stderr = abs(hi32 - lo32) * np.sqrt(p * (1 - p) / N)
    assert abs(draws.mean() - x) <= 5 * stderr, (draws.mean(), x, stderr)


def test_bf16_values_are_left_unchanged():
    values = jax.random.normal(jax.random.PRNGKey(1), (4096,)).astype(jnp.bfloat16)
    values = jnp.concatenate([values, jnp.asarray([0.0, -0.0, 2.0 ** -133, 3.3895e38], jnp.bfloat16)])
    got = stochastic_round_bf16(values.astype(jnp.float32), jax.random.PRNGKey(2))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(values, np.float32))


def test_finite_input_never_becomes_inf_or_nan_and_specials_stay():
    big = np.finfo(np.float32).max
    x = jnp.asarray([big, -big, 3.3895e38, 3.39e38, -3.39e38, np.inf, -np.inf, np.nan], jnp.float32)
    for seed in range(50):
        got = np.asarray(stochastic_round_bf16(x, jax.random.PRNGKey(seed)), np.float32)
        assert np.isfinite(got[:5]).all(), got
        assert got[5] == np.inf and got[6] == -np.inf and np.isnan(got[7])


def test_deterministic_per_key():
    x = jax.random.normal(jax.random.PRNGKey(3), (1000,)) * 1e-3 + 1.0
    a, b = (stochastic_round_bf16(x, jax.random.PRNGKey(4)) for _ in range(2))
    np.testing.assert_array_equal(a, b)
    c = stochastic_round_bf16(x, jax.random.PRNGKey(5))
    assert not np.array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


def test_round_to_nearest_is_a_cast_and_fp32_is_exact():
    x = jax.random.normal(jax.random.PRNGKey(6), (256,))
    np.testing.assert_array_equal(round_to(x, jnp.bfloat16, "nearest"), x.astype(jnp.bfloat16))
    np.testing.assert_array_equal(round_to(x, jnp.float32, "stochastic", jax.random.PRNGKey(0)), x)
    with pytest.raises(ValueError, match="rounding must be one of"):
        round_to(x, jnp.bfloat16, "down")
    with pytest.raises(ValueError, match="needs a key"):
        round_to(x, jnp.bfloat16, "stochastic")


def test_a_bf16_merge_rounds_stochastically_with_a_key_of_its_own():
    """The merge of a tiny update into bf16 weights: to nearest it is lost entirely; stochastic
    rounding changes about |ΔW|/ulp of the entries, exactly as SR of the fp32 merge with the key
    derived from A's, and the same update merged twice gives the same bits."""
    from logra_jax.optim import LowRankUpdate, projection_keys
    from logra_jax.optim.low_rank import _ROUNDING_SALT, _delta_one

    kernel = (1.0 + 0.01 * jax.random.normal(jax.random.PRNGKey(7), (64, 32))).astype(jnp.bfloat16)
    key = projection_keys(42, "layers/q_proj/kernel", 3)
    factor = 3e-4 * jax.random.normal(jax.random.PRNGKey(8), (32, 8))   # |ΔW| ≪ ulp/2 = 4e-3
    merge = jax.jit(lambda k, rounding: LowRankUpdate(factor, key, jnp.float32(1.0),
                                                      rounding=rounding).merge_into(k),
                    static_argnums=1)
    np.testing.assert_array_equal(merge(kernel, "nearest"), kernel)
    got = merge(kernel, "stochastic")
    exact = kernel.astype(jnp.float32) + _delta_one(factor, key, 64, "rademacher")
    np.testing.assert_array_equal(got, stochastic_round_bf16(exact, jax.random.fold_in(key, _ROUNDING_SALT)))
    changed = float(np.mean(np.asarray(got != kernel)))
    ulp = np.asarray(jnp.abs(jnp.nextafter(kernel, jnp.asarray(np.inf, jnp.bfloat16)).astype(jnp.float32)
                             - kernel.astype(jnp.float32)))
    expected = float(np.mean(np.abs(np.asarray(exact - kernel.astype(jnp.float32))) / ulp))
    assert 0.7 * expected < changed < 1.3 * expected and changed > 0.02, (changed, expected)
    np.testing.assert_array_equal(merge(kernel, "stochastic"), got)


def test_the_merge_counts_the_entries_it_changed():
    """apply_updates_counting_changes on a stacked bf16 target and an fp32 one: the fraction is
    what a comparison of old and new weights gives (size-weighted over targets), 0 for an update
    lost to round-to-nearest, and NaN for a tree without low-rank updates."""
    from logra_jax.optim import LowRankUpdate, apply_updates_counting_changes, projection_keys

    def update(shape_out, rank, scale, path, rounding):
        factor = scale * jax.random.normal(jax.random.PRNGKey(len(path)), (3,) + (shape_out, rank))
        keys = jax.vmap(lambda i: projection_keys(5, path, 2 + i))(jnp.arange(3))
        return LowRankUpdate(factor, keys, jnp.float32(1.0), rounding=rounding)

    params = {"q": (1.0 + 0.01 * jax.random.normal(jax.random.PRNGKey(1), (3, 48, 16))).astype(jnp.bfloat16),
              "o": jax.random.normal(jax.random.PRNGKey(2), (3, 16, 24)),
              "norm": jnp.ones((3, 16))}
    merge = jax.jit(apply_updates_counting_changes)
    for rounding in ("stochastic", "nearest"):
        updates = {"q": update(16, 4, 3e-4, "q", rounding), "o": update(24, 4, 1e-7, "o", rounding),
                   "norm": jnp.zeros((3, 16))}
        new, fraction = merge(params, updates)
        changed = sum(float(np.sum(np.asarray(new[k] != params[k]))) for k in ("q", "o"))
        assert float(fraction) == pytest.approx(changed / (params["q"].size + params["o"].size), rel=1e-6)
        q_changed = float(np.mean(np.asarray(new["q"] != params["q"])))
        assert (q_changed == 0.0) if rounding == "nearest" else (q_changed > 0.02), (rounding, q_changed)
    assert np.isnan(float(merge({"w": jnp.ones(3)}, {"w": jnp.ones(3)})[1]))


def test_counting_traces_for_targets_beyond_int32_entries():
    """A 70B target stack has more than 2³¹ entries: the count must not pass sizes as int32
    (traced only: nothing of that size is allocated)."""
    from logra_jax.optim import LowRankUpdate, apply_updates_counting_changes

    kernel = jax.ShapeDtypeStruct((2, 65536, 32768), jnp.bfloat16)          # 4.3e9 entries
    update = LowRankUpdate(jax.ShapeDtypeStruct((2, 32768, 4), jnp.float32),
                           jax.ShapeDtypeStruct((2, 2), jnp.uint32), jnp.float32(1.0))
    new, fraction = jax.eval_shape(apply_updates_counting_changes, {"w": kernel}, {"w": update})
    assert new["w"].shape == kernel.shape and fraction.dtype == jnp.float32
