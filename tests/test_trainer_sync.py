"""The loop with its rollout engine: every sync mode on its own devices and colocated, and bf16
weights with stochastic-rounding merges, train, resume and sync bit-exactly (tiny config)."""

import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import checkpoint as checkpoint_lib, metrics
from logra_jax.rl import assembly
from logra_jax.rl import trainer as trainer_lib
from tiny_config import flat_params as _flat, make_config


# Colocated runs sync by a local cast whatever the mode and variant, so one colocated case covers
# them (the GRPO variant: no predicted-KL JVP to compile).
# Sparse runs where its patches would cost most: fp32 weights with every parameter trained (nearly
# every bf16 entry changes each step) here, and bf16 weights merged with stochastic rounding in
# test_bf16_weights_train_resume_and_sync_bit_exact below.
@pytest.mark.parametrize("mode, rollout_devices, variant, param_dtype", [
    ("factors", 4, "logra-kl", "float32"), ("sparse", 4, "logra-grpo", "float32"),
    ("factors", 0, "logra-grpo", "float32")])
def test_sync_modes_with_and_without_rollout_devices(mode, rollout_devices, variant, param_dtype,
                                                     tmp_path):
    """4 training + 4 rollout devices: the engine receives the mode's messages and stays bit-exact,
    never sending more than a full sync would. Colocated (0): the same exact weights from a local
    cast, with no master copy or mirror."""
    config = make_config(variant, max_steps=2, model=dict(param_dtype=param_dtype),
                         sync=dict(mode=mode, rollout_devices=rollout_devices, master_copy=True))
    run = trainer_lib.Run(config, tmp_path)
    run.loop()
    run.close()
    parts, engine = run.parts, run.engine
    train_ids = {d.id for d in parts.mesh.devices.flat}
    rollout_ids = {d.id for d in parts.rollout_mesh.devices.flat}
    rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
    if rollout_devices:
        assert train_ids.isdisjoint(rollout_ids)
        assert engine.mode == mode
        for row in rows:
            assert 0 < row["logra/sync_bytes"] <= row["logra/sync_bytes_full"]
            if mode == "factors":
                assert row["logra/sync_bytes"] < row["logra/sync_bytes_full"]
    else:
        assert train_ids == rollout_ids
        assert engine.mode == "full" and engine.master is None
        for row in rows:
            assert row["logra/sync_bytes"] == row["logra/sync_bytes_full"]
    for row in rows:
        assert np.isfinite(row["logra/sync_mismatch"])
    initial = _flat(parts.initial_params)
    engine_params, trainer_params = _flat(engine.params), _flat(run.params)
    moved = 0
    for path in engine_params:
        expected = trainer_params[path].astype(jnp.bfloat16)
        np.testing.assert_array_equal(engine_params[path], expected, err_msg=path)
        moved += int(np.sum(expected != initial[path].astype(jnp.bfloat16)))
    assert moved > 0  # the updates did move the bf16 weights the sampler holds


BF16 = {"logra-grpo": "sparse", "logra-kl": "factors"}


def _bf16_config(name):
    return make_config(name, max_steps=2, model=dict(param_dtype="bfloat16"),
                       optimizer=dict(logra=dict(kl_control=name == "logra-kl")),
                       sync=dict(mode=BF16[name], rollout_devices=4, master_copy=False),
                       checkpoint=dict(every=1, keep=3))


@pytest.fixture(scope="module", params=list(BF16))
def bf16_straight(request, tmp_path_factory):
    """model.param_dtype=bfloat16 with stochastic-rounding merges, 2 steps straight: (name, its
    RunParts, the finished Run)."""
    name = request.param
    parts = assembly.build_run(_bf16_config(name))
    straight = trainer_lib.Run(_bf16_config(name), tmp_path_factory.mktemp(f"straight-{name}"),
                               parts=parts)
    straight.loop()
    straight.close()
    return name, parts, straight


def test_bf16_weights_train_and_sync_bit_exact(bf16_straight):
    """The target kernels are bf16 in memory and in checkpoints and they move; a receiver that
    holds only bf16 weights (factors without a master copy; sparse, which never needs one) ends on
    the trainer's bits, sending no more than a full sync."""
    name, parts, straight = bf16_straight
    end = _flat(straight.params)
    is_target = parts.sketch.is_target
    initial = _flat(parts.initial_params)
    for path, value in end.items():
        if is_target(path):
            assert value.dtype == jnp.bfloat16, path
            assert not np.array_equal(value, initial[path]), f"{path} did not move"
    assert straight.engine.mode == BF16[name]
    for row in metrics.read_jsonl(straight.workdir / "metrics.jsonl"):
        assert 0 < row["logra/sync_bytes"] <= row["logra/sync_bytes_full"]
    engine = _flat(straight.engine.params)
    for path in end:
        np.testing.assert_array_equal(engine[path], end[path].astype(engine[path].dtype), err_msg=path)
    saved = checkpoint_lib.Checkpointer(straight.workdir / "checkpoints")
    restored = _flat(saved.restore_params(2, parts.init_state()[0]))
    saved.close()
    assert {restored[p].dtype for p in restored if is_target(p)} == {jnp.dtype(jnp.bfloat16)}


def test_bf16_weights_resume_bit_exact(bf16_straight, tmp_path):
    """The straight run's workdir as it was after step 1 (its checkpoint 1 and first metrics row),
    resumed: the run ends on the straight run's bits — the stochastic rounding's bits come from
    A's key, and the GRPO variant's AdamW state (on bf16 weights) and the KL variant's controller
    state come back from the checkpoint."""
    name, parts, straight = bf16_straight
    workdir = tmp_path / "resumed"
    shutil.copytree(straight.workdir, workdir)
    shutil.rmtree(workdir / "checkpoints" / "2")
    rows = (workdir / "metrics.jsonl").read_text().splitlines()
    (workdir / "metrics.jsonl").write_text(rows[0] + "\n")
    run = trainer_lib.Run(_bf16_config(name), workdir, parts=parts)
    run.loop()
    run.close()
    assert [r["step"] for r in metrics.read_jsonl(workdir / "metrics.jsonl")] == [1, 2]
    end = _flat(straight.params)
    for path, value in _flat(run.params).items():
        np.testing.assert_array_equal(value, end[path], err_msg=path)
