"""logra(...): argument checks, composition with optax, jit, sharding, checkpoints, state size, and
the trainer loop of both variants on a tiny model."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from logra_jax.optim import (LOGRA_STATIC_ARGS, LowRankUpdate, RowAdamState, SketchSpec,
                             apply_updates, exact_kl, logra, logra_metrics, make_predict_kl,
                             make_probes, merge_targets, probe_factors, projection, split_targets,
                             update_index, warmup_constant, with_factors)
from logra_jax.tree_paths import leaves_with_paths, map_with_paths
from emitters import FUSION_EMITTERS
from optim_tiny_lm import TinyLM, build, next_token_loss

RANK = 4
SKETCH = dict(rank=RANK, seed=5)
SPEC = SketchSpec(**SKETCH)
TARGET_PATHS = {"gate_proj/kernel", "layers/q_proj/kernel", "layers/up_proj/kernel",
                "layers/down_proj/kernel"}


def sketched_grads(loss, params, tokens, k, spec=SPEC):
    """The trainer's gradient: sketches at targets (via probes for update index k), dense elsewhere."""
    probes = make_probes(params, k, spec)
    target_kernels, others = split_targets(params, spec)

    def of(others, factors):
        return loss(merge_targets(others, target_kernels), tokens, with_factors(probes, factors))
    other_grads, sketches = jax.grad(of, argnums=(0, 1))(others, probe_factors(probes))
    return merge_targets(other_grads, sketches)


@pytest.fixture(scope="module")
def tiny():
    _, params, logits_fn = build(vocab=32, d=8, f=16, num_layers=2, seed=0)
    loss = next_token_loss(logits_fn)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 2, 9), 0, 32)   # 4 batches
    grad_fn = jax.jit(lambda p, t, k: sketched_grads(loss, p, t, k))
    return dict(params=params, logits_fn=logits_fn, loss=loss, tokens=tokens, grad_fn=grad_fn)


APPLY = jax.jit(apply_updates)


def _run(tx, tiny, steps):
    """`steps` updates of the tiny LM; (params, state, [updates], jitted update). XLA:CPU's
    default emitters: an update through inject_hyperparams is compared bit for bit with the same
    update's own program, equal under them, not by construction (tests/emitters.py)."""
    update = jax.jit(tx.update, compiler_options=FUSION_EMITTERS)
    params = tiny["params"]
    state = tx.init(params)
    history = []
    for step in range(steps):
        grads = tiny["grad_fn"](params, tiny["tokens"][step], update_index(state))
        updates, state = update(grads, state, params)
        history.append(updates)
        params = APPLY(params, updates)
    return params, state, history, update


SCHEDULE = optax.cosine_decay_schedule(1e-2, decay_steps=10)
GRPO_KWARGS = dict(weight_decay=0.1, others_learning_rate=1e-3, **SKETCH)


@pytest.fixture(scope="module")
def learning_rate_run(tiny):
    """Three steps of logra (GRPO) behind optax.clip_by_global_norm, with an lr schedule."""
    tx = optax.chain(optax.clip_by_global_norm(0.5), logra(learning_rate=SCHEDULE, **GRPO_KWARGS))
    params, state, history, update = _run(tx, tiny, 3)
    return dict(params=params, state=state, history=history, update=update)


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize("kwargs,name", [
    (dict(rank=0), "rank"), (dict(rank=-3), "rank"), (dict(rank=2.5), "rank"),
    (dict(b2=1.0), "b2"), (dict(b2=-0.1), "b2"), (dict(variant="ppo"), "variant"),
    (dict(others="sgd"), "others"), (dict(distribution="uniform"), "distribution"),
    (dict(eps=-1.0), "eps"), (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(variant="kl", weight_decay=0.1), "weight_decay"), (dict(targets="(unclosed"), "targets"),
    (dict(variant="kl", update_ratio=0.0), "update_ratio"), (dict(kl_control=True, alpha_max=0.0), "alpha_max"),
    (dict(learning_rate=float("nan")), "learning_rate"), (dict(learning_rate=float("inf")), "learning_rate"),
    (dict(others_learning_rate=-1e-3), "others_learning_rate"), (dict(exact_merge="yes"), "exact_merge"),
    # schedules are checked at their first update
    (dict(learning_rate=lambda count: jnp.nan * count), "learning_rate must be finite and ≥ 0; the schedule"),
    (dict(learning_rate=warmup_constant(float("nan"), 10)), "learning_rate"),
    (dict(others_learning_rate=optax.constant_schedule(-1.0)), "others_learning_rate"),
])
def test_invalid_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        logra(**kwargs)


def test_targets_must_match_matrices():
    params = {"q_proj": {"kernel": jnp.ones((6, 5)), "bias": jnp.ones((5,))}, "norm": jnp.ones(6)}
    with pytest.raises(ValueError, match="matched no parameter"):
        logra(targets=r"attn/").init(params)
    with pytest.raises(ValueError, match="q_proj/bias.*not a matrix"):
        logra(targets=r"q_proj/").init(params)
    square = {"o_proj": {"kernel": jnp.ones((6, 6))}}
    with pytest.raises(ValueError, match="o_proj/kernel.*lower rank"):
        logra(rank=8).init(square)            # r_l = min(8, 6) = 6: sketch (6, 6) == kernel (6, 6)
    logra(rank=5).init(square)


@pytest.mark.parametrize("mode, rollout_devices, replayed", [
    ("off", 0, False), ("factors", 0, False), ("full", 4, False), ("factors", 4, True)])
def test_the_builder_merges_order_free_only_where_a_receiver_replays_the_merge(
        tiny, mode, rollout_devices, replayed):
    """A factors sync to devices of its own re-applies U·A there, so the trainer's product must be
    order-free; colocated (the sampler reads the trainer's weights) or with weights sent, one plain
    dot is enough. ``exact_merge`` set in the config wins either way."""
    from configs import base
    from logra_jax.rl import build as build_lib, optimizers
    config = base.get_config()
    config.optimizer.logra.update(rank=RANK, seed=5)
    config.sync.update(mode=mode, rollout_devices=rollout_devices)
    assert build_lib.replays_merge(config) is replayed
    params = tiny["params"]
    grads = tiny["grad_fn"](params, tiny["tokens"][0], 0)
    for setting, exact in ((None, replayed), (True, True), (False, False)):
        config.optimizer.logra.exact_merge = setting
        tx = optimizers.build(config.optimizer, replayed_merge=replayed).tx
        # The flag is static: tracing the update shows it, nothing needs to run (each eager
        # update compiled its primitives one by one: 172 s of the suite for this test).
        updates, _ = jax.eval_shape(lambda: tx.update(grads, tx.init(params), params))
        flags = {p: x.exact for p, x in leaves_with_paths(updates) if isinstance(x, LowRankUpdate)}
        assert set(flags) == TARGET_PATHS and set(flags.values()) == {exact}, (setting, flags)


# ---------------------------------------------------------------- composition


def test_inside_a_chain_with_clipping_and_a_schedule_compiles_once(tiny, learning_rate_run):
    assert learning_rate_run["update"]._cache_size() == 1        # later calls reused the first compile
    for u in learning_rate_run["history"]:
        assert {p for p, x in leaves_with_paths(u) if isinstance(x, LowRankUpdate)} == TARGET_PATHS
    ws = [float(u["gate_proj"]["kernel"].weight_scale) for u in learning_rate_run["history"]]
    np.testing.assert_allclose(ws, [1 - float(SCHEDULE(t)) * 0.1 for t in range(3)], rtol=1e-6)
    before = float(tiny["loss"](tiny["params"], tiny["tokens"][0]))
    assert float(tiny["loss"](learning_rate_run["params"], tiny["tokens"][0])) < before


def test_inject_hyperparams_gives_identical_updates(tiny, learning_rate_run):
    injected = optax.chain(optax.clip_by_global_norm(0.5), optax.inject_hyperparams(
        logra, static_args=LOGRA_STATIC_ARGS)(learning_rate=SCHEDULE, **GRPO_KWARGS))
    _, state, history, _ = _run(injected, tiny, 3)
    for a, b in zip(learning_rate_run["history"], history):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(x, y)
    assert int(update_index(state)) == 3
    with pytest.raises(ValueError, match="static_args"):
        optax.inject_hyperparams(logra)(rank=4).init(tiny["params"])


def _update_indices(state):
    return [int(x.update_index) for x in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "update_index"))
            if hasattr(x, "update_index")]


def test_update_index_counters_agree_and_each_layer_gets_its_own_a(learning_rate_run):
    indices = _update_indices(learning_rate_run["state"])
    assert len(indices) == 3 and set(indices) == {3}    # every A-holding transform, in step
    keys = [np.asarray(u["layers"]["up_proj"]["kernel"].key) for u in learning_rate_run["history"]]
    assert not np.array_equal(keys[0], keys[1])          # refresh: a new A every update
    assert not np.array_equal(keys[0][0], keys[0][1])    # each layer of the stack has its own A


def test_refresh_off_keeps_a_at_index_zero(tiny):
    _, state, history, _ = _run(logra(learning_rate=1e-2, refresh=False, **SKETCH), tiny, 2)
    assert set(_update_indices(state)) == {0} and int(update_index(state)) == 0
    keys = [np.asarray(u["layers"]["up_proj"]["kernel"].key) for u in history]
    np.testing.assert_array_equal(keys[0], keys[1])
    np.testing.assert_array_equal(keys[0], SPEC.keys(SPEC.info("layers/up_proj/kernel", (2, 8, 16)), 0))


def test_low_rank_merge_equals_dense_reconstruction_and_optax_apply(tiny, learning_rate_run):
    updates = learning_rate_run["history"][0]
    ours = jax.jit(apply_updates, donate_argnums=0)(jax.tree.map(jnp.copy, tiny["params"]), updates)
    drop_in = optax.apply_updates(tiny["params"], updates)
    kernels, ours, drop_in = (dict(leaves_with_paths(t)) for t in (tiny["params"], ours, drop_in))
    for path, u in leaves_with_paths(updates):
        np.testing.assert_allclose(ours[path], drop_in[path], rtol=1e-6, atol=1e-7)
        if not isinstance(u, LowRankUpdate):
            continue
        # W ← ws·W + U·A, i.e. kernel ← ws·kernel + Aᵀ·Uᵀ, layer by layer in float64
        factor, keys = np.asarray(u.factor, np.float64), np.asarray(u.key)
        expected = float(u.weight_scale) * np.asarray(kernels[path], np.float64)
        for idx in np.ndindex(factor.shape[:-2]):
            a = np.asarray(projection(jnp.asarray(keys[idx]), RANK, expected.shape[-2]), np.float64)
            expected[idx] += a.T @ factor[idx].T
        np.testing.assert_allclose(ours[path], expected, rtol=1e-5, atol=1e-6)
        assert np.abs(expected - np.asarray(kernels[path])).max() > 1e-5     # it did change


def test_layerwise_merge_needs_no_second_copy_of_the_weights():
    kernel = jax.ShapeDtypeStruct((8, 512, 1024), jnp.float32)
    update = LowRankUpdate(factor=jax.ShapeDtypeStruct((8, 1024, 16), jnp.float32),
                           key=jax.ShapeDtypeStruct((8, 2), jnp.uint32),
                           weight_scale=jax.ShapeDtypeStruct((), jnp.float32))
    stats = jax.jit(apply_updates, donate_argnums=0).lower(kernel, update).compile().memory_analysis()
    stack_bytes = 8 * 512 * 1024 * 4
    print(f"layer-wise merge temp {stats.temp_size_in_bytes / 2**20:.2f} MiB for a "
          f"{stack_bytes / 2**20:.0f} MiB stack")
    layer_bytes = stack_bytes // 8
    # One layer's kernel, the running sum of its exact slice products (order_free.py) and the
    # product being added: never the stack of 8.
    assert stats.temp_size_in_bytes < 4 * layer_bytes


def test_nnx_optimizer_drop_in_with_dense_gradients(tiny):
    model = TinyLM(32, 8, 16, 2, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, logra(learning_rate=1e-2, **SKETCH), wrt=nnx.Param)
    tokens = tiny["tokens"][0]

    def loss(model):
        logp = jax.nn.log_softmax(model(tokens[:, :-1]))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    @nnx.jit
    def step(model, optimizer):
        value, grads = nnx.value_and_grad(loss)(model)   # dense: the drop-in path
        optimizer.update(model, grads)
        return value
    losses = [float(step(model, optimizer)) for _ in range(3)]
    assert losses[2] < losses[0]


# ---------------------------------------------------------------- sharding and checkpoints


@pytest.fixture(scope="module")
def sharded(tiny):
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)

    def place(path, x):
        spec = P()
        if path.endswith("kernel"):
            spec = P(*([None] * (x.ndim - 2)), "fsdp", "tensor")
        return jax.device_put(x, NamedSharding(mesh, spec))
    params = map_with_paths(place, tiny["params"])
    tx = logra(learning_rate=1e-2, **SKETCH)
    update = jax.jit(tx.update)
    state = tx.init(params)
    grads = tiny["grad_fn"](tiny["params"], tiny["tokens"][0], 0)
    grads = jax.device_put(grads, NamedSharding(mesh, P()))
    return dict(params=params, tx=tx, update=update, state=state, grads=grads)


def _row_moments(state):
    return [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, RowAdamState))
            if isinstance(s, RowAdamState)][0].v


def test_state_is_sharded_like_the_params_out_dim_on_8_devices(sharded):
    assert len(jax.devices()) == 8
    expected = {"gate_proj/kernel": P("tensor"), "layers/q_proj/kernel": P(None, "tensor"),
                "layers/up_proj/kernel": P(None, "tensor"), "layers/down_proj/kernel": P(None, "tensor")}
    before = dict(leaves_with_paths(_row_moments(sharded["state"])))
    assert {p: v.sharding.spec for p, v in before.items()} == expected
    _, new_state = sharded["update"](sharded["grads"], sharded["state"], sharded["params"])
    _, new_state = sharded["update"](sharded["grads"], new_state, sharded["params"])
    assert sharded["update"]._cache_size() == 1          # outputs come back sharded as they went in
    for (path, old), (_, new) in zip(leaves_with_paths(sharded["state"]), leaves_with_paths(new_state)):
        assert new.sharding.is_equivalent_to(old.sharding, old.ndim), path
    probes = make_probes(sharded["params"], 0, SPEC)
    assert probes["layers/up_proj/kernel"].factor.sharding.spec == P(None, "tensor", None)


def test_orbax_restore_reproduces_the_next_update_bit_exactly(sharded, tmp_path):
    _, state = sharded["update"](sharded["grads"], sharded["state"], sharded["params"])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "opt_state", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "opt_state",
                                    jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    expected, expected_state = sharded["update"](sharded["grads"], state, sharded["params"])
    got, got_state = sharded["update"](sharded["grads"], restored, sharded["params"])
    for a, b in zip(jax.tree.leaves((expected, expected_state)), jax.tree.leaves((got, got_state))):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- state size


def test_state_bytes_are_row_moments_adamw_for_others_and_scalars():
    _, params, _ = build(vocab=32, d=16, f=32, num_layers=2, seed=0)
    targets, others = split_targets(params, SPEC)
    v_bytes = sum(math.prod(k.shape[:-2]) * k.shape[-1] * 4 for k in targets.values())
    other_bytes = sum(x.nbytes for x in jax.tree.leaves(others))
    adamw_on_targets = sum(2 * k.nbytes for k in targets.values())

    for variant, adamw_bytes in (("learning_rate", 2 * other_bytes), ("kl", 0)):
        state = logra(variant=variant, **SKETCH).init(params)
        leaves = jax.tree.leaves(state)
        scalars = [x for x in leaves if x.ndim == 0]
        total = sum(x.nbytes for x in leaves)
        assert total == v_bytes + adamw_bytes + sum(x.nbytes for x in scalars), variant
        assert len(scalars) <= 20, variant                    # counters and metrics only
        assert v_bytes < 0.05 * adamw_on_targets
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(_row_moments(state)))


# ---------------------------------------------------------------- the trainer loop, KL variant


def test_kl_variant_with_kl_control_lands_on_the_budget(tiny):
    logits_fn, loss = tiny["logits_fn"], tiny["loss"]
    temperature = 0.8
    probe_tokens = jax.random.randint(jax.random.PRNGKey(9), (2, 8), 0, 32)
    mask = jnp.zeros((2, 8)).at[:, 3:].set(1.0)
    budget = 2e-4
    tx = logra(variant="kl", update_ratio=2.3e-3, kl_budget=budget, kl_budget_final=budget,
               **SKETCH)

    @jax.jit
    def train_step(params, opt_state, tokens, num_tokens):
        probes = make_probes(params, update_index(opt_state), SPEC)
        target_kernels, others = split_targets(params, SPEC)

        def of(others, factors):
            return loss(merge_targets(others, target_kernels), tokens, with_factors(probes, factors))
        other_grads, sketches = jax.grad(of, argnums=(0, 1))(others, probe_factors(probes))

        def probe_logits(others, factors):
            return logits_fn(merge_targets(others, target_kernels), probe_tokens,
                             with_factors(probes, factors))
        predict_kl = make_predict_kl(probe_logits, others, probe_factors(probes), mask, temperature,
                                     others_frozen=True)
        updates, opt_state = tx.update(merge_targets(other_grads, sketches), opt_state, params,
                                       predict_kl=predict_kl, num_tokens=num_tokens, mismatch=0.0)
        new_params = apply_updates(params, updates)
        realized = exact_kl(logits_fn(params, probe_tokens), logits_fn(new_params, probe_tokens),
                            mask, temperature)
        return new_params, opt_state, updates, realized, logra_metrics(opt_state)

    params, state = tiny["params"], tx.init(tiny["params"])
    for step in range(3):
        new_params, state, updates, realized, metrics = train_step(params, state, tiny["tokens"][step],
                                                                   jnp.float32(16 + step))
        realized = float(realized)
        assert 1.0 < float(metrics["logra/alpha"]) < 3.0, metrics      # not clipped by α_max
        np.testing.assert_allclose(float(metrics["logra/effective_budget"]), budget, rtol=1e-6)
        assert abs(realized - budget) / budget <= 0.05, (step, realized)
        assert abs(realized - float(metrics["logra/predicted_kl"])) / realized <= 0.03
        assert int(metrics["logra/update_index"]) == step + 1
        u = updates["layers"]["q_proj"]["kernel"]
        assert u.factor.dtype == jnp.bfloat16                          # what a receiver gets (§8)
        for a, b in zip(jax.tree.leaves(split_targets(params, SPEC)[1]),
                        jax.tree.leaves(split_targets(new_params, SPEC)[1])):
            np.testing.assert_array_equal(a, b)                         # others frozen
        params = new_params
    assert train_step._cache_size() == 1


# ---------------------------------------------------------------- the reference recipe's details
def test_kl_variant_does_not_clip_and_learning_rate_clips_at_one_by_default(tiny):
    """The reference KL variant never clips (§5: clipping is the GRPO variant's); grad norms of
    this tiny LM are ~1, so a threshold of 1e-3 clips every step and changes RowAdam's v."""
    def final(**kwargs):
        return _run(logra(**SKETCH, **kwargs), tiny, 3)[0]

    kl = dict(variant="kl", kl_control=False)
    default, unclipped, clipped = (final(**kl), final(**kl, max_grad_norm=float("inf")),
                                   final(**kl, max_grad_norm=1e-3))
    for a, b in zip(jax.tree.leaves(default), jax.tree.leaves(unclipped)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(default),
                                                        jax.tree.leaves(clipped)))
    for a, b in zip(jax.tree.leaves(final()), jax.tree.leaves(final(max_grad_norm=1.0))):
        np.testing.assert_array_equal(a, b)


def test_warmup_starts_at_a_tenth_of_the_rate():
    """The reference recipe: linear warmup from 0.1·lr (5e-6 over 50 updates: 5e-7, 2.75e-6, 5e-6)."""
    schedule = warmup_constant(5e-6, 50)
    for count, want in ((0, 5e-7), (25, 2.75e-6), (50, 5e-6), (80, 5e-6)):
        np.testing.assert_allclose(float(schedule(count)), want, rtol=1e-6)
    np.testing.assert_allclose(float(warmup_constant(5e-6, 0)(0)), 5e-6)   # no warmup


def test_a_transform_after_logra_in_a_chain_is_named_not_an_invalid_key():
    """optax.chain(logra(...), optax.scale(0.5)) scales every leaf of the update, A's key too (to
    floats): applying it is one ValueError saying LoGRA goes last, with either merge, not JAX's
    "invalid PRNG key data". The same scale placed before LoGRA applies."""
    params = {"layers": {"mlp": {"up_proj": {"kernel": jnp.ones((2, 16, 32))}}}, "norm": jnp.ones(4)}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)

    def updates_of(tx):
        return tx.update(grads, tx.init(params), params)[0]

    after = updates_of(optax.chain(logra(rank=4), optax.scale(0.5)))
    for merge in (optax.apply_updates, apply_updates):
        with pytest.raises(ValueError, match=r"key \(the seed of its projection A\) is float32, not "
                                             r"uint32: a transformation placed after logra\(\.\.\.\).*"
                                             r"logra\(\.\.\.\) must be the last transformation"):
            merge(params, after)
    before = updates_of(optax.chain(optax.scale(0.5), logra(rank=4)))
    merged = apply_updates(params, before)
    assert not np.array_equal(merged["layers"]["mlp"]["up_proj"]["kernel"],
                              params["layers"]["mlp"]["up_proj"]["kernel"])
