"""The TPU compiler on this CPU machine (libtpu): the memory planner's other judge besides XLA:CPU.

`python -m launch.memory --target <slice>` compiles the tiny config's update and its sampler's
``generate`` for a TPU slice's devices; the header names the slice, its chips and the libtpu that
compiled it. A program over a chip's HBM is refused by the compiler itself, and becomes one
"does not fit" line and a non-zero exit.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from logra_jax.perf import machines, oom
from sketch_lowering import lowered_sketch_backward

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(machines.libtpu_version() is None,
                                reason="libtpu (the 'tpu' extra) is not installed: no TPU compiler")
TARGET = "v5e-8"   # the smallest HBM (16 GB per chip): the cheapest program to overfill


def _memory_cli(*args, tmp_path):
    out = tmp_path / "memory.json"
    result = subprocess.run([sys.executable, "-m", "launch.memory", "--config", "configs/tiny.py",
                             "--json", str(out), *args], cwd=REPO, capture_output=True, text=True,
                            timeout=900)
    return result, (json.loads(out.read_text()) if out.exists() else None)


@pytest.fixture(scope="module")
def tiny_on_tpu(tmp_path_factory):
    """The tiny config's update and sampler compiled for 8 v5e chips, with AdamW beside it;
    ``--explain`` reads the TPU compiler's own buffer assignment, as it reads XLA:CPU's. The model
    is 512 layers deep, 1024 wide with a 4096-wide MLP (8.6 B parameters, no arrays): LoGRA with
    bf16 weights fits a 16 GB chip, AdamW's fp32 weights and moments (12 bytes a parameter) do not.
    Deep rather than wide because the layers are one scanned body: the compile takes 39 s here
    where two layers 8192 wide with a 163840-wide MLP (the same count) took 67 s."""
    return _memory_cli("--target", TARGET, "--explain", "3", "--compare", "adamw",
                       "--config.model.param_dtype=bfloat16", "--config.model.tiny.num_layers=512",
                       "--config.model.tiny.hidden_size=1024", "--config.model.tiny.intermediate_size=4096",
                       tmp_path=tmp_path_factory.mktemp("tpu"))


def test_tiny_update_and_sampler_compile_for_a_tpu_slice(tiny_on_tpu):
    result, plan = tiny_on_tpu
    assert result.returncode == 0, result.stderr[-3000:]
    header = next(line for line in result.stdout.splitlines() if line.startswith("compiler:"))
    assert f"libtpu {machines.libtpu_version()}" in header and TARGET in header
    assert "'TPU v5 lite'" in header   # the devices are the slice's, not simulated CPUs
    assert plan["target"] == TARGET and plan["mesh"] == {"fsdp": 8, "tensor": 1}
    assert plan["memory_per_device"] == machines.machine(TARGET).memory_per_device and plan["unit"] == "chip"
    assert plan["compiler"].startswith(f"TPU, libtpu {machines.libtpu_version()}")
    step, rollout = plan["steps"][0], plan["rollouts"][0]
    assert step["arguments"] > 0 and step["temporaries"] > 0
    # The rollout phase is the compiled generate: weights among its arguments, a KV cache and
    # logits among its temporaries, and the footprint reads it.
    assert rollout["arguments"] >= rollout["weights"] > 0 and rollout["temporaries"] > 0
    footprint = plan["footprint"][step["optimizer"]]
    assert footprint["rollout"] >= step["params"] + step["opt_state"] + rollout["temporaries"]
    lines = result.stdout.splitlines()
    assert any(line.startswith("fits: logra needs ") and "HBM per chip on v5e-8" in line for line in lines)
    explain = lines.index(next(line for line in lines if line.startswith("largest buffers live")))
    assert all(float(line.split()[0]) > 0 for line in lines[explain + 1:explain + 4])
    # Each buffer once: the TPU compiler lists a loop's carried values beside the buffers they
    # share, and summing both read 8.21 GiB at this 4.94 GiB peak.
    live = float(lines[explain].split("peak (")[1].split(" GiB")[0]) * 2 ** 30
    assert 0.8 * step["peak"] <= live <= step["peak"] + 0.01 * 2 ** 30
    # The sampler's generate explained too, its buffers adding up to XLA's memory analysis of it
    # (arguments + outputs − aliased + temporaries): at least its temporaries, where the KV cache
    # and its copies sit (XLA's list of the values live at its peak missed a carried copy).
    sampler = next(line for line in lines if line.startswith("largest buffers live at the logra")
                   and "generate" in line)
    total = float(sampler.split("peak (")[1].split(" GiB")[0]) * 2 ** 30
    half_digit = 0.005 * 2 ** 30
    assert rollout["temporaries"] - half_digit <= total <= (
        rollout["arguments"] + rollout["outputs"] + rollout["temporaries"] + half_digit)
    # No libtpu warnings about metadata servers or worker hostnames on a machine without TPUs.
    assert "TPU_WORKER_HOSTNAMES" not in result.stderr


def test_a_compared_column_the_compiler_refuses_keeps_its_figure(tiny_on_tpu):
    """AdamW's update, refused by the compiler, does not cost the LoGRA column its table: its
    "does not fit" line and its need (the compiler's temporaries + the arguments' bytes) stand
    beside LoGRA's peak, and the run's own column decides the exit code (0: LoGRA fits)."""
    result, plan = tiny_on_tpu
    hbm = machines.machine(TARGET).memory_per_device
    refused = plan["refused"]["adamw/fp32"]
    assert refused["program"] == "the adamw/fp32 update" and refused["needed"] > hbm
    # At least AdamW's fp32 weights and two moments: 12 bytes a parameter, where LoGRA's bf16
    # weights are 2.
    (logra,) = plan["steps"]
    assert refused["needed"] > 12 / 2 * logra["params"]
    assert logra["optimizer"] == "logra"
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("does not fit: the adamw/fp32 update needs "), last
    needed = f"{refused['needed'] / 2 ** 30:.2f}"
    assert f"adamw/fp32 refused (needs {needed} GiB), ratio " in result.stdout


def test_two_slices_in_one_process_each_build_their_devices_in_their_own_environment(monkeypatch):
    """libtpu reads TPU_ACCELERATOR_TYPE, and the variables saying there is no TPU host, when it
    builds a topology: a v5p slice then a v6e slice in one process each see their own name (the
    first no longer wins for every later one), each compiles for its own chips, and the process's
    environment is as it was after each."""
    from jax.experimental import topologies
    names = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_SKIP_MDS_QUERY",
             "ALLOW_MULTIPLE_LIBTPU_LOAD")
    seen, build = [], topologies.get_topology_desc

    def recording(*args, **kwargs):
        seen.append({name: os.environ.get(name) for name in names})
        return build(*args, **kwargs)

    monkeypatch.setattr(topologies, "get_topology_desc", recording)
    before = dict(os.environ)
    kinds = {}
    for name in ("v5p-8", "v6e-8"):
        devices = machines.machine(name).jax_devices()
        assert dict(os.environ) == before, name
        x = jax.ShapeDtypeStruct((len(devices) * 8, 128), jnp.float32,
                                 sharding=NamedSharding(Mesh(np.array(devices), ("x",)), P("x")))
        compiled = jax.jit(lambda x: x @ x.T).lower(x).compile()
        kinds[name] = {d.device_kind for d in compiled.input_shardings[0][0].device_set}
    assert [s["TPU_ACCELERATOR_TYPE"] for s in seen] == ["v5p-8", "v6e-8"]
    assert all(s["TPU_WORKER_HOSTNAMES"] == "localhost" and s["TPU_SKIP_MDS_QUERY"]
               and s["ALLOW_MULTIPLE_LIBTPU_LOAD"] for s in seen), seen
    assert kinds == {"v5p-8": {"TPU v5"}, "v6e-8": {"TPU v6 lite"}}


def test_a_program_over_the_chips_hbm_is_refused_by_the_compiler():
    """The compiler's own refusal, parsed: what the program needs and what a v5e chip has."""
    target = machines.machine(TARGET)
    mesh = Mesh(np.array(target.jax_devices()), ("x",))
    x = jax.ShapeDtypeStruct((100_000,), jnp.float32, sharding=NamedSharding(mesh, P()))
    outer = jax.jit(lambda x: x[:, None] * x[None, :])   # 40 GB of output on every chip
    with pytest.raises(oom.DoesNotFit) as refused:
        oom.compile_or_refuse(outer.lower(x))
    assert refused.value.needed >= 100_000 ** 2 * 4 * 0.99
    assert 0.9 * target.memory_per_device < refused.value.available <= target.memory_per_device
    # A program that fits compiles, and says how much it plans per device.
    small = jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=NamedSharding(mesh, P()))
    stats = oom.compile_or_refuse(outer.lower(small)).memory_analysis()
    assert stats.output_size_in_bytes == 1024 * 1024 * 4


def test_a_plan_over_the_budget_is_one_line_and_a_nonzero_exit(tmp_path):
    """A rollout batch whose KV cache cannot fit a v5e chip (the tiny model with 2048-wide heads:
    8192 rows × 512 slots × 32 KiB of keys and values, 16 GiB on each of 8 chips, and the decode's
    own buffers): the compiler refuses the sampler — compiled first, before any update — and the
    planner prints one "does not fit" line with the compiler's figures and exits 1."""
    result, _ = _memory_cli("--target", TARGET, "--config.data.prompts_per_step=4096",
                            "--config.rl.max_prompt_length=448", "--config.rl.max_completion_length=64",
                            "--config.model.tiny.head_dim=2048", tmp_path=tmp_path)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("does not fit: the sampler's generate (8192 rows) needs "), last
    assert f"HBM per device on {TARGET}" in last and "Traceback" not in result.stderr
    assert "--config.rl.rollout_micro_batch=N" in last   # the lever the next test shows
    needed = float(last.split(" needs ")[1].split(" GiB")[0])
    assert needed > machines.machine(TARGET).memory_per_device / 2 ** 30


def test_passes_of_rows_fit_the_rollout_batch_the_compiler_refused():
    """The lever for a rollout batch over the budget: the 8192 rows the test above cannot fit, in
    passes of 256 rows (rl.rollout_micro_batch), hold one pass's KV cache and prefill buffers and
    fit the chip (measured: one pass needs 179 GiB per chip, passes of 1024 rows 22.4, of 256 8.7)."""
    from configs import tiny
    from logra_jax.perf import memory
    from logra_jax.rl.build import build_mesh
    config = tiny.get_config()
    config.data.prompts_per_step = 4096
    config.rl.update(max_prompt_length=448, max_completion_length=64, rollout_micro_batch=256)
    config.model.tiny.head_dim = 2048
    target = machines.machine(TARGET)
    mesh = build_mesh({"fsdp": target.devices, "tensor": 1}, target.jax_devices())
    rollout = memory.rollout_step_memory(config, mesh)
    assert (rollout.rows, rollout.rows_per_pass) == (8192, 256)
    one_pass_cache = 8192 * 512 * 2 * 2048 * 2 * 4 * config.model.tiny.num_layers // 8  # f32 K+V
    assert rollout.peak < target.memory_per_device < one_pass_cache


def test_the_xla_cpu_layout_barriers_stay_out_of_tpu_programs(monkeypatch):
    """models/linear.py's optimization barriers serve XLA:CPU's kernels (`cpu_layout`): a sketched
    projection's backward lowered for CPU keeps them, lowered for TPU it has none, and forcing
    them into the TPU program would cost it bytes at the same FLOPs."""
    from logra_jax.models import linear

    def compiled(devices):
        lowered = lowered_sketch_backward(devices)
        return lowered.as_text().count("optimization_barrier"), lowered.compile()

    tpu_devices = machines.machine(TARGET).jax_devices()
    assert compiled(jax.devices("cpu"))[0] > 0
    barriers, without = compiled(tpu_devices)
    assert barriers == 0
    monkeypatch.setattr(linear, "cpu_layout", jax.lax.optimization_barrier)
    _, forced = compiled(tpu_devices)
    cost = lambda c: (c.cost_analysis() if isinstance(c.cost_analysis(), dict) else c.cost_analysis()[0])
    assert cost(forced)["flops"] == cost(without)["flops"]
    assert cost(forced)["bytes accessed"] > cost(without)["bytes accessed"]


def test_galores_randomized_projector_compiles_for_tpu_without_the_svd():
    """GaLore's projector refresh lowered for a TPU chip: jnp.linalg.svd becomes the TPU's
    size-unrolled QDWH program (minutes per 7B matrix shape to compile), the randomized range
    finder has none of it and compiles (optim/galore.py)."""
    from logra_jax.optim.baselines import over_layers
    from logra_jax.optim.galore import galore

    on = NamedSharding(Mesh(np.array(machines.machine(TARGET).jax_devices()[:1]), ("x",)), P())
    kernels = jax.ShapeDtypeStruct((2, 256, 1024), jnp.float32, sharding=on)

    def lowered(projector):
        tx = over_layers(galore(0.1, rank=16, projector=projector))
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on),
                             jax.eval_shape(tx.init, kernels))
        return jax.jit(tx.update).lower(kernels, state, kernels)

    assert "qdwh" in lowered("svd").as_text()
    randomized = lowered("randomized")
    assert "qdwh" not in randomized.as_text()
    assert randomized.compile().memory_analysis().output_size_in_bytes >= 2 * 256 * 1024 * 4  # updates


def test_the_unattended_table_reads_each_cells_plan(tiny_on_tpu, tmp_path):
    """launch.memory_table: one launch.memory run per (config, slice, column), tabulated from its
    JSON — a fitting column's footprint and peak, a refused one's need, columns not yet run, and
    the largest model whose first column fits each slice."""
    from launch import memory_table
    _, plan = tiny_on_tpu   # both columns' figures: each column's file is read for its own
    for column in ("logra:bf16", "adamw"):
        name = memory_table.cell_name("configs/tiny.py", TARGET, column)
        (tmp_path / f"{name}.json").write_text(json.dumps(plan))
    text = memory_table.table(["configs/tiny.py", "configs/gemma3_27b.py"], [TARGET, "cpu-8"],
                              ["logra:bf16", "adamw"], tmp_path)
    footprint = plan["footprint"]["logra"]["total"] / 2 ** 30
    needed = plan["refused"]["adamw/fp32"]["needed"] / 2 ** 30
    assert f"| tiny | {TARGET} | {footprint:.2f} (" in text
    assert f"| refused: needs {needed:.1f} |" in text
    assert f"| gemma3_27b | {TARGET} | not run | not run |" in text
    assert "| tiny | cpu-8 | not run | not run |" in text
    assert text.endswith(f"fits: {TARGET}: tiny (1 of 2 models run).")   # no HBM judges XLA:CPU's row
    args = memory_table.command("configs/gemma3_27b.py", "v6e-8", "logra:bf16", tmp_path / "c.json")
    assert args[args.index("--rollout_devices") + 1] == "0" and "--compare" not in args
    assert "--config.rl.micro_batch_size=8" in args and "--config.model.param_dtype=bfloat16" in args
    lora = memory_table.command("configs/gemma3_27b.py", "v6e-8", "lora", tmp_path / "c.json")
    assert lora[lora.index("--optimizer") + 1] == "lora"
    assert not any(a.startswith("--config.model.param_dtype") for a in lora)
    # XLA:CPU's plan of the same column, on as many simulated devices as a slice has chips' devices
    cpu = memory_table.command("configs/gemma3_27b.py", "cpu-4", "adamw", tmp_path / "c.json")
    assert cpu[cpu.index("--target") + 1] == "cpu" and cpu[cpu.index("--mesh") + 1] == "fsdp=4,tensor=1"
    assert "--config.rl.micro_batch_size=4" in cpu
    with pytest.raises(ValueError, match="cpu-N"):
        memory_table.command("configs/gemma3_27b.py", "cpu-x", "adamw", tmp_path / "c.json")
    # --set: config keys of every run (GaLore's projector for TPU slices)
    galore = memory_table.command("configs/gemma3_27b.py", "v5p-8", "galore", tmp_path / "c.json",
                                  ["optimizer.galore.projector=randomized"])
    assert galore[-1] == "--config.optimizer.galore.projector=randomized"
    with pytest.raises(ValueError, match="KEY=VALUE"):
        memory_table.command("configs/gemma3_27b.py", "v5p-8", "galore", tmp_path / "c.json", ["oops"])
