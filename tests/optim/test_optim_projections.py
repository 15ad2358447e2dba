"""projections.py: how A is drawn from its key (the hashed Rademacher signs and the others)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.projections import (DISTRIBUTIONS, SIGN_DISTRIBUTIONS, hashed_bits, projection,
                                   projection_keys)


def _mix32_numpy(x):
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x21F0AAAD)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0xD35A2D97)
    return x ^ (x >> np.uint32(15))


def test_hashed_bits_are_the_documented_formula_in_numpy():
    """The bits are integer arithmetic of (index, key words): numpy's uint32 gives the same."""
    key = projection_keys(42, "layers/mlp/up_proj/kernel", 3)
    rows, cols = 8, 40
    s = np.asarray(jax.random.bits(key, (2,), jnp.uint32))
    counter = (np.arange(rows, dtype=np.uint32)[:, None] * np.uint32(cols)
               + np.arange(cols, dtype=np.uint32)[None, :])
    with np.errstate(over="ignore"):
        expected = _mix32_numpy(_mix32_numpy(counter ^ s[0]) ^ s[1])
    np.testing.assert_array_equal(np.asarray(hashed_bits(key, (rows, cols))), expected)
    a = np.asarray(projection(key, rows, cols))
    np.testing.assert_array_equal(np.sign(a), np.where(expected >> 31 == 0, 1.0, -1.0))
    np.testing.assert_allclose(np.abs(a), 1 / np.sqrt(rows), rtol=1e-7)


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_each_key_gives_its_own_a_and_the_same_key_the_same(distribution):
    r, d = 16, 64
    keys = [projection_keys(0, "layers/attn/q_proj/kernel", 0),
            projection_keys(0, "layers/attn/q_proj/kernel", 1),       # next update
            projection_keys(0, "layers/attn/k_proj/kernel", 0),       # another target
            projection_keys(1, "layers/attn/q_proj/kernel", 0)]       # another seed
    a = [np.asarray(projection(k, r, d, distribution)) for k in keys]
    np.testing.assert_array_equal(a[0], np.asarray(projection(keys[0], r, d, distribution)))
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            assert not np.array_equal(a[i], a[j]), (i, j)
    if distribution in SIGN_DISTRIBUTIONS:
        assert set(np.unique(np.abs(a[0]))) == {np.float32(1 / np.sqrt(r))}


def test_hashed_signs_are_balanced_uncorrelated_and_preserve_norms():
    """What a random projection needs of its signs (E[AᵀA] = I, Johnson–Lindenstrauss): balanced,
    rows uncorrelated, and ‖A·x‖² concentrated at ‖x‖² with the variance of independent signs."""
    r, d = 64, 4096
    key = projection_keys(7, "layers/mlp/down_proj/kernel", 0)
    a = np.asarray(projection(key, r, d), np.float64) * np.sqrt(r)          # ±1
    n = a.size
    assert abs(a.mean()) < 5 / np.sqrt(n)
    corr = a @ a.T / d
    off = np.abs(corr[np.triu_indices(r, 1)])
    # Independent signs: each correlation ~ N(0, 1/d); the largest of 2016 stays below 5σ.
    assert off.max() < 5 / np.sqrt(d)

    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (d,)), np.float64)
    ratios = []
    for k in range(200):
        a_k = np.asarray(projection(projection_keys(7, "layers/mlp/down_proj/kernel", k), r, d),
                         np.float64)
        ratios.append(np.sum((a_k @ x) ** 2) / np.sum(x ** 2))
    ratios = np.asarray(ratios)
    # Independent ±1/√r entries: E = 1, Var = (2/r)·(1 − Σx⁴/‖x‖⁴).
    var = 2 / r * (1 - np.sum(x ** 4) / np.sum(x ** 2) ** 2)
    assert abs(ratios.mean() - 1) < 4 * np.sqrt(var / len(ratios))
    assert 0.7 * var < ratios.var() < 1.3 * var


def test_too_many_entries_for_the_counter_is_refused():
    with pytest.raises(ValueError, match="more than 2³²"):
        hashed_bits(jax.random.PRNGKey(0), (2 ** 16, 2 ** 16 + 1))


def test_probes_carry_the_hash_words_of_their_own_keys():
    """make_probes derives every target's hash words in one batched program; each layer's words
    are its own key's (the A a probe draws is, bit for bit, the A its key draws)."""
    from logra_jax.optim import SketchSpec, make_probes
    params = {"layers": {"q_proj": {"kernel": jnp.zeros((3, 16, 8))},
                         "up_proj": {"kernel": jnp.zeros((3, 16, 24))},
                         "gate_proj": {"kernel": jnp.zeros((3, 16, 24))}},
              "o_proj": {"kernel": jnp.zeros((16, 8))}}
    probes = make_probes(params, 2, SketchSpec(rank=4, seed=7))
    assert len(probes) == 4
    for path, probe in probes.items():
        keys = np.asarray(probe.key).reshape(-1, 2)
        words = np.asarray(probe.words).reshape(-1, 2)
        for key, word in zip(keys, words):
            np.testing.assert_array_equal(word, np.asarray(jax.random.bits(key, (2,), jnp.uint32)))
        last = jax.tree.map(lambda x: x[-1] if probe.key.ndim > 1 else x, probe)   # its last layer
        np.testing.assert_array_equal(np.asarray(last.projection(16)),
                                      np.asarray(projection(last.key, 4, 16)))
