"""The per-device RL footprint of several models × targets × optimizers, by the targets' compilers, unattended.

    python -m launch.memory_table --workdir /tmp/tpu_table \
        [--configs configs/qwen2_5_7b_gsm8k.py,configs/gemma3_27b.py,configs/llama3_70b.py] \
        [--targets v5p-8,v5p-16,v6e-8,tpu7x-8,a100-80gb-8,h100-8,h200-8,b200-8,cpu-4,cpu-8] \
        [--columns logra:bf16,logra:fp32,lora:bf16,adamw,galore] [--out table.md] [--report_only] \
        [--set optimizer.galore.projector=randomized]

Each column of each (config, target) cell is one ``python -m launch.memory --target T`` run of
that column's optimizer and weights (its update and its sampler's ``generate``), with the same
layout everywhere: the sampler colocated (``--rollout_devices 0``), FSDP over all of the target's
devices (a TPU slice's, a GPU node's 8), one sequence per device per micro-step. One program pair
per process bounds the host memory a run holds: a process keeps every program it compiled, and a
7B column alone needs about 4 GB, at the price of compiling the sampler once per column. A target
``cpu-N`` is XLA:CPU's plan of the same column on N simulated devices (beside the targets of as
many devices: v5p-8 has 4, v5p-16, v6e-8, tpu7x-8 and the GPU nodes have 8): its
update is compiled, its rollout phase is the weights plus the KV cache from shapes, as ``--target
cpu`` prints it, and no device memory judges it. A 7B–70B column takes 2–15 minutes of a 2-core
machine's CPU, so the runs are resumable: each writes ``<workdir>/<config>@<target>@<column>.json`` and a column whose
JSON exists is not run again (stop at any time; run the same command to go on). A column the
TPU compiler refuses keeps its figure ("refused: needs X"); each run's output is kept in a ``.log``
beside it (a run that failed, with no JSON, is run again next time).

The table (markdown, to stdout and ``--out``): per model and target, each column's RL footprint
(the larger of the update and rollout phases) and update peak, GiB per device, marked when it does
not fit the device's memory (a TPU chip's HBM, a GPU's allocator limit); then, per target, the
largest model whose full-parameter RL (the first column) fits it.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

from absl import flags

from launch import cli
from logra_jax.perf.machines import GIB

_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def cell_name(config: str, target: str, column: str) -> str:
    return f"{pathlib.Path(config).stem}@{target}@{column.replace(':', '-')}"


def cpu_devices(target: str) -> int | None:
    """N for an XLA:CPU target ``cpu-N`` (N simulated devices), None for a TPU slice or GPU node."""
    if not target.startswith("cpu-"):
        return None
    try:
        return int(target.removeprefix("cpu-"))
    except ValueError:
        raise ValueError(f"--targets {target!r}: an XLA:CPU target is cpu-N, N devices") from None


def command(config: str, target: str, column: str, json_path: pathlib.Path,
            overrides: list[str] = ()) -> list[str]:
    """The launch.memory run of one column: its optimizer with its weights (``logra:bf16``) or, for
    a dense baseline, the usual fp32 master weights; one sequence per device per micro-step on the
    target's devices (FSDP over all of them), or on ``cpu-N``'s N simulated ones. ``overrides``
    (KEY=VALUE) set config keys of every run, e.g. optimizer.galore.projector=randomized."""
    from logra_jax.perf import machines
    name, _, dtype = column.partition(":")
    n = cpu_devices(target)
    where = (["--target", "cpu", "--mesh", f"fsdp={n},tensor=1"] if n is not None
             else ["--target", target])
    args = [sys.executable, "-m", "launch.memory", "--config", config, *where,
            "--rollout_devices", "0", "--optimizer", name, "--json", str(json_path),
            f"--config.rl.micro_batch_size={n if n is not None else machines.machine(target).devices}"]
    if dtype:
        args.append(f"--config.model.param_dtype={_DTYPES[dtype]}")
    for override in overrides:
        if "=" not in override:
            raise ValueError(f"--set {override!r}: expected KEY=VALUE, e.g. "
                             "optimizer.galore.projector=randomized")
        args.append(f"--config.{override}")
    return args


def run_column(config: str, target: str, column: str, workdir: pathlib.Path,
               overrides: list[str] = ()) -> None:
    name = cell_name(config, target, column)
    json_path = workdir / f"{name}.json"
    if json_path.exists():
        return
    print(f"compiling {name} ...", end=" ", flush=True)
    partial = json_path.with_suffix(".partial.json")
    tic = time.monotonic()
    with open(workdir / f"{name}.log", "w") as out:
        proc = subprocess.Popen(command(config, target, column, partial, overrides), stdout=out, stderr=out)
        _, status, usage = os.wait4(proc.pid, 0)
    # ru_maxrss is in KiB on Linux: the host memory one column needs, for sizing the machine.
    print(f"exit {os.waitstatus_to_exitcode(status)}, {time.monotonic() - tic:.0f} s, "
          f"{usage.ru_maxrss / 2**20:.1f} GiB of host memory at most", flush=True)
    if partial.exists():   # written by launch.memory, whether its column fits or not
        partial.rename(json_path)


def _label_of(column: str, own_dtype: str | None) -> str:
    """launch.memory's label of a column (perf/memory.py: columns): a dense baseline is always
    planned with fp32 master weights (its registry entry's ``master_weights``)."""
    from logra_jax.rl import optimizers
    name, _, dtype = column.partition(":")
    dtype = optimizers.get(name).master_weights or _DTYPES.get(dtype, own_dtype)
    return name if dtype == own_dtype else f"{name}/{'bf16' if dtype == 'bfloat16' else 'fp32'}"


def cell_text(plan: dict, column: str, own_dtype: str) -> str:
    label = _label_of(column, own_dtype)
    if label in plan.get("refused", {}):
        return f"refused: needs {plan['refused'][label]['needed'] / GIB:.1f}"
    footprint = plan.get("footprint", {}).get(label)
    if footprint is None:
        return "–"
    peak = next(s["peak"] for s in plan["steps"] if s["optimizer"] == label)
    # The budget's key: "memory_per_device"; "hbm_per_device" in plans of TPU slices by older versions.
    budget = plan.get("memory_per_device", plan.get("hbm_per_device"))
    fits = budget is None or footprint["total"] <= budget
    return f"{footprint['total'] / GIB:.2f} ({peak / GIB:.2f})" + ("" if fits else " ✗")


def table(configs: list[str], targets: list[str], columns: list[str], workdir: pathlib.Path) -> str:
    lines = ["| model | target | " + " | ".join(columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    largest: dict[str, str] = {}
    judged = [t for t in targets if cpu_devices(t) is None]   # XLA:CPU's rows have no memory to fit
    tried = {t: 0 for t in targets}   # models whose first column has run, per target
    for config in configs:
        for target in targets:
            texts = []
            for column in columns:
                path = workdir / f"{cell_name(config, target, column)}.json"
                plan = json.loads(path.read_text()) if path.exists() else None
                texts.append(cell_text(plan, column, plan["param_dtype"]) if plan else "not run")
            lines.append(f"| {pathlib.Path(config).stem} | {target} | " + " | ".join(texts) + " |")
            tried[target] += texts[0] != "not run"
            if not (texts[0].startswith(("refused", "not run")) or texts[0].endswith("✗")
                    or texts[0] == "–"):
                largest[target] = pathlib.Path(config).stem   # configs run smallest model first
    lines.append("")
    legend = ("GiB per device (a GPU or a TPU chip; half a tpu7x chip, one of its two TensorCores): "
              "RL footprint (update peak); ✗ over the device's memory (a TPU's HBM, a GPU's "
              "allocator limit).")
    if len(judged) < len(targets):
        legend += " cpu-N: XLA:CPU's plan per simulated device, its rollout phase from shapes."
    if judged:
        legend += (f" Largest model whose {columns[0]} RL fits: " + "; ".join(
            f"{t}: {largest.get(t, 'none')}"
            + ("" if tried[t] == len(configs) else f" ({tried[t]} of {len(configs)} models run)")
            for t in judged) + ".")
    lines.append(legend)
    return "\n".join(lines)


def define_flags():
    """The command line's flags, defined only when this file runs as the program (importing it,
    as the tests do, must not add flags to a process that has its own)."""
    flags.DEFINE_list("configs", ["configs/qwen2_5_7b_gsm8k.py", "configs/gemma3_27b.py",
                                   "configs/llama3_70b.py"], "Config files, one row each.")
    flags.DEFINE_list("targets", ["v5p-8", "v5p-16", "v6e-8", "tpu7x-8"],
                      "TPU slices (perf/machines.py's Cloud names), GPU nodes (a100-80gb-8, "
                      "h100-8, h200-8, b200-8), or cpu-N: XLA:CPU on N simulated devices.")
    flags.DEFINE_list("columns", ["logra:bf16", "logra:fp32", "lora:bf16", "adamw", "galore"],
                      "Columns: an optimizer, LoGRA's and LoRA's optionally with :bf16 or :fp32 "
                      "weights (default: the config's); the first decides 'largest model that fits'.")
    flags.DEFINE_list("set", [], "Config overrides for every run, KEY=VALUE (e.g. "
                      "optimizer.galore.projector=randomized). Cells are named without them: "
                      "give such runs a workdir of their own.")
    flags.DEFINE_string("workdir", None, "Where each cell's JSON and log are kept.")
    flags.DEFINE_string("out", None, "Also write the markdown table here.")
    flags.DEFINE_bool("report_only", False, "Run nothing: tabulate the cells done.")


def main(argv):
    del argv
    from launch import process
    process.setup(None)   # each cell is a launch.memory process that sets its own device count
    f = flags.FLAGS
    workdir = pathlib.Path(f.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if not f.report_only:
        for config in f.configs:
            for target in f.targets:
                for column in f.columns:
                    run_column(config, target, column, workdir, f.set)
    text = table(f.configs, f.targets, f.columns, workdir)
    print(text)
    if f.out:
        pathlib.Path(f.out).write_text(text + "\n")


if __name__ == "__main__":
    define_flags()
    cli.run(main, required=("workdir",))
