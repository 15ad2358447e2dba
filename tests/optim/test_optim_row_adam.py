"""§4: RowAdam against a direct numpy transcription; invariances; non-finite sketches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.optim import (SketchSpec, apply_updates, logra, logra_metrics, projection,
                             scale_by_row_adam, update_index)

SPEC = SketchSpec(rank=4, seed=3)
PARAMS = {
    "layers": {"up_proj": {"kernel": jnp.ones((2, 6, 5))}, "norm": jnp.ones((2, 5))},
    "o_proj": {"kernel": jnp.ones((7, 3))},
}
SKETCH_SHAPES = {"layers/up_proj/kernel": (2, 5, 4), "o_proj/kernel": (3, 4)}


def _grads(sketches, norm_grad=None):
    return {"layers": {"up_proj": {"kernel": sketches["layers/up_proj/kernel"]},
                       "norm": jnp.ones((2, 5)) if norm_grad is None else norm_grad},
            "o_proj": {"kernel": sketches["o_proj/kernel"]}}


def _directions(updates):
    return {"layers/up_proj/kernel": np.asarray(updates["layers"]["up_proj"]["kernel"]),
            "o_proj/kernel": np.asarray(updates["o_proj"]["kernel"])}


def _random_sketches(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    # rows of very different magnitude, as real gradients have
    return {p: jnp.asarray(scale * rng.normal(size=s) * rng.uniform(0.01, 10.0, size=s[:-1] + (1,)),
                           jnp.float32) for p, s in SKETCH_SHAPES.items()}


def numpy_row_adam(sketch_steps, variant, b2, eps, num_tokens_steps):
    """docs/algorithm.md §4 written out in float64 numpy, one matrix (layer) at a time."""
    tiny = np.finfo(np.float32).tiny
    out = []
    v = None
    for t, (s, n) in enumerate(zip(sketch_steps, num_tokens_steps), start=1):
        s = np.asarray(s, np.float64)
        if variant == "kl":
            s = s / n
        v = (1 - b2) * np.mean(s ** 2, axis=-1) if v is None else b2 * v + (1 - b2) * np.mean(s ** 2, axis=-1)
        rho = np.sqrt(v / (1 - b2 ** t))
        if variant == "learning_rate":
            d = s / (rho + eps)[..., None]
        else:
            d = np.empty_like(s)
            for idx in np.ndindex(s.shape[:-2]):   # per layer of the stack
                r, sl = rho[idx], s[idx]
                dl = sl / (r + max(eps * r.mean(), tiny))[:, None]
                d[idx] = dl * np.linalg.norm(sl) / np.linalg.norm(dl)
        out.append(d)
    return out


@pytest.fixture(scope="module")
def jitted():
    cache = {}

    def get(variant, b2=0.95, eps=1e-8):
        if (variant, b2, eps) not in cache:
            tx = scale_by_row_adam(SPEC, variant=variant, b2=b2, eps=eps)
            cache[variant, b2, eps] = (tx, jax.jit(tx.update))
        return cache[variant, b2, eps]
    return get


@pytest.mark.parametrize("variant", ["learning_rate", "kl"])
def test_matches_numpy_transcription_over_four_steps(jitted, variant):
    b2, eps = 0.9, 1e-3   # a visible ε, so its placement is checked too
    tx, update = jitted(variant, b2, eps)
    state = tx.init(PARAMS)
    steps = [_random_sketches(seed) for seed in range(4)]
    tokens = [17.0, 5.0, 40.0, 9.0]
    ours = []
    for sketches, n in zip(steps, tokens):
        updates, state = update(_grads(sketches), state, PARAMS, num_tokens=jnp.float32(n))
        ours.append(_directions(updates))
        np.testing.assert_array_equal(updates["layers"]["norm"], 1.0)   # non-targets untouched
    for path in SKETCH_SHAPES:
        expected = numpy_row_adam([s[path] for s in steps], variant, b2, eps, tokens)
        for t, (mine, ref) in enumerate(zip([o[path] for o in ours], expected)):
            np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-7, err_msg=f"{path} step {t}")
    assert int(state.count) == 4 and int(state.update_index) == 4
    assert {p: v.dtype for p, v in [("a", state.v["layers"]["up_proj"]["kernel"])]} == {"a": jnp.float32}
    assert state.v["layers"]["up_proj"]["kernel"].shape == (2, 5)   # one value per output row


@pytest.mark.parametrize("variant", ["learning_rate", "kl"])
def test_first_step_is_scale_invariant(jitted, variant):
    tx, update = jitted(variant)
    base = _random_sketches(7)
    ref, _ = update(_grads(base), tx.init(PARAMS), PARAMS)
    for c in (1e3, 1e-2):
        scaled = {p: s * c for p, s in base.items()}
        got, _ = update(_grads(scaled), tx.init(PARAMS), PARAMS)
        expected = _directions(ref)
        if variant == "kl":   # KL keeps ‖D‖ = ‖S̃‖: the direction is invariant, the norm scales
            expected = {p: d * c for p, d in expected.items()}
        for path, d in _directions(got).items():
            np.testing.assert_allclose(d, expected[path], rtol=1e-5, atol=1e-6 * np.abs(expected[path]).max())


@pytest.mark.parametrize("variant", ["learning_rate", "kl", "sgd"])
def test_zero_sketch_gives_zero_update(jitted, variant):
    tx, update = jitted(variant)
    zeros = {p: jnp.zeros(s) for p, s in SKETCH_SHAPES.items()}
    updates, state = update(_grads(zeros), tx.init(PARAMS), PARAMS)
    for d in _directions(updates).values():
        np.testing.assert_array_equal(d, 0.0)
    for v in jax.tree.leaves(state.v):
        np.testing.assert_array_equal(v, 0.0)


def test_sgd_mode_is_the_sketch(jitted):
    tx, update = jitted("sgd")
    sketches = _random_sketches(2)
    updates, _ = update(_grads(sketches), tx.init(PARAMS), PARAMS)
    for path, d in _directions(updates).items():
        np.testing.assert_array_equal(d, sketches[path])


def test_nan_sketch_is_dropped_and_counters_advance(jitted):
    tx, update = jitted("learning_rate")
    _, state = update(_grads(_random_sketches(0)), tx.init(PARAMS), PARAMS)
    bad = _random_sketches(1)
    bad["o_proj/kernel"] = bad["o_proj/kernel"].at[0, 0].set(jnp.nan)
    updates, new_state = update(_grads(bad), state, PARAMS)
    for d in _directions(updates).values():
        np.testing.assert_array_equal(d, 0.0)        # every target, not just the NaN one
    for old, new in zip(jax.tree.leaves(state.v), jax.tree.leaves(new_state.v)):
        np.testing.assert_array_equal(old, new)
    assert int(new_state.count) == 2 and int(new_state.update_index) == 2


def test_dense_gradient_is_sketched_with_the_same_projection(jitted):
    tx, update = jitted("learning_rate")
    rng = np.random.default_rng(5)
    dense = {"layers/up_proj/kernel": rng.normal(size=(2, 6, 5)), "o_proj/kernel": rng.normal(size=(7, 3))}
    sketches = {}
    for path, g in dense.items():   # S = G·Aᵀ with A_l(k=0), the kernel gradient being Gᵀ
        info = SPEC.info(path, g.shape)
        keys = np.asarray(SPEC.keys(info, 0)).reshape(-1, 2)
        per_layer = [gl.T @ np.asarray(projection(jnp.asarray(k), info.rank, info.in_dim)).T
                     for gl, k in zip(g.reshape((-1,) + g.shape[-2:]), keys)]
        sketches[path] = jnp.asarray(np.stack(per_layer).reshape(info.sketch_shape), jnp.float32)
    from_dense, _ = update(_grads({p: jnp.asarray(g, jnp.float32) for p, g in dense.items()}),
                           tx.init(PARAMS), PARAMS)
    from_sketch, _ = update(_grads(sketches), tx.init(PARAMS), PARAMS)
    for path, d in _directions(from_dense).items():
        np.testing.assert_allclose(d, _directions(from_sketch)[path], rtol=1e-5, atol=1e-6)


def test_bad_arguments_and_gradients_raise():
    with pytest.raises(ValueError, match="variant"):
        scale_by_row_adam(SPEC, variant="adam")
    with pytest.raises(ValueError, match="b2"):
        scale_by_row_adam(SPEC, b2=1.0)
    tx = scale_by_row_adam(SPEC)
    state = tx.init(PARAMS)
    grads = _grads({"layers/up_proj/kernel": jnp.zeros((2, 5, 3)), "o_proj/kernel": jnp.zeros((3, 4))})
    with pytest.raises(ValueError, match="layers/up_proj/kernel.*shape"):
        tx.update(grads, state, PARAMS)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(grads, state)


@pytest.fixture(scope="module")
def guarded():
    tx = logra(variant="learning_rate", rank=4, seed=3, learning_rate=1e-2, weight_decay=0.1)
    return tx, jax.jit(tx.update)


@pytest.mark.parametrize("bad_leaf", ["target", "other"])
def test_logra_nonfinite_gradient_changes_no_weight(guarded, bad_leaf):
    tx, update = guarded
    state = tx.init(PARAMS)
    updates, state = update(_grads(_random_sketches(0)), state, PARAMS)
    params = apply_updates(PARAMS, updates)
    grads = _grads(_random_sketches(1))
    if bad_leaf == "target":
        grads["layers"]["up_proj"]["kernel"] = grads["layers"]["up_proj"]["kernel"].at[1, 2, 0].set(jnp.inf)
    else:
        grads["layers"]["norm"] = grads["layers"]["norm"].at[0, 0].set(jnp.nan)
    updates, new_state = update(grads, state, params)
    new_params = apply_updates(params, updates)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)):
        np.testing.assert_array_equal(a, b)
    metrics = logra_metrics(new_state)
    assert bool(metrics["logra/skipped"]) and int(metrics["logra/num_skipped"]) == 1
    assert int(update_index(new_state)) == 2             # A still advances with the trainer
    # learned state is kept as it was (RowAdam's v, AdamW's moments)
    skipped_inner, kept_inner = new_state.inner_state[1], state.inner_state[1]
    for a, b in zip(jax.tree.leaves(kept_inner), jax.tree.leaves(skipped_inner)):
        if a.dtype != jnp.int32:
            np.testing.assert_array_equal(a, b)


def test_logra_skips_a_nonfinite_gradient_whose_update_would_be_finite():
    """A frozen non-target's gradient reaches no weight, and without clipping nothing carries it
    into an update, yet a non-finite one still drops the whole update: logra reads the gradient's
    finiteness off its reconstructed norm (skip_nonfinite(gradient_by_norm=True)), which sums the
    square of every gradient entry."""
    tx = logra(variant="learning_rate", rank=4, seed=3, learning_rate=1e-2, others="frozen",
               max_grad_norm=float("inf"))
    state = tx.init(PARAMS)
    updates, state = jax.jit(tx.update)(
        _grads(_random_sketches(1), norm_grad=jnp.ones((2, 5)).at[1, 3].set(jnp.nan)), state, PARAMS)
    assert bool(logra_metrics(state)["logra/skipped"])
    for a, b in zip(jax.tree.leaves(PARAMS), jax.tree.leaves(apply_updates(PARAMS, updates))):
        np.testing.assert_array_equal(a, b)
