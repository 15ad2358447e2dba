"""Config override checking, metrics files and orbax checkpoints (the plumbing under the trainer)."""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from logra_jax import checkpoint, config as config_lib, metrics


def _config():
    c = ml_collections.ConfigDict()
    c.max_steps = 3
    c.optimizer = ml_collections.ConfigDict(dict(name="logra", rank=8))
    return c


def test_known_override_keys_pass():
    config_lib.check_overrides(_config(), ["max_steps", "optimizer.rank"])


@pytest.mark.parametrize("key, message", [
    ("optimizer.rnak", "unknown config key 'optimizer.rnak': optimizer has no 'rnak' (known: name, rank)"),
    ("max_step", "unknown config key 'max_step': the top level has no 'max_step'"),
    ("max_steps.x", "unknown config key 'max_steps.x': max_steps has no 'x'"),
])
def test_unknown_override_key_names_the_key(key, message):
    with pytest.raises(ValueError) as e:
        config_lib.check_overrides(_config(), [key])
    assert str(e.value).startswith(message)


def test_missing_config_file(tmp_path):
    with pytest.raises(config_lib.ConfigFileError, match="nope.py.* does not exist"):
        config_lib.load_config_file(tmp_path / "nope.py")


def test_metrics_jsonl_and_resume_truncation(tmp_path):
    w = metrics.MetricsWriter(tmp_path, total_steps=3, tensorboard=True, progress=False)
    for step in (1, 2, 3):
        w.write(step, {"reward": np.float32(step / 10), "logra/alpha": jnp.asarray(1.5)})
    w.close()
    rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["reward"] == pytest.approx(0.2) and rows[0]["logra/alpha"] == 1.5
    assert list((tmp_path / "tensorboard").iterdir()), "no TensorBoard event file written"
    # A run resumed from the step-1 checkpoint rewrites steps 2 and 3, so they must not repeat.
    w = metrics.MetricsWriter(tmp_path, total_steps=3, start_step=1, tensorboard=False, progress=False)
    w.write(2, {"reward": 0.5})
    w.close()
    assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    with pytest.raises(ValueError, match="not a scalar"):
        metrics.to_python({"x": np.zeros(3)})


def test_checkpoint_roundtrip_keeps_values_and_shardings(tmp_path):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tensor"))
    sharding = NamedSharding(mesh, P("fsdp", "tensor"))
    state = {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4), sharding),
             "count": jnp.int32(7), "key": jax.random.PRNGKey(3)}
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, state, {"step": step, "data": {"epoch": 0, "position": step * 4}})
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored, meta = ckpt.restore(3, abstract)
    assert meta == {"step": 3, "data": {"epoch": 0, "position": 12}}
    for name in state:
        np.testing.assert_array_equal(restored[name], state[name])
    assert restored["w"].sharding == sharding
    # Params alone, whatever optimizer state was saved beside them (here: another structure).
    ckpt.save(4, (state, {"mu": state["w"], "count": state["count"]}), {"step": 4})
    params = ckpt.restore_params(4, abstract)
    np.testing.assert_array_equal(params["w"], state["w"])
    assert params["w"].sharding == sharding
    with pytest.raises(ValueError, match="do not match this model"):
        ckpt.restore_params(4, {"w": abstract["w"]})
    ckpt.close()
    with pytest.raises(ValueError, match="keep"):
        checkpoint.Checkpointer(tmp_path / "x", keep=0)
    json.dumps(meta)


def test_config_defaults_equal_the_librarys():
    """configs/ import nothing from the library, so their copies of its defaults are checked here."""
    from configs import base
    from logra_jax.data import DEFAULT_INSTRUCTION
    from logra_jax.optim import DEFAULT_TARGETS
    assert base.DEFAULT_TARGETS == DEFAULT_TARGETS
    assert base.DEFAULT_INSTRUCTION == DEFAULT_INSTRUCTION
    assert base.get_config().optimizer.logra.targets == DEFAULT_TARGETS


def test_a_key_of_a_subsection_is_suggested():
    from configs import base
    with pytest.raises(ValueError, match=r"did you mean optimizer\.galore\.rank or optimizer\.logra\.rank or "
                                         r"optimizer\.lora\.rank\?"):
        config_lib.check_overrides(base.get_config(), ["optimizer.rank"])
