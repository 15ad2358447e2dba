"""Policy sync trainer → rollout engine (docs/algorithm.md §8) on disjoint 4 + 4 device meshes.

The trainer (PolicyUpdate, the real jitted step) runs on 4 devices (fsdp 4); each rollout engine on
the other 4 (fsdp 2 × tensor 2: a different sharding; the exact factors receiver also on fsdp 4 ×
tensor 1 and fsdp 1 × tensor 4, so three different per-device blockings of the merge). After every
real LoGRA update, each mode's message goes over the wire; the sampler weights must then equal the
trainer's cast to bf16 — bit for bit for full, sparse and factors with the master copy — while
the bf16-only factors receiver's drift is measured and reported.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import tiny as tiny_config
from logra_jax import sharding as sharding_lib
from logra_jax.models import Decoder
from logra_jax.models.config import tiny
from logra_jax.optim import LowRankUpdate, SketchSpec, logra
from logra_jax.rl import build, optimizers, sync, sync_sparse
from logra_jax.rl.policy import Policy, Sequences
from logra_jax.rl.rollout import collect_rollouts
from logra_jax.rl.sampler import Sampler
from logra_jax.rl.sync_bytes import sync_bytes
from logra_jax.rl.algorithms.reinforce import ReinforceLoss
from logra_jax.rl.update import PolicyUpdate, TrainBatch
from logra_jax.tree_paths import leaves_with_paths

PROMPT, STEPS, ROWS = 8, 6, 8
SPEC = SketchSpec(rank=8, seed=3)
# Receivers kept in step by each trainer: name → (mode, master_copy, rollout mesh (fsdp, tensor)).
RECEIVERS = {"full": ("full", True, (2, 2)), "sparse": ("sparse", True, (2, 2)),
             "factors": ("factors", True, (2, 2)), "factors_bf16": ("factors", False, (2, 2)),
             "factors_4x1": ("factors", True, (4, 1)), "factors_1x4": ("factors", True, (1, 4))}
EXACT = ["full", "sparse", "factors", "factors_4x1", "factors_1x4"]
RUNS = ["kl", "tiny_grpo"]


def _host(tree):
    return {p: np.asarray(x) for p, x in leaves_with_paths(jax.device_get(tree))}


def _unflatten(like, flat: dict):
    """A params-shaped tree from {path: array}."""
    return jax.tree.unflatten(jax.tree.structure(like),
                              [flat[p] for p, _ in leaves_with_paths(like)])


def _bf16_host(params):
    return _host(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))


def _meshes():
    train_devices, rollout_devices = sync.split_devices(4)
    return (train_devices, rollout_devices,
            sharding_lib.make_mesh({"fsdp": 4, "tensor": 1}, train_devices),
            sharding_lib.make_mesh({"fsdp": 2, "tensor": 2}, rollout_devices))


def _receiver_shardings(model, rollout_devices):
    """{receiver: its params-shaped shardings on the rollout devices, with its own mesh}."""
    by_shape = {shape: sync.rollout_shardings(model, sharding_lib.make_mesh(
        {"fsdp": shape[0], "tensor": shape[1]}, rollout_devices))
        for shape in {shape for _, _, shape in RECEIVERS.values()}}
    return {r: by_shape[shape] for r, (_, _, shape) in RECEIVERS.items()}


def _replicate_scalars(opt_state, mesh):
    return jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding)
                        else jax.device_put(x, NamedSharding(mesh, P())), opt_state)


def _bf16_gap(run, params, probe) -> float:
    """mean |log π(the trainer's weights cast to bf16) − log π(the trainer's weights)| over the
    probe's completion tokens: what an exact receiver's mismatch is, from the trainer alone.
    Placed as mismatch() places it, so the cached log-prob program is reused."""
    probe = jax.device_put(probe, NamedSharding(run["train_mesh"], P()))
    logp = sync._logprob_fn(run["policy"], run["temperature"])
    fp32 = np.asarray(logp(params, probe), np.float64)
    bf16 = np.asarray(logp(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), probe), np.float64)
    return float(np.abs(bf16 - fp32)[np.asarray(probe.completion_mask)].mean())


def _train_and_sync(run, params, opt_state, next_batch, updates_count):
    """Real updates; after each, every receiver gets its mode's message. Everything is logged."""
    kw = dict(sketch=run["sketch"], train_others=run["train_others"])
    # One sender per receiver: factors and sparse messages are deltas numbered per sender.
    senders = {r: sync.SyncSender(mode, params, **kw) for r, (mode, _, _) in RECEIVERS.items()}
    engines = {r: sync.RolloutEngine(run["policy"], params, run["receiver_shardings"][r], mode=mode,
                                     master_copy=master, temperature=run["temperature"], **kw)
               for r, (mode, master, _) in RECEIVERS.items()}
    log = {"messages": [], "metrics": [], "mismatch": [], "casts": [_bf16_host(params)], "drift": [],
           "u_itemsize": None, "direct_mismatch": []}
    for i in range(updates_count):
        batch = next_batch(i, params, engines["factors"])
        params, opt_state, metrics, compact = run["step"](params, opt_state, batch)
        updates, k = compact.low_rank, int(compact.update_index)  # k: the update's own index
        assert np.isfinite(float(metrics["loss"]))
        log["u_itemsize"] = next(iter(updates.values())).factor.dtype.itemsize
        probe = jax.tree.map(lambda x: x[:2], batch.seqs)
        # The trainer's call for the engine it samples with; the other receivers by hand.
        log["metrics"].append(sync.sync_step(senders["factors"], engines["factors"], params,
                                             updates=updates, update_index=k, probe=probe))
        log["direct_mismatch"].append(_bf16_gap(run, params, probe))
        messages = {r: s.message(params, updates=updates, update_index=k)
                    for r, s in senders.items() if r != "factors"}
        mismatch = {"factors": log["metrics"][-1]["logra/sync_mismatch"]}
        for r, message in messages.items():
            engines[r].receive(message)
            if RECEIVERS[r][2] == (2, 2):  # the other meshes' log-prob programs would only cost time
                mismatch[r] = engines[r].mismatch(params, probe)
        log["messages"].append(messages)
        log["mismatch"].append(mismatch)
        log["casts"].append(_bf16_host(params))
        log["drift"].append(sync.weight_drift(engines["factors_bf16"].params, params,
                                              paths=engines["factors_bf16"].targets))
    run.update(params=params, senders=senders, engines=engines, batch=batch, log=log)
    return run


@pytest.fixture(scope="module")
def kl():
    """The KL variant's update on tiny(): bf16 U, frozen non-targets, steps of relative size
    update_ratio = 6e-5 — far below bf16 resolution (2⁻⁹). Greedy rollouts from the factors engine.

    The predicted-KL controller is left off: it only rescales U before the bf16 rounding, which
    the sync does not see, and its JVP would double the compile time of this test.
    """
    train_devices, rollout_devices, train_mesh, rollout_mesh = _meshes()
    model = Decoder(tiny(), rngs=nnx.Rngs(0))
    # A decisive head (logit gaps well above float noise) so greedy decoding is well conditioned.
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * 30.0
    sharding_lib.shard_model(model, train_mesh)
    policy = Policy(model)
    sampler = Sampler(policy, max_prompt_length=PROMPT, max_completion_length=STEPS, eos_ids=[95],
                      pad_id=0)
    # merge_rounding="nearest": the fp32 trainer is exact either way, and the bf16-only receiver is
    # the negative control that rounds sub-ulp changes away (stochastic rounding for bf16 weights
    # is tested in tests/test_trainer.py and tests/optim/test_optim_rounding.py).
    tx = logra(variant="kl", kl_control=False, rank=SPEC.rank, seed=SPEC.seed,
               merge_rounding="nearest")
    step = PolicyUpdate(policy, tx, ReinforceLoss(), micro_batch_size=ROWS,
                        probe_size=2, sketch=SPEC, train_others=False, return_updates=True)
    params = Policy.params_of(model)
    prompts = jax.random.randint(jax.random.PRNGKey(0), (ROWS, PROMPT), 1, 90, jnp.int32)
    on_train = NamedSharding(train_mesh, P("fsdp"))
    on_rollout = NamedSharding(rollout_mesh, P("fsdp"))

    def next_batch(i, params, engine):
        tokens, mask = jax.device_put((prompts, jnp.ones_like(prompts, bool)), on_rollout)
        out = sampler.generate(engine.params, tokens, mask, jax.random.PRNGKey(i), greedy=True)
        seqs = Sequences.from_sample(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
        seqs, logp, completed = jax.device_put((seqs, out.logprobs, out.finished), on_train)
        adv = jax.device_put(jax.random.normal(jax.random.PRNGKey(100 + i), (ROWS,)), on_train)
        return TrainBatch(seqs=seqs, advantages=adv, rollout_logp=logp,
                          ref_logp=jnp.zeros_like(logp), completed=completed)

    run = dict(name="kl", policy=policy, sampler=sampler, step=step, sketch=SPEC, train_others=False,
               temperature=1.0, params0=_host(params), train_devices=train_devices,
               rollout_devices=rollout_devices, train_mesh=train_mesh, rollout_mesh=rollout_mesh,
               shardings=sync.rollout_shardings(model, rollout_mesh), prompts=prompts,
               receiver_shardings=_receiver_shardings(model, rollout_devices))
    opt_state = _replicate_scalars(jax.jit(tx.init)(params), train_mesh)
    return _train_and_sync(run, params, opt_state, next_batch, updates_count=2)


@pytest.fixture(scope="module")
def tiny_grpo():
    """configs/tiny.py's RL loop (GRPO variant: fp32 U, weight decay, AdamW on the rest) with the
    sampler on 4 devices and the trainer on the other 4: rollouts come from the factors engine."""
    config = tiny_config.get_config()
    config.optimizer.logra.weight_decay = 0.1  # weight_scale ≠ 1 must reach the receiver too
    rl = config.rl
    train_devices, rollout_devices, train_mesh, rollout_mesh = _meshes()
    model, tokenizer = build.build_model(config.model, train_mesh)
    policy = Policy(model)
    params = Policy.params_of(model)
    optimizer = optimizers.build(config.optimizer)
    tx, sketch, train_others = optimizer.tx, optimizer.sketch, optimizer.train_others
    step = build.build_policy_update(config, policy, optimizer=optimizer, return_updates=True)
    sampler = build.build_sampler(rl, policy, tokenizer)
    data = build.build_data(config.data, config.seed)
    on_rollout, on_train = NamedSharding(rollout_mesh, P("fsdp")), NamedSharding(train_mesh, P("fsdp"))

    def next_batch(i, params, engine):
        ro = collect_rollouts(sampler, engine.params, tokenizer, data.next(),
                              build.build_rollout_spec(config), jax.random.PRNGKey(i), on_rollout)
        assert set(ro.rollout_logp.devices()) == set(rollout_devices)
        rewards = build.build_grader(rl)(ro.texts, ro.golds)
        # A random policy earns no reward; random advantages still give a real update.
        adv = np.asarray(jax.random.normal(jax.random.PRNGKey(i), rewards.shape))
        seqs, logp, completed = jax.device_put((ro.seqs, ro.rollout_logp, ro.completed), on_train)
        return TrainBatch(seqs=seqs, advantages=jax.device_put(adv, on_train), rollout_logp=logp,
                          ref_logp=jnp.zeros_like(logp), completed=completed)

    run = dict(name="tiny_grpo", policy=policy, sampler=sampler, step=step, sketch=sketch, train_others=train_others,
               temperature=rl.temperature, params0=_host(params), train_devices=train_devices,
               rollout_devices=rollout_devices, train_mesh=train_mesh, rollout_mesh=rollout_mesh,
               shardings=sync.rollout_shardings(model, rollout_mesh),
               receiver_shardings=_receiver_shardings(model, rollout_devices))
    opt_state = _replicate_scalars(jax.jit(tx.init)(params), train_mesh)
    run = _train_and_sync(run, params, opt_state, next_batch, updates_count=2)
    assert set(jax.tree.leaves(run["params"])[0].devices()) == set(train_devices)
    return run


@pytest.fixture(scope="module", params=RUNS)
def run(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("receiver", EXACT)
def test_exact_modes_give_the_trainers_bf16_weights_bit_for_bit(run, receiver):
    engine = run["engines"][receiver]
    drift = sync.weight_drift(engine.params, run["params"])
    assert drift["num_differing"] == 0, f"{receiver}: {drift}"
    # ... and the syncs did move the sampler: its weights are not the initial ones any more.
    moved = sync.weight_drift(engine.params, run["params0"], paths=engine.trainable)
    assert moved["num_differing"] > 0
    # Placement: bf16 on the rollout devices, with the receiver's own mesh and sharding.
    placement = dict(leaves_with_paths(run["receiver_shardings"][receiver]))
    for path, leaf in leaves_with_paths(engine.params):
        assert leaf.dtype == jnp.bfloat16, path
        assert leaf.sharding.is_equivalent_to(placement[path], leaf.ndim), path
        assert set(leaf.devices()) == set(run["rollout_devices"]), path
    if receiver.startswith("factors"):
        # The master copy is the trainer's fp32 weights bit for bit: the merge's product is
        # order-free, so another per-device blocking cannot change a bit.
        trainer = _host(run["params"])
        for path, w in engine.master.items():
            np.testing.assert_array_equal(np.asarray(jax.device_get(w)), trainer[path], err_msg=path)


def test_bf16_only_factors_receiver_drifts_and_reports_it(run):
    log = run["log"]
    print(f"\n{run['name']}: a factors receiver without the master copy (targets only):")
    for i, (d, m) in enumerate(zip(log["drift"], log["mismatch"])):
        print(f"  update {i + 1}: max|ΔW| {d['max_abs']:.3g}, entries differing "
              f"{d['frac_differing']:.2%}, log-prob mismatch {m['factors_bf16']:.3g} "
              f"(exact receiver: {m['factors']:.3g})")
        assert np.isfinite(d["max_abs"]) and np.isfinite(m["factors_bf16"])
    # It does drift: bf16 arithmetic rounds away changes that the trainer's fp32 weights keep.
    assert log["drift"][-1]["num_differing"] > 0
    # Fewer of its bf16 entries moved than the trainer's bf16 cast did: changes got lost.
    engine, first, last = run["engines"]["factors_bf16"], log["casts"][0], log["casts"][-1]
    mine = _host(engine.params)
    kept = sum(int(np.sum(mine[p].view(np.uint16) != first[p].view(np.uint16))) for p in engine.targets)
    real = sum(int(np.sum(last[p].view(np.uint16) != first[p].view(np.uint16))) for p in engine.targets)
    print(f"  entries the trainer's bf16 cast changed: {real}; the bf16-only receiver changed: {kept}")
    if run["name"] == "kl":  # steps far below bf16 resolution: most of them are rounded away
        assert kept < real


def test_bytes_match_the_analytic_count(run):
    log = run["log"]
    expected = sync_bytes(run["params0"], run["sketch"], train_others=run["train_others"],
                          factor_itemsize=log["u_itemsize"])
    encodings = set()
    for i, messages in enumerate(log["messages"]):
        assert messages["full"].nbytes == expected.full == run["senders"]["full"].full_bytes
        assert messages["factors_bf16"].nbytes == expected.factors
        # Sparse: exactly the entries whose bf16 bits changed between consecutive trainer casts.
        before, after = log["casts"][i], log["casts"][i + 1]
        sparse = messages["sparse"]
        for path in run["senders"]["sparse"].trainable:
            changed = int(np.sum(before[path].view(np.uint16) != after[path].view(np.uint16)))
            assert sparse.num_changed[path] == changed, path
        # Each changed leaf in its cheapest encoding, and never more than a full sync.
        cheapest = {p: sync_sparse.choose_encoding(c, before[p].size, 2)
                    for p, c in sparse.num_changed.items()}
        assert sparse.encodings == {p: name for p, (name, _) in cheapest.items() if name}
        assert sparse.nbytes == sum(nbytes for _, nbytes in cheapest.values())
        assert sparse.nbytes <= messages["full"].nbytes
        encodings.update(sparse.encodings.values())
    # fp32 weights trained by AdamW move nearly every bf16 entry (dense, which a patch of
    # (index, value) pairs would have tripled); the KL variant's sub-ulp steps move few.
    if run["name"] == "tiny_grpo":
        assert "dense" in encodings, encodings
    else:
        assert "indices" in encodings and "dense" not in encodings, encodings
    # Targets' factors: at most r/in of their bf16 weights with bf16 U (KL), twice that with fp32 U.
    bound = expected.max_rank_ratio * log["u_itemsize"] / 2
    assert expected.target_factors <= bound * expected.target_weights
    assert expected.factors < expected.full


@pytest.mark.parametrize("fraction", [0.0, 0.004, 0.05, 0.5, 0.99, 1.0])
def test_sparse_encodings_rebuild_the_leaf_bit_for_bit(fraction):
    """Every encoding, at any change rate, rebuilds the sender's bits on the receiver — the flipped
    sign of a zero and a NaN's payload included — and the one chosen is the cheapest."""
    rng = np.random.default_rng(0)
    old = rng.standard_normal((37, 29)).astype(jnp.bfloat16)
    new = old.copy()
    flip = rng.random(old.shape) < fraction
    new[flip] = rng.standard_normal(int(flip.sum())).astype(jnp.bfloat16)
    old[0, :2], new[0, :2] = (0.0, np.nan), (-0.0, np.float32(np.nan) * -1)
    count = int(np.sum(old.view(np.uint16) != new.view(np.uint16)))
    sizes = sync_sparse.encoding_bytes(count, new.size, 2)
    slots = sync_sparse.capacity(count, new.size)
    sent, held = jnp.asarray(new), jnp.asarray(old)
    patches = {"indices": sync_sparse.apply_patch(held, *sync_sparse.encode(sent, held, capacity=slots)),
               "bitmap": sync_sparse.apply_bitmap(held, *sync_sparse.encode_bitmap(sent, held,
                                                                                  capacity=slots))}
    for name, rebuilt in patches.items():
        np.testing.assert_array_equal(np.asarray(rebuilt).view(np.uint16), new.view(np.uint16), name)
    encoding, nbytes = sync_sparse.choose_encoding(count, new.size, 2)
    assert nbytes == min(sizes.values()) <= new.nbytes
    assert sizes[encoding] == nbytes


def test_sparse_patches_of_a_leaf_sharded_on_both_axes_have_no_leaf_long_prefix_sum():
    """An embedding-shaped leaf sharded over fsdp × tensor: the sender's encoders and the
    receiver's bitmap patch number the changed entries with prefix sums no longer than a row or a
    column. One prefix sum over the flattened leaf (a reduce-window as long as the leaf) is what
    XLA's partitioner turned into a program that ran for over an hour on SmolLM2's 49152 × 576
    embedding; the leaf is rebuilt exactly."""
    import re
    mesh = sharding_lib.make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
    on_leaf, replicated = NamedSharding(mesh, P("fsdp", "tensor")), NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    old = rng.standard_normal((96, 40)).astype(jnp.bfloat16)
    new = np.where(rng.random(old.shape) < 0.5, rng.standard_normal(old.shape), old).astype(jnp.bfloat16)
    count = int(np.sum(old.view(np.uint16) != new.view(np.uint16)))
    held, sent = jax.device_put((jnp.asarray(old), jnp.asarray(new)), on_leaf)
    slots = sync_sparse.capacity(count, new.size)

    def longest_prefix_sum(lowered):
        hlo = lowered.compile().as_text()
        windows = [int(d) for size in re.findall(r"window=\{size=([\dx]+)", hlo) for d in size.split("x")]
        return max(windows)

    for encoder in (sync_sparse.encode, sync_sparse.encode_bitmap):
        assert longest_prefix_sum(encoder.lower(sent, held, capacity=slots)) <= max(old.shape)
    bitmap, values = jax.device_put(sync_sparse.encode_bitmap(sent, held, capacity=slots), replicated)
    patch = jax.jit(sync_sparse.apply_bitmap, out_shardings=on_leaf)
    assert longest_prefix_sum(patch.lower(held, bitmap, values)) <= max(old.shape)
    rebuilt = patch(held, bitmap, values)
    np.testing.assert_array_equal(np.asarray(rebuilt).view(np.uint16), new.view(np.uint16))


def test_sync_step_reports_bytes_and_mismatch(run):
    log = run["log"]
    for row, messages, mismatch in zip(log["metrics"], log["messages"], log["mismatch"]):
        assert row["logra/sync_bytes"] == messages["factors_bf16"].nbytes  # the same content
        assert row["logra/sync_bytes_full"] == messages["full"].nbytes
        assert all(np.isfinite(v) for v in row.values()), row
    # The reported mismatch of each step against the bf16 gap of that step's trainer weights,
    # computed without the engine: the same log-prob program on the rollout devices and on the
    # training ones, measured ≤ 1.6e-7 apart (a float32 ulp of log-probs of a few units).
    reported = [row["logra/sync_mismatch"] for row in log["metrics"]]
    assert all(m > 0 for m in log["direct_mismatch"])
    np.testing.assert_allclose(reported, log["direct_mismatch"], rtol=0, atol=1e-6)


def test_mismatch_is_the_bf16_gap_of_the_log_probs(run):
    probe = jax.tree.map(lambda x: x[:2], run["batch"].seqs)
    direct = _bf16_gap(run, run["params"], probe)
    measured = run["engines"]["factors"].mismatch(run["params"], probe)
    assert direct > 0  # bf16 weights do move the log-probs
    np.testing.assert_allclose(measured, direct, rtol=1e-2)


def test_greedy_generations_of_sampler_and_trainer_agree(kl):
    """The rollout engine generates what the trainer's weights, cast to bf16, generate."""
    run = kl
    sampler, prompts = run["sampler"], run["prompts"]
    mask = jnp.ones_like(prompts, bool)
    on_train = NamedSharding(run["train_mesh"], P("fsdp"))
    on_rollout = NamedSharding(run["rollout_mesh"], P("fsdp"))
    trainer_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), run["params"])
    expected = sampler.generate(trainer_bf16, *jax.device_put((prompts, mask), on_train),
                                jax.random.PRNGKey(0), greedy=True)
    for receiver in ("full", "sparse", "factors"):
        out = sampler.generate(run["engines"][receiver].params,
                               *jax.device_put((prompts, mask), on_rollout),
                               jax.random.PRNGKey(0), greedy=True)
        assert set(out.tokens.devices()) == set(run["rollout_devices"])
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(expected.tokens),
                                      err_msg=receiver)


def test_bad_input_is_one_clear_error(kl):
    run = kl
    with pytest.raises(ValueError, match="sync mode must be one of"):
        sync.SyncSender("dense", run["params"], sketch=SPEC)
    with pytest.raises(ValueError, match="needs the LoGRA optimizer"):
        sync.SyncSender("factors", run["params"], sketch=None)
    with pytest.raises(ValueError, match="rollout_devices=8"):
        sync.split_devices(8)
    sender = run["senders"]["factors"]
    with pytest.raises(ValueError, match="needs this step's target updates"):
        sender.message(run["params"])
    # The last step's U with the keys of its update index k passes; claiming another k is refused,
    # since the receiver would regenerate a different A.
    k = len(run["log"]["messages"]) - 1
    last = run["log"]["messages"][-1]["factors_bf16"].payload
    updates = {p: LowRankUpdate(factor=u, key=SPEC.keys(sender.targets[p], k),
                                weight_scale=last["weight_scale"][p])
               for p, u in last["factors"].items()}
    sender.message(run["params"], updates=updates, update_index=k)
    with pytest.raises(ValueError, match="does not regenerate"):
        sender.message(run["params"], updates=updates, update_index=k + 1)
    with pytest.raises(ValueError, match="sent to a rollout engine in mode 'full'"):
        run["engines"]["full"].receive(run["log"]["messages"][-1]["sparse"])
    # A delta applied twice (or one lost) would silently corrupt the sampler: refused.
    with pytest.raises(ValueError, match="every message must arrive, in order"):
        run["engines"]["sparse"].receive(run["log"]["messages"][-1]["sparse"])


def test_colocated_engine_on_the_trainers_mesh(kl):
    """Colocated: the rollout engine shares the trainer's devices (its own bf16 copy, same mesh).
    Replaying the run's factors messages from the initial weights lands on the trainer's weights,
    even though the params it was built from are deleted (as the trainer's update donates them)."""
    run = kl
    train_devices, rollout_devices = sync.split_devices(0)
    assert train_devices == rollout_devices == jax.devices()
    shardings = jax.tree.map(lambda x: x.sharding, run["params"])
    params0 = jax.device_put(_unflatten(run["params"], run["params0"]), shardings)
    engine = sync.RolloutEngine(run["policy"], params0, shardings, mode="factors", sketch=SPEC,
                                train_others=False)
    for leaf in jax.tree.leaves(params0):
        leaf.delete()
    for messages in run["log"]["messages"]:
        engine.receive(messages["factors_bf16"])
    assert sync.weight_drift(engine.params, run["params"])["num_differing"] == 0
    for leaf in jax.tree.leaves(engine.params):
        assert set(leaf.devices()) == set(run["train_devices"])


def test_a_colocated_run_syncs_by_a_local_cast():
    """Colocated, factors and sparse need no master copy or mirror: the trainer's weights are on
    the same devices, so the engine receives them cast (`placed_mode`); disjoint, they are kept."""
    assert sync.placed_mode("factors", colocated=True) == "full"
    assert sync.placed_mode("sparse", colocated=True) == "full"
    assert sync.placed_mode("full", colocated=True) == "full"
    assert sync.placed_mode("factors", colocated=False) == "factors"
    assert sync.placed_mode("sparse", colocated=False) == "sparse"
    assert sync.placed_mode("off", colocated=True) == "off"
