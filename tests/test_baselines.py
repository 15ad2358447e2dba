"""The baselines in the loop: Adafactor, GaLore (optim/baselines.py) and LoRA (optim/lora.py)
train, checkpoint and resume bit for bit; our GaLore is optax's with the SVD projector, and its
randomized projector finds the SVD's subspace; GaLore on stacked kernels is GaLore on each layer;
a LoRA run exports with its adapters merged."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import GaLoreState, galore

from logra_jax import metrics
from logra_jax.optim.baselines import galore_baseline, over_layers
from logra_jax.optim.galore import fresh_projector, galore as our_galore
from logra_jax.rl import assembly
from logra_jax.rl import trainer as trainer_lib
from logra_jax.tree_paths import leaves_with_paths
from tiny_config import tiny_config


def _flat(tree):
    return dict(leaves_with_paths(jax.device_get(tree)))


def test_over_layers_is_the_transform_on_each_layer_alone():
    """GaLore (its SVD projector refreshed every 2 steps) on a (3, 16, 8) stack equals GaLore run on
    each (16, 8) layer by itself, update after update."""
    inner = galore(0.1, rank=2, update_proj_gap=2)
    stacked = over_layers(inner)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = jax.random.normal(keys[0], (3, 16, 8))
    state, alone = stacked.init(params), [inner.init(params[i]) for i in range(3)]
    for step in range(3):
        grads = jax.random.normal(keys[step + 1], params.shape)
        updates, state = jax.jit(stacked.update)(grads, state, params)
        for i in range(3):
            mine, alone[i] = inner.update(grads[i], alone[i], params[i])
            np.testing.assert_allclose(updates[i], mine, rtol=1e-5, atol=1e-7, err_msg=f"{step}/{i}")
        assert float(jnp.abs(updates).max()) > 0


def test_our_galore_with_the_svd_projector_is_optaxs():
    """optim/galore.py with projector="svd" against optax.contrib.galore: a tall and a wide matrix
    (left and right projectors) and a vector (not projected), weight decay, the projector refreshed
    at steps 0 and 2 while Adam's moments carry over: the same updates and the same state tree
    (a checkpoint of either restores into the other)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {"tall": jax.random.normal(keys[0], (16, 8)), "wide": jax.random.normal(keys[0], (6, 20)),
              "vector": jnp.ones(5)}
    theirs, ours = (make(0.1, rank=3, update_proj_gap=2, weight_decay=0.01) for make in (galore, our_galore))
    theirs_state, ours_state = theirs.init(params), ours.init(params)
    assert jax.tree.structure(theirs_state) == jax.tree.structure(ours_state)
    for step in range(4):
        grads = jax.tree.map(lambda p: jax.random.normal(keys[step + 1], p.shape), params)
        expected, theirs_state = jax.jit(theirs.update)(grads, theirs_state, params)
        got, ours_state = jax.jit(ours.update)(grads, ours_state, params)
        for path in params:
            np.testing.assert_allclose(got[path], expected[path], rtol=1e-6, atol=1e-8,
                                       err_msg=f"{path} at step {step}")
            assert float(jnp.abs(got[path]).max()) > 0


@pytest.mark.parametrize("shape", [(384, 96), (96, 384)])
def test_the_randomized_projector_finds_the_svds_subspace(shape):
    """A gradient whose singular values decay as 0.9^i (a slow decay: σ_{r+8}/σ_r = 0.43): the
    range finder's r = 16 orthonormal vectors capture G's energy as the SVD's first 16 do, on the
    side GaLore projects (left for a tall G, right for a wide one), for two different draws of Ω."""
    m, n = shape
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    u, _ = jnp.linalg.qr(jax.random.normal(keys[0], (m, min(m, n))))
    v, _ = jnp.linalg.qr(jax.random.normal(keys[1], (n, min(m, n))))
    g = (u * 0.9 ** jnp.arange(min(m, n))) @ v.T
    exact = fresh_projector(g, 16, "svd", keys[2])
    captured = lambda p: float(jnp.sum(jnp.square(p.T @ g if m >= n else g @ p)))
    for key in keys[2:]:
        found = fresh_projector(g, 16, "randomized", key)
        assert found.shape == exact.shape == (max(m, n), 16)
        np.testing.assert_allclose(found.T @ found, np.eye(16), atol=1e-5)
        assert captured(found) >= (1 - 1e-4) * captured(exact), (captured(found), captured(exact))
        # and the subspace itself: the cosines of the principal angles to the SVD's are all near 1
        assert float(jnp.linalg.svd(exact.T @ found, compute_uv=False).min()) > 0.999


def test_galore_projects_only_the_targets():
    """With targets = up_proj, its stack gets a per-layer rank-2 projector and a rank-2 update per
    layer; down_proj, a stack of matrices too but not a target, gets no projector and AdamW's
    full-rank update — the same as optax.adamw's."""
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    params = {"layers": {"mlp": {"up_proj": {"kernel": jnp.ones((2, 16, 8))},
                                 "down_proj": {"kernel": jnp.ones((2, 8, 16))}}},
              "norm": {"scale": jnp.ones((8,))}}
    grads = {"layers": {"mlp": {"up_proj": {"kernel": jax.random.normal(keys[0], (2, 16, 8))},
                                "down_proj": {"kernel": jax.random.normal(keys[1], (2, 8, 16))}}},
             "norm": {"scale": jnp.ones((8,))}}
    tx = galore_baseline(0.1, rank=2, targets=r"up_proj/kernel$", max_grad_norm=0.0)   # unclipped
    state = tx.init(params)
    projectors = [p.shape for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, GaLoreState))
                  if isinstance(s, GaLoreState) for p in jax.tree.leaves(s.projector) if p.size]
    assert projectors == [(2, 16, 2)]   # up_proj's, one per layer; none for down_proj
    updates, _ = tx.update(grads, state, params)
    mlp = updates["layers"]["mlp"]
    rank = lambda m: int(np.linalg.matrix_rank(np.asarray(m), tol=1e-6 * float(jnp.abs(m).max())))
    assert [rank(layer) for layer in mlp["up_proj"]["kernel"]] == [2, 2]
    assert [rank(layer) for layer in mlp["down_proj"]["kernel"]] == [8, 8]
    adamw = optax.adamw(0.1, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    down = params["layers"]["mlp"]["down_proj"]
    expected, _ = adamw.update(grads["layers"]["mlp"]["down_proj"], adamw.init(down), down)
    np.testing.assert_allclose(mlp["down_proj"]["kernel"], expected["kernel"], rtol=1e-5)


# LoRA as every LoRA test here runs it: rank 4 with a rate at which 2 steps visibly move the
# logits; one config, so the tests' trainers compile the same programs (the session's cache).
LORA = {"name": "lora", "lora": {"rank": 4, "learning_rate": 3e-2}}
# GaLore with the projector a TPU run uses (the SVD's is optax's, tested above): its Ω is drawn
# from the step count, so a resumed run must draw the same. Refreshed every step, so the step
# after the resume point draws a new one (the default gap, 200, would not refresh it).
GALORE = {"name": "galore", "galore": {"projector": "randomized", "update_proj_gap": 1}}


def _galore_projectors(opt_state) -> list[np.ndarray]:
    states = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, GaLoreState))
    return [np.asarray(p) for s in states if isinstance(s, GaLoreState)
            for p in jax.tree.leaves(s.projector) if np.size(p)]


def _baseline_config(name):
    optimizer = {"lora": LORA, "galore": GALORE}.get(name, {"name": name})
    return tiny_config({"optimizer": optimizer, "max_steps": 2, "checkpoint": {"every": 1, "keep": 2}})


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """name → (its RunParts, its run trained 2 steps straight, checkpoints 1 and 2), built once per
    module: the LoRA export test reads the resume test's run instead of training its own."""
    runs = {}

    def get(name):
        if name not in runs:
            parts = assembly.build_run(_baseline_config(name))
            straight = trainer_lib.Run(_baseline_config(name), tmp_path_factory.mktemp(name),
                                       parts=parts)
            straight.loop()
            straight.close()
            runs[name] = parts, straight
        return runs[name]
    return get


@pytest.mark.parametrize("name", ["adafactor", "galore", "lora"])
def test_trains_checkpoints_and_resumes_bit_exactly(name, straight_runs, tmp_path):
    """configs/tiny.py with optimizer.name=<name> (GaLore's randomized projector): every parameter
    moves (LoRA: every adapter, and no base weight); stopping after step 1 and resuming ends on the straight run's weights and
    optimizer state, bit for bit."""
    config = _baseline_config(name)
    parts, straight = straight_runs(name)
    initial, end = _flat(parts.initial_params), _flat(straight.params)
    unchanged = [p for p in end if np.array_equal(end[p], initial[p])]
    if name == "lora":
        assert sorted(unchanged) == sorted(p for p in end if not p.startswith("lora/")), unchanged
    else:
        assert not unchanged, unchanged
    assert (straight.workdir / "checkpoints" / "2").is_dir()

    for steps in (1, 2):
        config.max_steps = steps
        resumed = trainer_lib.Run(config, tmp_path / "resumed", parts=parts)
        resumed.loop()
        resumed.close()
        if steps == 1 and name == "galore":
            before = _galore_projectors(jax.device_get(resumed.opt_state))
    if name == "galore":   # the resumed step drew a new projector (and a resume that drew
        after = _galore_projectors(jax.device_get(resumed.opt_state))   # another would differ below)
        assert len(before) == len(after) > 0
        assert all(not np.array_equal(a, b) for a, b in zip(before, after))
    for path, value in _flat(resumed.params).items():
        np.testing.assert_array_equal(value, end[path], err_msg=path)
    state = jax.device_get(resumed.opt_state)
    assert jax.tree.all(jax.tree.map(np.array_equal, jax.device_get(straight.opt_state), state))
    assert [r["step"] for r in metrics.read_jsonl(tmp_path / "resumed" / "metrics.jsonl")] == [1, 2]
    assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(state))   # the state moved too


def test_a_lora_run_exports_with_its_adapters_merged(straight_runs, tmp_path):
    """A tiny LoRA run (2 steps) exported: transformers computes base + adapters' logits. The
    export reads the run through `restore_policy`, which launch.evaluate uses for every run."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from logra_jax.export import export_run, restore_policy

    parts, run = straight_runs("lora")
    out, _ = export_run(run.workdir, tmp_path / "hf")
    step, merged = restore_policy(run.workdir, run.params)
    assert step == 2 and "lora" not in merged        # the base model's layout, adapters folded in
    reference = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = np.random.default_rng(0).integers(0, 1000, (2, 10)).astype(np.int32)
    seqs_logits = jax.jit(lambda p, t: parts.policy.bind(p)(t, probes=parts.policy.probes(p)))
    ours = np.asarray(seqs_logits(run.params, tokens))
    base = np.asarray(seqs_logits(parts.initial_params, tokens))
    assert np.abs(ours - base).max() > 1e-4          # the adapters moved the model
    with torch.no_grad():
        theirs = reference(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["full", "sparse"])
def test_lora_syncs_its_adapters_only(tmp_path, mode):
    """LoRA with 4 training + 4 rollout devices: each message is the adapters (bf16; sparse: their
    changed entries), nothing of the frozen base, and the engine ends on the trainer's bf16
    weights bit for bit — base and adapters."""
    config = tiny_config({"optimizer": LORA, "max_steps": 2,
                          "sync": {"mode": mode, "rollout_devices": 4}})
    run = trainer_lib.Run(config, tmp_path)
    run.loop()
    run.close()
    trained = _flat(run.params)
    adapters = sorted(p for p in trained if p.startswith("lora/"))
    adapter_bytes = sum(trained[p].size * 2 for p in adapters)
    sent = [r["logra/sync_bytes"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")]
    if mode == "full":
        assert sent == [adapter_bytes] * 2
    else:   # int32 index + bf16 value per changed adapter entry, padded to a bucket
        assert len(sent) == 2 and all(0 < b for b in sent)
    engine, initial = _flat(run.engine.params), _flat(run.parts.initial_params)
    assert engine.keys() == trained.keys()
    for path, value in engine.items():
        np.testing.assert_array_equal(value, trained[path].astype(jnp.bfloat16), err_msg=path)
    assert any(not np.array_equal(engine[p], initial[p].astype(jnp.bfloat16))
               for p in engine if p.endswith("/b"))
