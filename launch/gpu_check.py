"""`make gpu-check`: everything a CUDA machine can tell us, in one time-bounded run.

    python -m launch.gpu_check [--out runs/gpu_check] [--size full|small] [--budget_s 515] \
        [--parts memory,plan,time,kernels,sampler,rollout,rl] [--memory_budget_gib X] [--plan_target h200-8]

Each part is a fresh process of one of the project's commands, cut at its own time limit and at
what is left of the whole budget (a part that does not finish keeps its log, and its cell says so):

- versions (launch/gpu_check_versions.py): Python, jax, jaxlib, flax, optax, the CUDA plugin, the
  device, its memory and ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (0.95 unless set: JAX's default 0.75
  caps a peak-memory run near 104 of an H200's 139 GiB).
- memory: one real update of the 7B config (Qwen2.5-7B shapes, one device, 8 rows × 2048 tokens in
  2 micro-steps) per optimizer, LoGRA and AdamW each in a fresh process (a device's high-water mark
  cannot be reset): ``peak_bytes_in_use`` beside XLA's prediction on the device; an update that does
  not fit is ``does not fit: needs X GiB``, X being XLA's figure (launch/step_time.py --peak_memory).
- plan: the same program planned without a device — by XLA:GPU for ``--plan_target`` (the target
  of `launch.memory --target`, by default the GPU node of the device's kind in
  logra_jax/perf/machines.py; where this checkout or its CUDA plugin lacks it, the cell says why)
  and by XLA:CPU — on the host's CPU while the other parts run (JAX_PLATFORMS=cpu).
- time: update time LoGRA vs AdamW at 7B proportions (launch.step_time, bf16, widths 2048, 4096).
- kernels: a decode with the GPU's decode kernels (models/decode_kernels.py) against one without,
  fp32 and bf16, batches 1 and 16 (launch.kernel_check): run first on the device, as the sampler
  part decodes with them.
- sampler: tokens/s and achieved/roofline at batch 1 / 16 / 64, stacked and per-layer decode, the
  SmolLM2-135M shape with random weights (launch.sampler_bench).
- rollout: the reference batch's rollout (16 prompts × 8 samples, 512 + 1,536 tokens) on lognormal
  lengths (median 200), the static engine against the slot engine (all rows, and 32 slots): seconds,
  kept tokens/s, row-steps, the same tokens (launch.rollout_bench).
- rl: seconds per RL step of the whole loop, split by phase, Qwen2.5-1.5B's shape with random
  weights (launch.rl_step_time).

It writes ``gpu_check.json``, ``gpu_check.md`` (the tables, with each part's command:
launch/gpu_check_page.py) and one log per part to ``--out`` (``$GPU_CHECK_OUT``). It installs
nothing and never imports jax itself (a process holding the GPU would distort the others'
memory). Without a GPU it stops, unless
``ALLOW_CPU=1``: then ``--size small`` (the default there) runs every part at toy sizes on CPU —
the plumbing, as the test suite does (tests/test_gpu_check.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

from absl import flags

from launch import cli
from launch.gpu_check_page import markdown
from logra_jax.perf import machines

_OUT = flags.DEFINE_string("out", os.environ.get("GPU_CHECK_OUT") or "runs/gpu_check",
                           "Folder for gpu_check.json, gpu_check.md and the parts' logs "
                           "(default $GPU_CHECK_OUT or runs/gpu_check).")
_SIZE = flags.DEFINE_enum("size", None, ["full", "small"], "full: the 7B / 1.5B shapes (a GPU); "
                          "small: toy shapes for the CPU (default on CPU).")
_BUDGET = flags.DEFINE_float("budget_s", 515.0, "Seconds for all parts together.")
_PARTS = flags.DEFINE_list("parts", None, "Parts to run besides versions (default: all).")
_MEMORY_BUDGET = flags.DEFINE_float("memory_budget_gib", None, "For the memory part: GiB one device "
                                    "may hold, instead of the device's own limit (on CPU, which "
                                    "has none, the only way to see `does not fit`).")
_PLAN_TARGET = flags.DEFINE_string("plan_target", None, "launch.memory --target of the deviceless "
                                   "XLA:GPU plan (default: from the GPU's name, h200-8 otherwise).")

PARTS = ("memory", "plan", "time", "kernels", "sampler", "rollout", "rl")   # and versions, first
OPTIMIZERS = ("logra", "adamw")
MEM_FRACTION = "0.95"
RL_WORKDIR = "rl_run"

# The 7B update of the GPU memory table, on one device (configs/qwen2_5_7b_gsm8k.py lays it out for
# 4 training + 4 rollout devices): 4 prompts × 2 completions = 8 rows of 2048 tokens, micro-batches
# of 4 rows.
ONE_DEVICE = ["--config.mesh.fsdp=1", "--config.mesh.tensor=1", "--config.sync.rollout_devices=0",
              "--config.data.prompts_per_step=4", "--config.rl.num_generations=2"]
# The deviceless XLA:GPU plan's target on a GPU the machine table does not know.
DEFAULT_PLAN_TARGET = "h200-8"


@dataclasses.dataclass(frozen=True)
class Size:
    memory_config: str
    time_args: tuple[str, ...]
    kernel_args: tuple[str, ...]
    sampler_args: tuple[str, ...]
    rollout_args: tuple[str, ...]
    rl_args: tuple[str, ...]
    limits: dict   # part → seconds


FULL = Size(
    memory_config="configs/qwen2_5_7b_gsm8k.py",
    time_args=("--widths", "2048,4096", "--layers", "4", "--rows", "8", "--prompt_length", "512",
               "--completion_length", "1536", "--rank", "144", "--vocab", "4096", "--micro_steps",
               "2", "--repeats", "3", "--dtype", "bfloat16"),
    kernel_args=("--shape", "smollm2_135m", "--layers", "4", "--rows", "1,16", "--steps", "8"),
    sampler_args=("--dtype", "bfloat16", "--meshes", "1", "--batches", "1,16,64",
                  "--decode_weights", "stacked,per_layer", "--repeats", "3", "--prompt_length",
                  "64", "--completion_length", "128", "--config.model.source=random:smollm2_135m"),
    # The reference batch's rollout on lognormal lengths (median 200), static vs slot engine.
    rollout_args=("--prompts", "16", "--samples", "8", "--prompt_length", "512",
                  "--completion_length", "1536", "--schedule", "lognormal:200", "--slots", "0,32",
                  "--repeats", "2", "--config.model.source=random:smollm2_135m",
                  "--config.model.dtype=bfloat16"),
    rl_args=("--config", "configs/qwen2_5_1_5b.py", "--steps", "3"),
    limits=dict(versions=60, memory=80, plan=450, time=80, kernels=45, sampler=90, rollout=120,
                rl=130))
SMALL = Size(
    memory_config="configs/tiny.py",
    time_args=("--widths", "128", "--layers", "1", "--rows", "2", "--prompt_length", "8",
               "--completion_length", "8", "--rank", "8", "--vocab", "256", "--repeats", "1"),
    kernel_args=("--shape", "tiny", "--layers", "1", "--rows", "2", "--steps", "2",
                 "--prompt_length", "4", "--dtypes", "float32"),
    # The suite checks launch.sampler_bench's own table on this part's output
    # (tests/test_gpu_check.py): one process of it for both checks.
    sampler_args=("--config", "configs/tiny.py", "--meshes", "1", "--batches", "2",
                  "--decode_weights", "per_layer,stacked", "--repeats", "1", "--prompt_length", "4",
                  "--completion_length", "3"),
    rollout_args=("--config", "configs/tiny.py", "--prompts", "2", "--samples", "2",
                  "--prompt_length", "4", "--completion_length", "6", "--schedule", "lognormal:2",
                  "--slots", "2", "--repeats", "1"),
    rl_args=("--config", "configs/tiny.py", "--steps", "2", "--config.rl.max_completion_length=4"),
    limits=dict(versions=60, memory=120, plan=240, time=120, kernels=120, sampler=120, rollout=120,
                rl=120))


def _python() -> str:
    return sys.executable


@dataclasses.dataclass
class Part:
    """One command of the check: its log files, status and (once run) its outcome."""
    name: str
    argv: list[str]
    limit: float
    env: dict = dataclasses.field(default_factory=dict)
    rc: int | None = None
    seconds: float | None = None
    status: str = "not run"
    proc: subprocess.Popen | None = None
    started: float | None = None

    def command(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        args = self.argv[1:] if self.argv[:1] == [_python()] else self.argv
        return (env + " " if env else "") + "python " + " ".join(args)

    def start(self, out: pathlib.Path, base_env: dict) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.argv, env=dict(base_env, **self.env),
                                     stdout=open(out / f"{self.name}.out", "w"),
                                     stderr=open(out / f"{self.name}.err", "w"))

    def poll(self) -> bool:
        """Whether the part has ended (its outcome then recorded)."""
        if self.rc is None and self.proc is not None and self.proc.poll() is not None:
            self.rc = self.proc.returncode
            self.seconds = time.monotonic() - self.started
            self.status = "ok" if self.rc == 0 else f"failed (exit {self.rc})"
        return self.rc is not None

    def wait(self, deadline: float, beside: tuple["Part", ...] = ()) -> None:
        """Waits until the part ends, or stops it at min(its limit, ``deadline``); the parts
        running ``beside`` it are polled meanwhile (each keeps its own seconds)."""
        stop_at = min(self.started + self.limit, deadline)
        while not self.poll():
            for other in beside:
                other.poll()
            if time.monotonic() >= stop_at:
                self.proc.kill()   # only this part's own process, started above
                self.proc.wait()
                self.seconds = time.monotonic() - self.started
                self.status = (f"cut at its limit of {self.limit:.0f} s" if stop_at < deadline
                               else "cut: the check's whole budget was spent")
                return
            time.sleep(0.2)


def build_parts(size: Size, selected, memory_budget, plan_target, on_gpu: bool) -> list[Part]:
    py = _python()
    parts = []
    if "plan" in selected:   # on the host's CPU, beside the device parts (started first)
        plan = [py, "-m", "launch.memory", "--config", size.memory_config, "--mesh",
                "fsdp=1,tensor=1", *ONE_DEVICE, "--compare", "adamw"]
        parts.append(Part("plan_gpu", plan + ["--target", plan_target, "--json", "plan_gpu.json"],
                          size.limits["plan"], dict(JAX_PLATFORMS="cpu")))
        if on_gpu:   # on a CPU the memory part's own prediction is XLA:CPU's plan already
            parts.append(Part("plan_cpu", plan + ["--json", "plan_cpu.json"], size.limits["plan"],
                              dict(JAX_PLATFORMS="cpu")))
    if "kernels" in selected:   # first on the device: the sampler part decodes with them
        parts.append(Part("kernels", [py, "-m", "launch.kernel_check", *size.kernel_args],
                          size.limits["kernels"]))
    if "memory" in selected:
        for opt in OPTIMIZERS:
            argv = [py, "-m", "launch.step_time", "--config", size.memory_config, "--peak_memory",
                    "--optimizer", opt, *ONE_DEVICE]
            if memory_budget is not None:
                argv += ["--memory_budget_gib", f"{memory_budget:g}"]
            parts.append(Part(f"memory_{opt}", argv, size.limits["memory"]))
    if "time" in selected:
        parts.append(Part("time", [py, "-m", "launch.step_time", *size.time_args, "--json",
                                   "time.json"], size.limits["time"]))
    if "sampler" in selected:
        parts.append(Part("sampler", [py, "-m", "launch.sampler_bench", *size.sampler_args,
                                      "--jsonl", "sampler.jsonl"], size.limits["sampler"]))
    if "rollout" in selected:
        parts.append(Part("rollout", [py, "-m", "launch.rollout_bench", *size.rollout_args,
                                      "--json", "rollout.json"], size.limits["rollout"]))
    if "rl" in selected:
        # The run's own workdir: a part cut short still leaves the steps it logged.
        parts.append(Part("rl", [py, "-m", "launch.rl_step_time", *size.rl_args, "--json",
                                 "rl.json", "--workdir", RL_WORKDIR], size.limits["rl"]))
    return parts


def run_parts(parts: list[Part], out: pathlib.Path, budget: float, base_env: dict) -> None:
    """The plans start at once and run beside the rest (they use the CPU only); every other part
    runs alone on the device, one after another, until the budget is spent."""
    deadline = time.monotonic() + budget
    background = [p for p in parts if p.name.startswith("plan_")]
    for part in background:
        part.start(out, base_env)
    for part in parts:
        if part in background:
            continue
        if time.monotonic() >= deadline:
            part.status = "not run: the check's whole budget was spent"
            continue
        part.start(out, base_env)
        part.wait(deadline, tuple(background))
        print(f"{part.name}: {part.status} ({part.seconds:.0f} s)", flush=True)
    for part in background:
        part.wait(deadline)
        print(f"{part.name}: {part.status} ({part.seconds:.0f} s)", flush=True)


# ---- reading the parts' outputs --------------------------------------------------------------

def _read_json(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _last_json_line(path: pathlib.Path):
    try:
        lines = [line for line in path.read_text().splitlines() if line.startswith("{")]
    except OSError:
        return None
    try:
        return json.loads(lines[-1]) if lines else None
    except ValueError:
        return None


def _json_lines(path: pathlib.Path) -> list:
    """The lines of ``path`` that are JSON objects (a part's other output left out); [] if none."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    except (OSError, ValueError):
        return []


def _read_jsonl(path: pathlib.Path) -> list:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _why(part: Part, out: pathlib.Path) -> str:
    """Why a part gave no figure: its status and the last line of its stderr."""
    try:
        lines = [line.strip() for line in (out / f"{part.name}.err").read_text().splitlines()
                 if line.strip()]
    except OSError:
        lines = []
    last = lines[-1] if lines else "no output"
    return f"{part.status}: {last}" if part.status != "ok" else last


def collect(parts: list[Part], out: pathlib.Path) -> dict:
    by_name = {p.name: p for p in parts}
    result = {"parts": {p.name: dict(command=p.command(), status=p.status, seconds=p.seconds,
                                     limit_s=p.limit) for p in parts}}
    if "versions" in by_name:
        result["versions"] = _last_json_line(out / "versions.out")
    if any(n.startswith("memory_") for n in by_name):
        result["memory"] = {}
        for opt in OPTIMIZERS:
            part = by_name.get(f"memory_{opt}")
            if part is None:
                continue
            found = _last_json_line(out / f"memory_{opt}.out")
            result["memory"][opt] = found if found else {"absent": _why(part, out)}
    for name in ("plan_gpu", "plan_cpu"):
        if name in by_name:
            found = _read_json(out / f"{name}.json") if by_name[name].status == "ok" else None
            if found is None:
                argv = by_name[name].argv
                target = argv[argv.index("--target") + 1] if "--target" in argv else "cpu"
                result[name] = {"target": target, "absent": _why(by_name[name], out)}
            else:
                peaks = {s["optimizer"]: s["peak"] for s in found.get("steps", [])}
                refused = {k: v.get("needed") for k, v in (found.get("refused") or {}).items()}
                result[name] = {"target": found.get("target"), "peak": peaks, "refused": refused}
    if "time" in by_name:
        result["time"] = _read_json(out / "time.json") or {"absent": _why(by_name["time"], out)}
    for name, rows in (("kernels", "kernels.out"), ("sampler", "sampler.jsonl")):
        if name in by_name:   # one JSON line per measurement, kept as far as the part got
            result[name] = {"rows": _json_lines(out / rows), "status": by_name[name].status}
            if by_name[name].status != "ok":
                result[name]["why"] = _why(by_name[name], out)
    if "rollout" in by_name:
        result["rollout"] = (_read_json(out / "rollout.json")
                             or {"absent": _why(by_name["rollout"], out)})
    if "rl" in by_name:
        result["rl"] = _read_json(out / "rl.json") or {"absent": _why(by_name["rl"], out)}
        if "absent" in result["rl"]:   # the per-phase seconds of the steps that did finish
            result["rl"]["logged_steps"] = [
                {k: v for k, v in row.items() if k == "step" or k.startswith("time/")}
                for row in _read_jsonl(out / RL_WORKDIR / "metrics.jsonl")]
        shutil.rmtree(out / RL_WORKDIR / "checkpoints", ignore_errors=True)   # GBs at 1.5B
    return result


def plan_target_for(device_kind: str) -> str:
    """launch.memory's GPU node for the GPU jax names ``device_kind``."""
    node = machines.gpu_node_for(device_kind)
    return node.name if node is not None else DEFAULT_PLAN_TARGET


def main(argv):
    del argv
    from launch import process
    process.setup(None)   # no jax here; the parts are processes that set up their own devices
    selected = PARTS if _PARTS.value is None else tuple(_PARTS.value)
    unknown = sorted(set(selected) - set(PARTS))
    if unknown:
        sys.exit(f"error: --parts {unknown}: choose from {PARTS}")
    base_env = dict(os.environ)
    base_env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    # The versions part runs first, alone: it also says which backend the others will meet.
    versions = Part("versions", [_python(), "-m", "launch.gpu_check_versions"],
                    FULL.limits["versions"])
    versions.start(out, base_env)
    versions.wait(time.monotonic() + versions.limit)
    found = _last_json_line(out / "versions.out")
    if found is None:
        sys.exit(f"error: jax does not start here ({_why(versions, out)}); see {out / 'versions.err'}")
    backend, device_kind = found["backend"], found["device_kind"]
    if backend != "gpu" and os.environ.get("ALLOW_CPU") != "1":
        sys.exit(f"error: jax sees no CUDA device (backend: {backend}); set ALLOW_CPU=1 to run the "
                 f"plumbing on CPU at toy sizes")
    size = {"full": FULL, "small": SMALL}[_SIZE.value or ("full" if backend == "gpu" else "small")]
    if backend != "gpu":
        base_env.setdefault("LOGRA_HOST_DEVICES", "1")   # the one-device programs, as on the GPU
    parts = [versions] + build_parts(size, selected, _MEMORY_BUDGET.value,
                                     _PLAN_TARGET.value or plan_target_for(device_kind),
                                     on_gpu=backend == "gpu")
    for part in parts:   # the parts write their JSON beside their logs
        part.argv = [str(out / a) if a.endswith((".json", ".jsonl")) or a == RL_WORKDIR else a
                     for a in part.argv]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    tic = versions.started
    run_parts(parts[1:], out, _BUDGET.value - versions.seconds, base_env)
    result = collect(parts, out)
    result.update(when=when, size="full" if size is FULL else "small", wall_seconds=time.monotonic() - tic,
                  budget_s=_BUDGET.value, mem_fraction=base_env["XLA_PYTHON_CLIENT_MEM_FRACTION"])
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    page = markdown(result, when)
    (out / "gpu_check.md").write_text(page)
    print(page)
    print(f"written: {out / 'gpu_check.json'}, {out / 'gpu_check.md'} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    cli.run(main)
