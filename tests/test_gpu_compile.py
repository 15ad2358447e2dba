"""XLA:GPU on this CPU machine (the gpu-plan extra): the memory planner's judge for GPU nodes.

`python -m launch.memory --target <node>` compiles an update and its sampler's ``generate`` for a
GPU node's devices, deviceless, from XLA's target config for that GPU; the header names XLA:GPU,
the plugin's version and the GPU. XLA:GPU plans past a device's memory (it warns and goes on), so
the "does not fit" line is ours, drawn from the plan against the allocator's limit.

CI installs the extra (the test extra includes it), so there a missing plugin fails these tests
instead of skipping them.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from logra_jax.perf import machines
from sketch_lowering import lowered_sketch_backward

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    machines.plugin_version() is None and os.environ.get("CI") != "true",
    reason="the CUDA plugin (the 'gpu-plan' extra) is not installed: no XLA:GPU")
TARGET = "h100-8"


def _memory_cli(*args, tmp_path, env=None):
    out = tmp_path / "memory.json"
    result = subprocess.run([sys.executable, "-m", "launch.memory", "--config", "configs/tiny.py",
                             "--json", str(out), *args], cwd=REPO, capture_output=True, text=True,
                            timeout=900, env=env)
    return result, (json.loads(out.read_text()) if out.exists() else None)


TINY_LAYERS = ("--config.model.tiny.num_layers=768", "--config.model.tiny.hidden_size=2048",
               "--config.model.tiny.intermediate_size=8192")


@pytest.fixture(scope="module")
def tiny_on_gpus(tmp_path_factory):
    """The tiny config's update and sampler compiled for 8 H100s, with AdamW beside it, laid out
    as the large configs are: fp32 master weights, bf16 compute, remat. The model is 768 layers
    deep, 2048 wide with an 8192-wide MLP (39 B parameters, no arrays): LoGRA fits an H100's
    allocator limit (about 31 GiB), AdamW's fp32 weights, moments and gradients (16 bytes a
    parameter, 72 GiB per GPU before activations; about 112 GiB in all) do not (at 512 layers
    AdamW would just fit: 75.0 of 75.2 GiB). Deep rather than wide: the layers are one scanned body,
    compiled once. XLA's dump of each optimized update is kept (``<tmp>/hlo``) for the cast test."""
    folder = tmp_path_factory.mktemp("gpu")
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={folder / 'hlo'} "
               "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*_step_impl.*")
    result, plan = _memory_cli("--target", TARGET, "--compare", "adamw", "--config.model.dtype=bfloat16",
                               "--config.model.param_dtype=float32", "--config.model.remat=True",
                               *TINY_LAYERS, tmp_path=folder, env=env)
    return result, plan, folder / "hlo"


def test_tiny_update_and_sampler_compile_for_a_gpu_node(tiny_on_gpus):
    result, plan, _ = tiny_on_gpus
    assert result.returncode == 0, result.stderr[-3000:]
    header = next(line for line in result.stdout.splitlines() if line.startswith("compiler:"))
    assert header.startswith(f"compiler: XLA:GPU deviceless, jax-cuda12-plugin {machines.plugin_version()} "
                             f"(jax {jax.__version__}")
    assert "without autotuning" in header and "topology 1x1x8" in header
    assert "'NVIDIA H100 80GB HBM3'" in header   # the devices are the node's, not simulated CPUs
    assert plan["target"] == TARGET and plan["mesh"] == {"fsdp": 8, "tensor": 1}
    assert plan["unit"] == "GPU" and plan["compiler"].startswith("XLA:GPU")
    assert plan["memory_per_device"] == machines.machine(TARGET).memory_per_device
    step, rollout = plan["steps"][0], plan["rollouts"][0]
    assert step["arguments"] > 0 and step["temporaries"] > 0 and step["flops"] > 0
    # The rollout phase is the compiled generate: weights among its arguments, a KV cache and
    # logits among its temporaries.
    assert rollout["arguments"] >= rollout["weights"] > 0 and rollout["temporaries"] > 0
    # XLA:GPU's arguments are the weights' shards and the optimizer state the shapes describe.
    assert step["params"] <= step["arguments"] <= 1.05 * (step["params"] + step["opt_state"] + step["batch"])
    assert any(line.startswith("fits: logra needs ") for line in result.stdout.splitlines())
    # No driver-less CUDA log lines and no XLA INFO lines on a machine without a GPU.
    assert "cudart_stub" not in result.stderr and "absl::InitializeLog" not in result.stderr
    # (XLA's are C++ lines, "I1204 ... file.cc:123]"; our own absl INFO lines, such as the sampler's
    # decode choice, name a .py file and are meant for the user.)
    assert not re.search(r"^I\d{4} .*\.cc:\d+\]", result.stderr, re.M)


def test_a_column_over_the_gpus_memory_does_not_fit(tiny_on_gpus):
    """XLA:GPU plans AdamW's update past an H100's memory without refusing it; the verdict is
    drawn from the plan: one "does not fit" line with the need and the allocator's limit, the
    LoGRA column's table intact, and the run's own column (LoGRA, which fits) decides the exit."""
    result, plan, _ = tiny_on_gpus
    limit = machines.machine(TARGET).memory_per_device
    assert plan["refused"] == {}   # XLA:GPU refuses nothing
    adamw = plan["footprint"]["adamw"]["total"]
    assert adamw > limit > plan["footprint"]["logra"]["total"]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f"does not fit: adamw needs {adamw / 2 ** 30:.2f} GiB of "
                           f"{limit / 2 ** 30:.1f} GiB (95% of "), last
    assert "per GPU on h100-8" in last
    # At least AdamW's fp32 weights and two moments: 12 bytes a parameter, 3× LoGRA's fp32 weights.
    logra, dense = plan["steps"]
    assert dense["peak"] > 3 * logra["params"]


def test_the_allocator_fraction_is_the_budget(tmp_path, monkeypatch):
    """The memory a GPU program may use is XLA_PYTHON_CLIENT_MEM_FRACTION of the device's, as on
    the GPU; and XLA:GPU schedules within it: the target config handed to the compiler says
    device_memory_size = limit / 0.8, since XLA takes 80 % of it without a runtime."""
    node = machines.machine("h200-8")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert node.memory_per_device == node.memory // 2
    size = int(re.search(r"device_memory_size: (\d+)", machines.gpu_target_config(node)).group(1))
    assert abs(size * machines.SCHEDULER_SHARE - node.memory_per_device) < 2
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "lots")
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
        node.memory_per_device


def test_the_node_splits_the_weights_over_its_gpus(tiny_on_gpus):
    """XLA:GPU's own account of the 8-GPU plan: each GPU's arguments hold an eighth of the weights
    (FSDP), not the whole model the shapes describe on one device."""
    from configs import tiny
    from logra_jax import model_shapes
    from logra_jax.perf import memory
    from logra_jax.rl import assembly
    from logra_jax.rl.build import build_mesh
    _, plan, _ = tiny_on_gpus
    config = tiny.get_config()
    config.model.tiny.update(num_layers=768, hidden_size=2048, intermediate_size=8192)
    model = assembly.abstract_model(model_shapes.model_config_from(config.model))
    whole = memory.device_bytes(assembly.abstract_params(model, build_mesh({"fsdp": 1, "tensor": 1},
                                                                          jax.devices("cpu")[:1])))
    step = plan["steps"][0]
    assert step["params"] <= whole / 8 * 1.01
    assert whole / 8 <= step["arguments"] < whole / 4


def test_the_xla_cpu_barriers_stay_out_of_gpu_programs(monkeypatch):
    """models/linear.py's optimization barriers serve XLA:CPU's kernels (`cpu_layout`): a sketched
    projection's backward lowered for CPU keeps them, lowered for a GPU it has none (and would,
    were `cpu_layout` a barrier everywhere)."""
    from logra_jax.models import linear

    def barriers(devices):
        return lowered_sketch_backward(devices).as_text().count("optimization_barrier")

    gpus = machines.machine(TARGET).jax_devices()
    assert barriers(jax.devices("cpu")) > 0
    assert barriers(gpus) == 0
    monkeypatch.setattr(linear, "cpu_layout", jax.lax.optimization_barrier)
    assert barriers(gpus) > 0


def test_our_fp32_updates_cast_no_whole_stack_for_a_gpu(tiny_on_gpus):
    """fp32 master weights under bf16 compute, compiled by XLA:GPU (the fixture's LoGRA and AdamW
    updates): each layer's weights are cast as the layer scan reaches them; no bf16 copy of a whole
    [layers, in, out] stack is made before the loops (the copy the TPU compiler's bfloat16
    propagation makes unless told not to: tests/test_tpu_casts.py)."""
    _, _, dumps = tiny_on_gpus
    programs = sorted(dumps.glob("*_step_impl*after_optimizations.txt"))
    assert len(programs) == 2   # LoGRA's update and AdamW's
    for program in programs:
        text = program.read_text()
        assert re.search(r"f32\[768,\d+,\d+\]\S* parameter\(", text)   # the fp32 stacks are there
        # (a bf16 [768, in, out] array made by a convert, of a parameter or of a fusion's operand)
        assert not re.findall(r"bf16\[768,\d+,\d+\]\S* convert\(", text), program.name


def _distinct_updates() -> list[str]:
    """The shipped configs, one per distinct update program once shapes are cut to one layer: the
    optimizer's section, the RL loss and the numerics decide what the update traces (default.py and
    smollm2_compare.py share one, llama3_70b.py and llama3_405b.py another)."""
    import importlib
    seen = {}
    for path in sorted((REPO / "configs").glob("*.py")):
        if path.stem in ("__init__", "base"):
            continue
        c = importlib.import_module(f"configs.{path.stem}").get_config()
        key = (c.optimizer.name, c.optimizer[c.optimizer.name].to_json(), c.rl.algorithm,
               c.rl.beta > 0, c.model.param_dtype, c.model.dtype, c.model.remat)
        seen.setdefault(key, path.stem)
    return sorted(seen.values())


@pytest.mark.parametrize("name", _distinct_updates())
def test_every_shipped_config_lowers_for_a_gpu_node(name, monkeypatch):
    """Every config's update traces and lowers for a GPU node (lowering only, shapes cut to one
    layer and 8 + 8 tokens: seconds). A host callback in the update would not lower here (no GPU
    runtime: "Unknown backend: 'gpu'"); predicted_kl's refusal, the KL variant's (Llama-3.1-70B's
    config), keeps its callback out of planned programs. Configs with weights (SmolLM2's) use
    its shape."""
    import importlib
    from logra_jax import model_shapes
    from logra_jax.perf import memory
    from logra_jax.rl.build import build_mesh
    config = importlib.import_module(f"configs.{name}").get_config()
    if not (model_shapes.is_shape_source(config.model.source) or config.model.source == "tiny"):
        config.model.source = "tiny"   # SmolLM2-135M's shape, without its weights
        config.model.tiny.update(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                                 intermediate_size=1536)
    config.rl.update(max_prompt_length=8, max_completion_length=8, micro_batch_size=8)
    shape = model_shapes.model_config_from
    def one_layer(cfg):
        full = shape(cfg)
        return dataclasses.replace(full, num_layers=1, layer_types=full.layer_types and full.layer_types[:1])
    monkeypatch.setattr(model_shapes, "model_config_from", one_layer)
    mesh = build_mesh({"fsdp": 8, "tensor": 1}, machines.machine(TARGET).jax_devices())
    text = memory.lower_update(config, mesh, micro_steps=1).lowered.as_text()
    assert "callback" not in text


def test_the_unattended_table_judges_a_gpu_cell(tiny_on_gpus, tmp_path):
    """launch.memory_table over GPU nodes: each column's footprint and peak from its JSON, marked
    ✗ over the GPU's allocator limit (XLA:GPU refuses nothing, so nothing reads "refused"), and
    the run it makes for a node: one sequence per GPU per micro-step."""
    from launch import memory_table
    _, plan, _ = tiny_on_gpus
    for column in ("logra:fp32", "adamw"):
        name = memory_table.cell_name("configs/tiny.py", TARGET, column)
        (tmp_path / f"{name}.json").write_text(json.dumps(plan))
    text = memory_table.table(["configs/tiny.py"], [TARGET], ["logra:fp32", "adamw"], tmp_path)
    logra, adamw = (plan["footprint"][label]["total"] / 2 ** 30 for label in ("logra", "adamw"))
    assert f"| tiny | {TARGET} | {logra:.2f} (" in text
    assert re.search(rf"\| {adamw:.2f} \(\d+\.\d+\) ✗ \|", text)
    assert text.endswith(f"fits: {TARGET}: tiny.")
    args = memory_table.command("configs/gemma3_27b.py", "b200-8", "adamw", tmp_path / "c.json")
    assert args[args.index("--target") + 1] == "b200-8" and "--config.rl.micro_batch_size=8" in args


def test_without_the_plugin_a_gpu_target_names_the_extra(monkeypatch):
    monkeypatch.setattr(machines, "plugin_version", lambda: None)
    with pytest.raises(ValueError, match=r"XLA:GPU, which comes with the CUDA plugin: pip install -e '\.\[gpu-plan\]'"):
        machines.machine(TARGET).jax_devices()
