"""The memory report: one real compile of the tiny config through the CLI, checked against shapes.

XLA's numbers (arguments, aliased outputs, temporaries) must agree with the bytes computed from
the parameters' shapes and shardings; AdamW's state must be two fp32 copies of the params;
LoGRA's state must be the per-row moments plus the non-targets' Adam moments; shapes of the
planning configs must match the published model sizes.
"""

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import tiny
from logra_jax import model_shapes
from logra_jax.config.files import load_config_file
from logra_jax.perf import memory
from logra_jax.tree_paths import leaves_with_paths
from logra_jax.rl import assembly, optimizers
from logra_jax.rl.build import build_mesh
from logra_jax.sharding import opt_state_shardings, sketch_shardings
from process_env import without_device_count

REPO = Path(__file__).resolve().parents[1]
MESH = {"fsdp": 4, "tensor": 2}
SCALARS = 128  # bytes of counters and scalar metrics an optimizer state may add


def shard_bytes(shape, dtype, spec, mesh_sizes) -> int:
    """Bytes of one device's shard, written out independently of jax's shard_shape."""
    n = math.prod(shape) * jnp.dtype(dtype).itemsize
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            n //= mesh_sizes[axis]
    return n


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The CLI on configs/tiny.py, LoGRA vs AdamW: (stdout, the --json numbers)."""
    out = tmp_path_factory.mktemp("memory") / "tiny.json"
    env = without_device_count(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "launch.memory", "--config", "configs/tiny.py", "--mesh",
         "fsdp=4,tensor=2", "--hosts", "2", "--compare", "adamw", "--micro_steps", "2", "--explain", "8",
         "--json", str(out), "--config.rl.algorithm=grpo", "--config.rl.beta=0.04"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.fixture(scope="module")
def shapes():
    """Abstract params of the tiny config on the same mesh, and the two optimizers."""
    config = tiny.get_config()
    mesh = build_mesh(MESH, jax.devices(), spare_devices=True)
    model = assembly.abstract_model(model_shapes.model_config_from(config.model))
    params = assembly.abstract_params(model, mesh)
    return config, model, params


def steps_by_name(numbers):
    return {s["optimizer"]: s for s in numbers["steps"]}


def test_last_line_is_the_ratio_of_the_peaks(report):
    stdout, numbers = report
    steps = steps_by_name(numbers)
    last = stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"peak per device: logra (\S+) GiB, adamw (\S+) GiB, ratio (\S+)", last)
    assert match, last
    assert float(match[3]) == pytest.approx(steps["logra"]["peak"] / steps["adamw"]["peak"], abs=1e-3)
    for row in ("params (master weights)", "optimizer state", "gradients/sketches", "temporaries (XLA)",
                "update peak (XLA)", "RL footprint (max)"):
        assert row in stdout
    assert "largest buffers live at the logra peak" in stdout
    # The cost lines: LoGRA's update skips the targets' dense weight gradients, so fewer FLOPs.
    assert 0 < steps["logra"]["flops"] < steps["adamw"]["flops"]
    assert f"cost per device: logra {steps['logra']['flops']:.3e} matmul FLOPs per update" in stdout
    assert 0 < steps["logra"]["bytes_accessed"]


def test_xla_arguments_and_donation_agree_with_shapes(report):
    for step in report[1]["steps"]:
        inputs = step["params"] + step["opt_state"] + step["batch"]
        # XLA drops arguments the step never reads (e.g. unused batch fields), nothing else.
        assert inputs - step["batch"] - SCALARS <= step["arguments"] <= inputs, step
        # Donation: params and optimizer state are rewritten in place.
        assert step["aliased"] >= step["params"] + step["opt_state"] - SCALARS, step
        assert step["peak"] == (step["arguments"] + step["outputs"] - step["aliased"]
                                + step["temporaries"])
        assert step["temporaries"] >= step["gradients"]
        assert step["micro_steps"] == 2 and step["devices"] == 8


def test_params_bytes_from_specs(report, shapes):
    _, _, params = shapes
    expected = sum(shard_bytes(x.shape, x.dtype, x.sharding.spec, MESH) for x in jax.tree.leaves(params))
    for step in report[1]["steps"]:
        assert step["params"] == expected


def test_adamw_state_is_two_fp32_copies_of_the_params(report):
    adamw = steps_by_name(report[1])["adamw"]
    assert 0 <= adamw["opt_state"] - 2 * adamw["params"] < SCALARS
    assert adamw["gradients"] == adamw["params"]


def test_logra_state_is_row_moments_plus_adam_of_the_others(report, shapes):
    config, _, params = shapes
    sketch = optimizers.build(config.optimizer).sketch
    moments = others = sketches = 0
    layouts = sketch_shardings(params, sketch)
    for path, x in leaves_with_paths(params):
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        if sketch.is_target(path):
            *stack, _, out = x.shape
            moments += shard_bytes((*stack, out), jnp.float32, spec[:-2] + spec[-1:], MESH)
            rank = min(sketch.rank, x.shape[-2])
            sketches += shard_bytes((*stack, out, rank), jnp.float32, layouts[path].spec, MESH)
        else:
            others += shard_bytes(x.shape, x.dtype, spec, MESH)
    steps = steps_by_name(report[1])
    logra, adamw = steps["logra"], steps["adamw"]
    assert 0 <= logra["opt_state"] - (moments + 2 * others) < SCALARS
    assert logra["gradients"] == sketches + others
    assert logra["opt_state"] < adamw["opt_state"]
    assert logra["gradients"] < adamw["gradients"]


def test_loop_bytes(report, shapes):
    config, model, params = shapes
    loop = report[1]["loop"]
    bf16 = sum(shard_bytes(x.shape, jnp.bfloat16, x.sharding.spec, MESH) for x in jax.tree.leaves(params))
    fp32 = sum(shard_bytes(x.shape, jnp.float32, x.sharding.spec, MESH) for x in jax.tree.leaves(params))
    # GRPO with beta = 0.04 on the command line: a reference is kept, in the compute dtype (fp32).
    assert loop["reference"] == fp32 and loop["reference_dtype"] == "float32"
    assert loop["sampler_weights"] == bf16 and loop["colocated"]
    c, rl = model.config, config.rl
    rows = config.data.prompts_per_step * rl.num_generations
    tokens = rows * (rl.max_prompt_length + rl.max_completion_length)
    assert loop["kv_cache"] == (2 * c.num_layers * tokens * c.num_kv_heads * c.head_dim * 4) // MESH["fsdp"]
    footprint = report[1]["footprint"]["logra"]
    step = steps_by_name(report[1])["logra"]
    assert footprint["update"] == step["peak"] + loop["reference"] + loop["sampler_weights"]
    assert footprint["total"] == max(footprint["update"], footprint["rollout"])


def test_peak_breakdown_lists_live_params(report):
    stdout = report[0]
    section = stdout.split("largest buffers live at the logra peak")[1].split("\n\n")[0]
    sizes = [float(line.split()[0]) for line in section.strip().splitlines()[1:]]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) == 8
    assert "params/embed_tokens/embedding" in section   # live parameters are named by their path


def test_opt_state_and_sketch_shardings(shapes):
    config, _, params = shapes
    for name in ("adamw", "logra"):
        config.optimizer.name = name
        tx, sketch, *_ = optimizers.build(config.optimizer)
        layout = dict(leaves_with_paths(opt_state_shardings(tx, params)))
        kernel = params["layers"]["self_attn"]["q_proj"]["kernel"]        # (L, embed, heads)
        assert kernel.sharding.spec == P(None, "fsdp", "tensor")
        if name == "adamw":
            # skip_nonfinite_gradients(chain(clip, adamw)): inner_state / adamw / its ScaleByAdamState
            assert layout["inner_state/1/0/mu/layers/self_attn/q_proj/kernel"] == kernel.sharding
        else:
            v = [s for path, s in layout.items() if path.endswith("v/layers/self_attn/q_proj/kernel")]
            assert v == [NamedSharding(kernel.sharding.mesh, P(None, "tensor"))]
            sketch_spec = sketch_shardings(params, sketch)["layers/self_attn/q_proj/kernel"].spec
            assert sketch_spec == P(None, ("tensor", "fsdp"), None)   # out takes in's fsdp too
    config.optimizer.name = "logra"


@pytest.mark.parametrize("name, published", [
    ("qwen2_5_1_5b", 1.54e9),   # Hugging Face model cards: "Number of Parameters: 1.54B"
    ("qwen2_5_7b", 7.61e9),     # "7.61B"
    ("gemma3_27b", 27.0e9),     # 27B (the vision tower's 0.4B of gemma-3-27b-it excluded)
    ("llama3_1_70b", 70.55e9),  # 70,553,706,496 in its safetensors index
    ("llama3_1_405b", 405e9),   # "405B"
])
def test_shapes_match_published_sizes(name, published):
    model = assembly.abstract_model(model_shapes.shape_config(name))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == pytest.approx(published, rel=0.005)


def test_bad_input_is_one_clear_error(shapes):
    config = tiny.get_config()
    with pytest.raises(ValueError, match="unknown model shape 'llama_9000'"):
        model_shapes.shape_config("llama_9000")
    config.model.source = "smollm2-135m-instruct"
    with pytest.raises(ValueError, match="has weights, not a shape"):
        model_shapes.model_config_from(config.model)
    with pytest.raises(ValueError, match=r"needs 16 devices, only 8"):
        build_mesh({"fsdp": 16, "tensor": 1}, jax.devices(), spare_devices=True)
    config = tiny.get_config()
    mesh = build_mesh({"fsdp": 2, "tensor": 1}, jax.devices(), spare_devices=True)
    with pytest.raises(ValueError, match="micro_steps must be positive"):
        memory.update_step_memory(config, mesh, micro_steps=0)


def test_cli_rejects_a_malformed_mesh():
    env = without_device_count(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "launch.memory", "--config", "configs/tiny.py",
                           "--mesh", "fsdp=four"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "error: --mesh 'fsdp=four'" in proc.stderr


def test_a_mesh_over_several_hosts_is_planned_per_device_and_hosts_must_split_it(report):
    stdout, numbers = report
    assert "training mesh {'fsdp': 4, 'tensor': 2} = 2 hosts × 4 devices" in stdout
    assert numbers["hosts"] == 2
    env = without_device_count(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "launch.memory", "--config", "configs/tiny.py",
                           "--mesh", "fsdp=8,tensor=1", "--hosts", "3"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: --hosts 3: the training mesh's 8 devices must split evenly")


def test_columns_per_weight_dtype_and_a_sampler_sharing_bf16_weights():
    """--compare columns: the config's own first; AdamW always the fp32-master baseline; a
    colocated sampler without sync holds no copy of bf16 weights (it reads them) but a bf16 cast of
    fp32 ones."""
    config = tiny.get_config()
    config.model.param_dtype = "bfloat16"
    assert memory.columns(config, ["adamw", "logra:fp32", "logra:bf16"]) == [
        ("logra", "logra", "bfloat16"), ("adamw/fp32", "adamw", "float32"),
        ("logra/fp32", "logra", "float32")]
    with pytest.raises(ValueError, match="expected one of logra, adamw, adafactor, galore, lora"):
        memory.columns(config, ["sgd"])
    assert memory.columns(config, ["adafactor", "galore"])[1:] == [
        ("adafactor/fp32", "adafactor", "float32"), ("galore/fp32", "galore", "float32")]
    mesh = build_mesh({"fsdp": 8, "tensor": 1}, jax.devices(), spare_devices=True)
    assert memory.rl_resident_bytes(config, mesh, mesh).sampler_weights == 0
    config.model.param_dtype = "float32"
    assert memory.rl_resident_bytes(config, mesh, mesh).sampler_weights > 0
    config.model.param_dtype = "bfloat16"
    config.sync.mode = "full"                       # an engine of its own: its own copy
    assert memory.rl_resident_bytes(config, mesh, mesh).sampler_weights > 0


def test_the_slot_engine_plans_each_groups_prompt_once():
    """The reference batch (16 prompts × 8 samples, 512 + 1,536 tokens, Qwen2.5-1.5B's shape) on
    one device: the slot engine's KV cache holds each group's prompt once and each row's
    completion, (P + G·C) / (G·(P + C)) of the static pass's; rl.rollout_slots=32 (a quarter of
    the rows, 8 prompt slots) holds a quarter of the completions and as many prompts."""
    config = load_config_file(REPO / "configs" / "qwen2_5_1_5b.py")
    config.data.prompts_per_step, config.rl.num_generations = 16, 8
    config.rl.max_prompt_length, config.rl.max_completion_length = 512, 1536
    config.sync.rollout_devices = 0
    mesh = build_mesh({"fsdp": 1, "tensor": 1}, jax.devices()[:1])
    static = memory.rl_resident_bytes(config, mesh, mesh).kv_cache
    config.rl.rollout_engine = "slots"
    slots = memory.rl_resident_bytes(config, mesh, mesh).kv_cache
    prompt, completion, group = 512, 1536, 8
    assert slots / static == pytest.approx(
        (prompt + group * completion) / (group * (prompt + completion)), rel=1e-12)
    config.rl.rollout_slots = 32
    quarter = memory.rl_resident_bytes(config, mesh, mesh).kv_cache
    assert quarter / static == pytest.approx((8 * prompt + 32 * completion)
                                             / (128 * (prompt + completion)), rel=1e-12)


def test_a_pipelined_run_plans_its_queued_rollouts_in_both_phases():
    """rl.max_lag = η holds η rollouts between steps (rl/pipeline.py): per device, η × each
    rollout's arrays (tokens, segment mask, positions [rows, P + C]; completion mask and
    behaviour log-probs [rows, C]; completed flags and token steps [rows]) over the batch's
    devices, in the update phase and the rollout phase alike."""
    config = tiny.get_config()
    mesh = build_mesh({"fsdp": 8, "tensor": 1}, jax.devices(), spare_devices=True)
    assert memory.rl_resident_bytes(config, mesh, mesh).queued_rollouts == 0
    config.rl.max_lag = 2
    loop = memory.rl_resident_bytes(config, mesh, mesh)
    rl = config.rl
    rows = config.data.prompts_per_step * rl.num_generations
    window, completion = rl.max_prompt_length + rl.max_completion_length, rl.max_completion_length
    per_row = window * (4 + 1 + 4) + completion * (1 + 4) + 1 + 4
    assert rows % 8 == 0 and loop.queued_rollouts == 2 * rows // 8 * per_row
    step = memory.StepMemory(optimizer="logra", devices=8, micro_steps=1, params=1, opt_state=2,
                             batch=0, gradients=0, arguments=3, outputs=3, aliased=3,
                             temporaries=7, code=0)
    plain = memory.rl_footprint(step, dataclasses.replace(loop, queued_rollouts=0))
    queued = memory.rl_footprint(step, loop)
    assert queued["update"] - plain["update"] == loop.queued_rollouts
    assert queued["rollout"] - plain["rollout"] == loop.queued_rollouts
