"""A new RL algorithm and a new optimizer are one module and one entry each: registered from
outside the package (this file), without editing it, they train.

The toy algorithm is a plain policy gradient with batch-mean-centred rewards and a key of its own
(``rl.toy_baseline``); the toy optimizer is SGD with its own section (``optimizer.toy_sgd``). Their
records (names, keys: tests/toy_records.py) need no jax; the implementations are below. A step
of configs/tiny.py with both: the loop runs the toy loss (its metric is logged), the toy optimizer
moves every weight, and their keys are checked with the rest of the config; `launch.memory
--optimizer toy_sgd`, run from a wrapper that registers the records, plans them.
"""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from logra_jax import config as config_lib
from logra_jax import metrics
from logra_jax.optim import warmup_constant
from logra_jax.rl import algorithms, optimizers
from logra_jax.rl import trainer as trainer_lib
import toy_records
from process_env import without_device_count
from tiny_config import flat_params, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the toy algorithm's module
@dataclasses.dataclass(frozen=True)
class ToyLoss:
    """−mean over tokens of A·log π_θ: REINFORCE without importance weights."""

    def __call__(self, logp, batch):
        mask = batch.seqs.completion_mask.astype(logp.dtype)
        per_token = -batch.advantages[:, None] * logp
        loss = jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        return loss, {"toy/mean_advantage": jnp.mean(batch.advantages)}


@dataclasses.dataclass(frozen=True)
class ToyAdvantages:
    """r − mean(r) − b: rewards centred on the batch, minus a fixed ``b`` (rl.toy_baseline)."""

    baseline: float

    def __call__(self, rewards, state):
        return (rewards - rewards.mean() - self.baseline).astype(np.float32), state


TOY_PG = algorithms.Algorithm.implementing(
    toy_records.TOY_PG, loss=lambda rl: ToyLoss(),
    advantages=lambda rl: ToyAdvantages(rl.toy_baseline))


# ------------------------------------------------------------------ the toy optimizer's module
def build_toy_sgd(section, *, warmup_steps, replayed_merge):
    del replayed_merge
    learning_rate = warmup_constant(section.learning_rate, warmup_steps)
    return optimizers.Optimizer(optax.sgd(learning_rate), None, train_others=True,
                                kl_control=False, learning_rate=learning_rate)


TOY_SGD = optimizers.OptimizerEntry.implementing(toy_records.TOY_SGD, build=build_toy_sgd)


@pytest.fixture
def toys():
    algorithms.register(TOY_PG)
    optimizers.register(TOY_SGD)
    yield
    algorithms.unregister(TOY_PG.name)
    optimizers.unregister(TOY_SGD.name)


def toy_config(**rl) -> ml_collections.ConfigDict:
    config = tiny_config(dict(max_steps=1, checkpoint=dict(every=1)))
    config.rl.algorithm = "toy_pg"
    config.rl.toy_baseline = 0.0
    config.rl.update(rl)
    config.optimizer.name = "toy_sgd"
    config.optimizer.toy_sgd = ml_collections.ConfigDict(dict(learning_rate=1e-2))
    return config


def test_a_toy_algorithm_and_optimizer_registered_from_outside_train_a_step(toys, tmp_path):
    run = trainer_lib.Run(toy_config(toy_baseline=0.01), tmp_path)
    try:
        run.loop()
    finally:
        run.close()
    rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1]
    # Its rewards are all 0 on a random model: every advantage is −b, the toy loss's metric.
    assert [r["toy/mean_advantage"] for r in rows] == pytest.approx([-0.01])
    assert run.parts.reference_params is None             # its loss reads no reference
    start, end = flat_params(run.parts.initial_params), flat_params(run.params)
    assert all(not np.array_equal(start[p], end[p]) for p in start)   # SGD moved every weight
    assert (tmp_path / "checkpoints" / "1").is_dir()


def test_their_own_keys_are_checked_and_their_names_are_choices(toys):
    config = toy_config(toy_baseline=float("nan"))
    with pytest.raises(ValueError, match="rl.toy_baseline must be a finite number, got nan"):
        config_lib.check_values(config)
    config = toy_config()
    config.optimizer.toy_sgd.learning_rate = -1.0
    with pytest.raises(ValueError, match="optimizer.toy_sgd.learning_rate must be"):
        config_lib.check_values(config)
    config_lib.check_values(toy_config())
    assert config_lib.ignored_options(tiny_config(dict(rl=dict(toy_baseline=0.5))),
                                      toy_config()) == ["rl.toy_baseline"]


def test_unregistered_they_are_unknown_again():
    """After the fixture above, the package is as shipped: the names are refused again, and the
    toys' own keys are no keys of the schema (logra_jax/config/values.py) again."""
    config = tiny_config()
    config.rl.algorithm = "toy_pg"
    with pytest.raises(ValueError, match="rl.algorithm must be one of 'grpo', 'reinforce'"):
        config_lib.check_values(config)
    assert set(config_lib.unknown_keys(toy_config())) == {"rl.toy_baseline", "optimizer.toy_sgd"}
    with pytest.raises(ValueError, match="^unknown config key: "):
        config_lib.check_values(toy_config())
    assert "toy_sgd" not in optimizers.names()
    assert "rl.toy_baseline" not in config_lib.value_rules()
    with pytest.raises(ValueError, match="already registered"):
        algorithms.register(algorithms.get("grpo"))


# A command's wrapper: the records registered before the command starts (and imports jax); the
# command imports the implementations (this file) when it builds the run.
WRAPPER = """import runpy, sys
import toy_records
from logra_jax import config
config.ALGORITHMS.register(toy_records.TOY_PG)
config.OPTIMIZERS.register(toy_records.TOY_SGD)
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_module(sys.argv[0], run_name="__main__")
"""
SCALARS = 128   # bytes of counters an optimizer state may hold (tests/test_memory.py's bound)


def test_registered_from_outside_launch_memory_plans_them(tmp_path):
    """``--optimizer`` takes the registry's names, an outside one among them: the toy SGD's update
    is compiled (its state is a step counter, no moments) under the toy algorithm (no reference)."""
    config, out = tmp_path / "toy.py", tmp_path / "plan.json"
    config.write_text(toy_records.CONFIG_FILE)
    env = without_device_count(PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", WRAPPER, "launch.memory", "--config", str(config),
                           "--optimizer", "toy_sgd", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(out.read_text())
    (step,) = plan["steps"]
    assert step["optimizer"] == "toy_sgd" and step["params"] > 0
    assert step["opt_state"] <= SCALARS
    assert plan["loop"]["reference"] == 0
