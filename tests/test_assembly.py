"""One assembly of a run: what the memory planner plans is what the trainer builds.

The planner (perf/memory.py, launch.memory) lowers the trainer's update on the abstract run of a
config (`Recipe.abstract`: ShapeDtypeStructs with shardings); the trainer builds the same run as
arrays (`Recipe.build`). For every shipped config and every optimizer, at small sizes (each
config's model family with its widths and depth cut down, ranks cut to fit), the two agree leaf
by leaf: the params (LoRA's adapters included), the optimizer state, the reference model (present
in both or in neither, in the same dtype) and the params' layout on the rollout mesh — tree,
shapes, dtypes and shardings.
"""

import pathlib

import jax
import ml_collections
import pytest

from logra_jax import config as config_lib
from logra_jax import model_shapes
from logra_jax.perf import plan as plan_lib
from logra_jax.rl import assembly, optimizers
from logra_jax.tree_paths import leaves_with_paths
from tiny_config import override

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem not in ("__init__", "base"))
# The named model of configs whose source has weights (a name or a GGUF): its published shape.
SHAPE_OF_WEIGHTS = {"smollm2-135m-instruct": "smollm2_135m"}
SMALL = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             intermediate_size=128)


def small_config(name: str, monkeypatch) -> ml_collections.ConfigDict:
    """configs/<name>.py with its model family at SMALL sizes (seeded random weights), ranks of 8,
    and — where the shipped plan puts the sampler on devices of its own without a sync, which a
    run refuses — a full sync."""
    config = config_lib.load_config_file(ROOT / "configs" / f"{name}.py")
    source = config.model.source
    shape = (source.split(":", 1)[1] if model_shapes.is_shape_source(source)
             or model_shapes.is_random_source(source) else SHAPE_OF_WEIGHTS.get(source))
    if shape is not None:
        published = model_shapes.MODEL_SHAPES[shape]
        small = dict(published, **SMALL)
        if "layer_types" in published:   # Gemma 3: a sliding layer beside a global one
            small["layer_types"] = ("sliding", "full")
        monkeypatch.setitem(model_shapes.MODEL_SHAPES, f"{shape}_small", small)
        config.model.source = f"{model_shapes.RANDOM_PREFIX}{shape}_small"
    for section in ("logra", "galore", "lora"):
        config.optimizer[section].rank = 8
    if config.sync.rollout_devices and config.sync.mode == "off":
        config.sync.mode = "full"
    return config


def _layout(tree) -> list[tuple[str, tuple, str, object]]:
    """(path, shape, dtype, sharding) of every leaf of arrays or ShapeDtypeStructs."""
    return [(path, tuple(x.shape), str(x.dtype), x.sharding) for path, x in leaves_with_paths(tree)]


def _same(planned, built, what: str) -> None:
    assert jax.tree.structure(planned) == jax.tree.structure(built), what
    differ = [(p, b) for p, b in zip(_layout(planned), _layout(built)) if p != b]
    assert not differ, f"{what}: planned ≠ built at {differ[:3]}"


@pytest.mark.parametrize("optimizer", optimizers.names())
@pytest.mark.parametrize("name", CONFIGS)
def test_the_planners_state_is_the_trainers(name, optimizer, monkeypatch):
    config = small_config(name, monkeypatch)
    config.optimizer.name = optimizer
    parts = assembly.Recipe.checked(config).build()
    plan = plan_lib.plan(config)   # the planners' own meshes: the trainer's
    assert (plan.mesh, plan.rollout_mesh) == (parts.mesh, parts.rollout_mesh)
    params, opt_state = parts.init_state()
    _same(plan.params, params, "params")
    _same(plan.opt_state, opt_state, "optimizer state")
    assert (plan.reference is None) == (parts.reference_params is None), "reference kept by one only"
    if plan.reference is not None:
        _same(plan.reference, parts.reference_params, "reference")
    assert jax.tree.structure(plan.rollout_shardings) == jax.tree.structure(parts.rollout_shardings)
    assert jax.tree.leaves(plan.rollout_shardings) == jax.tree.leaves(parts.rollout_shardings)


# Every shipped config, and two with a tensor-parallel rollout mesh (none ships one): the sampler
# on 4 devices of its own as fsdp=2 × tensor=2, and colocated (a full sync) as fsdp=4 × tensor=2.
MESH_CASES = [(name, {}) for name in CONFIGS] + [
    ("qwen2_5_7b_gsm8k", {"sync": {"rollout_mesh": {"tensor": 2}}}),
    ("tiny", {"sync": {"mode": "full", "rollout_mesh": {"tensor": 2}}}),
]


@pytest.mark.parametrize("name, overrides", MESH_CASES,
                         ids=[f"{n}{'-tensor-rollout' if o else ''}" for n, o in MESH_CASES])
def test_the_planner_plans_on_the_trainers_meshes(name, overrides):
    """launch.memory's meshes when no flag overrides them (the config's own mesh and rollout
    devices: `plan.planned`, `plan.plan_meshes`) are the ones the trainer builds (`Recipe.meshes`),
    the rollout mesh laid out as ``sync.rollout_mesh``. Meshes only: no model, nothing compiled."""
    config = config_lib.load_config_file(ROOT / "configs" / f"{name}.py")
    override(config, overrides)
    trainer = assembly.Recipe.of(config).meshes()
    planner = plan_lib.plan_meshes(plan_lib.planned(config, dict(config.mesh),
                                                    config.sync.rollout_devices))
    assert [dict(m.shape) for m in planner] == [dict(m.shape) for m in trainer]
    assert planner == trainer   # the same devices in the same places


def test_a_run_without_a_kl_term_plans_no_reference():
    """configs/tiny.py runs REINFORCE, which has no KL term: with rl.beta set anyway the trainer
    keeps no reference model, and the planner — the abstract run and launch.memory's resident
    bytes — counts none; under GRPO the same beta keeps one, in the compute dtype, in both."""
    from configs import tiny
    from logra_jax.perf import memory
    config = tiny.get_config()
    config.rl.beta = 0.1
    parts = assembly.Recipe.checked(config).build()
    plan = assembly.Recipe.of(config).abstract(parts.mesh)
    assert parts.reference_params is None and plan.reference is None
    assert memory.rl_resident_bytes(config, parts.mesh, parts.mesh).reference == 0
    config.rl.algorithm = "grpo"
    plan = assembly.Recipe.of(config).abstract(parts.mesh)
    loop = memory.rl_resident_bytes(config, parts.mesh, parts.mesh)
    assert loop.reference == memory.device_bytes(plan.model_params) > 0   # fp32 compute: fp32
    assert {str(x.dtype) for x in jax.tree.leaves(plan.reference)} == {"float32"}
