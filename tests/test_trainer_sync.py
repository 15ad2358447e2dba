"""The loop with its rollout engine: every sync mode on its own devices and colocated, and bf16
weights with stochastic-rounding merges, train, resume and sync bit-exactly (tiny config)."""

import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import metrics
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
    trainer, engine = run.trainer, run.engine
    train_ids = {d.id for d in trainer.mesh.devices.flat}
    rollout_ids = {d.id for d in trainer.rollout_mesh.devices.flat}
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
    initial = _flat(trainer.initial_params)
    engine_params, trainer_params = _flat(engine.params), _flat(run.params)
    moved = 0
    for path in engine_params:
        expected = trainer_params[path].astype(jnp.bfloat16)
        np.testing.assert_array_equal(engine_params[path], expected, err_msg=path)
        moved += int(np.sum(expected != initial[path].astype(jnp.bfloat16)))
    assert moved > 0  # the updates did move the bf16 weights the sampler holds


@pytest.mark.parametrize("name, mode", [("logra-grpo", "sparse"), ("logra-kl", "factors")])
def test_bf16_weights_train_resume_and_sync_bit_exact(name, mode, tmp_path):
    """model.param_dtype=bfloat16 with stochastic-rounding merges: the target kernels are bf16 in
    memory and in checkpoints and they move; a receiver that holds only bf16 weights (factors
    without a master copy; sparse, which never needs one) ends on the trainer's bits, sending no
    more than a full sync; a resumed run ends on the same bits as a straight one (the rounding bits
    come from A's key)."""
    config = make_config(name, max_steps=2, model=dict(param_dtype="bfloat16"),
                         optimizer=dict(logra=dict(kl_control=name == "logra-kl")),
                         sync=dict(mode=mode, rollout_devices=4, master_copy=False),
                         checkpoint=dict(every=1, keep=3))
    trainer = trainer_lib.Trainer(config)
    straight = trainer_lib.Run(config, tmp_path / "straight", trainer=trainer)
    straight.loop()
    straight.close()
    end = _flat(straight.params)
    is_target = trainer.sketch.is_target
    initial = _flat(trainer.initial_params)
    for path, value in end.items():
        if is_target(path):
            assert value.dtype == jnp.bfloat16, path
            assert not np.array_equal(value, initial[path]), f"{path} did not move"
    assert straight.engine.mode == mode
    for row in metrics.read_jsonl(tmp_path / "straight" / "metrics.jsonl"):
        assert 0 < row["logra/sync_bytes"] <= row["logra/sync_bytes_full"]
    engine = _flat(straight.engine.params)
    for path in end:
        np.testing.assert_array_equal(engine[path], end[path].astype(engine[path].dtype), err_msg=path)
    saved = trainer_lib.checkpoint_lib.Checkpointer(tmp_path / "straight" / "checkpoints")
    restored = _flat(saved.restore_params(2, trainer.init_state()[0]))
    saved.close()
    assert {restored[p].dtype for p in restored if is_target(p)} == {jnp.dtype(jnp.bfloat16)}

    if name != "logra-kl":
        return   # the resume path is the same for both variants; one of them pays for it
    resumed_dir = tmp_path / "resumed"
    for steps in (1, 2):
        config.unlock()
        config.max_steps = steps
        run = trainer_lib.Run(config, resumed_dir, trainer=trainer)
        run.loop()
        run.close()
    for path, value in _flat(run.params).items():
        np.testing.assert_array_equal(value, end[path], err_msg=path)
