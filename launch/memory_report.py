"""What `python -m launch.memory` prints: the per-device table of a plan and its verdict lines.

The numbers come from logra_jax/perf/memory.py (compiled plans of the trainer's update and
sampler); this module only lays them out: GiB per training device, one column per optimizer, the
cost lines, and whether each column fits a target's devices.
"""

from __future__ import annotations

import jax

from logra_jax.perf import memory
from logra_jax.perf.machines import GIB, gib_text

_SHORT = {"bfloat16": "bf16", "float32": "fp32"}


def gib(n: int) -> str:
    """GiB with two decimals; three significant digits below 0.01 GiB (tiny test models)."""
    value = n / GIB
    return f"{value:.2f}" if value >= 0.00995 or value == 0 else f"{value:.3g}"


def format_table(steps: list[memory.StepMemory],
                 loops: list[memory.LoopMemory] | memory.LoopMemory | None = None,
                 rollouts: list[memory.RolloutMemory] | None = None, unit: str = "device") -> str:
    """One column per measured update (its ``optimizer`` label), GiB per training device; with
    ``loops`` (one per column, or one for all) the RL loop's resident memory and footprint; with
    ``rollouts`` (one per column) the sampler's compiled ``generate`` as well."""
    names = [s.optimizer for s in steps]
    width = max(10, *(len(n) for n in names))
    rows: list[tuple[str, list[str]]] = [
        ("params (master weights)", [gib(s.params) for s in steps]),
        ("optimizer state", [gib(s.opt_state) for s in steps]),
        ("gradients/sketches", [gib(s.gradients) for s in steps]),
        ("other temporaries", [gib(s.other_temporaries) for s in steps]),
        ("temporaries (XLA)", [gib(s.temporaries) for s in steps]),
        ("batch", [gib(s.batch) for s in steps]),
        ("update peak (XLA)", [gib(s.peak) for s in steps]),
    ]
    if loops is not None:
        loops = loops if isinstance(loops, list) else [loops] * len(steps)
        dtype = _SHORT.get(loops[0].reference_dtype, loops[0].reference_dtype)
        rows.append((f"+ reference ({dtype})", [gib(loop.reference) for loop in loops]))
        where = "colocated" if loops[0].colocated else f"own {loops[0].rollout_devices} devices"
        rows.append((f"sampler bf16 ({where})", [gib(loop.sampler_weights) for loop in loops]))
        if rollouts is not None and rollouts[0].rows_per_pass < rollouts[0].rows:
            where += f", {rollouts[0].rows_per_pass} of {rollouts[0].rows} rows per pass"
        rows.append((f"KV cache ({where})", [gib(loop.kv_cache) for loop in loops]))
        if loops[0].queued_rollouts:
            rows.append(("queued rollouts (rl.max_lag)", [gib(loop.queued_rollouts) for loop in loops]))
        if rollouts is not None:
            rows.append((f"generate temporaries ({where}, XLA)",
                         [gib(r.temporaries) for r in rollouts]))
            rows.append((f"generate peak ({where}, XLA)", [gib(r.peak) for r in rollouts]))
        phases = [memory.rl_footprint(s, loop, r)
                  for s, loop, r in zip(steps, loops, rollouts or [None] * len(steps))]
        rows.append(("RL update phase", [gib(p["update"]) for p in phases]))
        rows.append(("RL rollout phase", [gib(p["rollout"]) for p in phases]))
        rows.append(("RL footprint (max)", [gib(p["total"]) for p in phases]))
    label_width = max(len(r[0]) for r in rows)
    head = f"{'GiB per training ' + unit:<{label_width}}  " + "  ".join(f"{n:>{width}}" for n in names)
    lines = [head, "-" * len(head)]
    for label, values in rows:
        lines.append(f"{label:<{label_width}}  " + "  ".join(f"{v:>{width}}" for v in values))
    return "\n".join(lines)


def refusal_line(refusal, target_name: str) -> str:
    """The TPU compiler's refusal of a column's program as one line."""
    lever = ("; rollouts in smaller passes hold one pass's KV cache: "
             "--config.rl.rollout_micro_batch=N, N dividing the rows"
             if refusal.program.startswith("the sampler's generate") else "")
    return (f"does not fit: {refusal.program} needs {gib_text(refusal.needed)} of "
            f"{gib_text(refusal.available)} HBM per device on {target_name}{lever} (the TPU "
            f"compiler's refusal: {refusal})")


def cost_lines(steps, target) -> list[str]:
    """Each update's cost per device: its matmul FLOPs (loops as they run), XLA's bytes accessed
    (loop bodies counted once, so a lower bound) and, for an accelerator target, the roofline lower
    bound max(FLOPs / peak bf16 FLOP/s, bytes / bandwidth) from the device's published figures."""
    lines = []
    for s in steps:
        accessed = (f"≥ {s.bytes_accessed:.3e} bytes accessed (XLA, loop bodies once)"
                    if s.bytes_accessed else "bytes accessed not reported by this compiler")
        line = (f"cost per device: {s.optimizer} {s.flops:.3e} matmul FLOPs per update (loops as "
                f"they run), {accessed}")
        if target is not None:
            bound = target.roofline_seconds(s.flops, s.bytes_accessed)
            kind = "compute" if bound["compute"] >= bound["memory"] else "memory"
            line += (f"; roofline ≥ {bound['bound']:.3g} s on {target.family} "
                     f"({kind}-bound; a lower bound, not a prediction)")
        lines.append(line)
    a = steps[0]
    lines += [f"matmul FLOPs per update: {a.optimizer} / {b.optimizer} {a.flops / b.flops:.3f}"
              for b in steps[1:] if a.flops and b.flops]
    return lines


def target_header(target, mesh) -> str:
    """Which compiler made the numbers, and for which hardware: XLA:CPU's simulated devices, or a
    target's compiler and version and its devices (their kind as the compiler named them)."""
    if target is None:
        return f"compiler: XLA:CPU (jax {jax.__version__}), {mesh.size} simulated CPU devices"
    return (f"compiler: {target.compiler()}; {target.describe(mesh.size)}; devices "
            f"'{mesh.devices.flat[0].device_kind}'")


def fit_line(target, label: str, footprint: dict, peak: int) -> tuple[bool, str]:
    """(fits, "fits: ..." or "does not fit: <label> needs X GiB of Y ...") for a column's RL
    footprint against the memory a program may use on one of ``target``'s devices."""
    fits = footprint["total"] <= target.memory_per_device
    return fits, (f"{'fits' if fits else 'does not fit'}: {label} needs "
                  f"{gib(footprint['total'])} GiB of {target.memory_text} per "
                  f"{target.unit} on {target.name} (RL footprint; update peak {gib(peak)} "
                  f"GiB; {target.judge})")
