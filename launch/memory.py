"""Per-device memory of one policy update and of the whole RL loop, ahead of time, on this machine.

    python -m launch.memory --config configs/qwen2_5_7b_gsm8k.py [--target cpu|h100-8|v5p-16|...] \
        [--mesh fsdp=4,tensor=1] [--optimizer logra|adamw|adafactor|galore|lora|<registered>] \
        [--compare adamw[,adafactor,galore,logra:fp32,...]] [--micro_steps N] [--compile_rollout] \
        [--rollout_devices N] [--hosts H] [--explain 15] [--json out.json] [--config.key=value ...]

``--target cpu`` (default): XLA:CPU on simulated CPU devices. Any other target is a machine this
one compiles for without having it (perf/machines.py): a GPU node, ``a100-80gb-8``, ``h100-8``,
``h200-8``, ``b200-8`` (XLA:GPU, the ``gpu-plan`` extra), or a Cloud TPU slice, ``v5p-16``,
``v6e-8``, ... (the TPU compiler, the ``tpu`` extra). The program is compiled for the target's
devices, FSDP over all of them unless ``--mesh`` says otherwise, and so is the sampler's
``generate`` for the rollout batch, on the mesh the trainer samples on (the training mesh, or the
rollout devices laid out as ``sync.rollout_mesh``), so the rollout phase is the compiler's figure
too. The header names the compiler and its version and the hardware; the last lines say whether
each column's RL footprint fits a device's memory (a TPU's HBM, a GPU's allocator limit):
"fits: ..." or "does not fit: <column> needs X GiB of Y ...". XLA:GPU plans past a device's
memory (it warns and goes on), so its verdict is drawn from the plan; the TPU compiler refuses an
over-budget program itself, and its refusal is the "does not fit" line. The run exits 1 when the
config's own column does not fit; a ``--compare`` column that does not (dense AdamW of a 70B
model on 8 chips) keeps its "does not fit" line and its figure in the ratio line, and the columns
that fit still make the table.

The trainer's jitted update is compiled for the config's model shape (abstract inputs: nothing is
allocated; on XLA:CPU 7B and 27B shapes compile in about a minute, the TPU compiler takes
minutes) and XLA's
memory analysis is printed per training device: params, optimizer state, gradients or sketches,
temporaries and the peak, plus the reference and sampler weights and the KV cache the RL loop
keeps. ``--compare`` adds columns, each an optimizer with the config's weight dtype or with
``:bf16`` / ``:fp32`` weights; AdamW is always the usual mixed-precision baseline, fp32 master
weights and moments (bf16-weight AdamW is not offered). Each extra column ends in a line

    peak per device: logra X GiB, adamw Y GiB, ratio Z        (Z = X / Y, update peaks)

Before the ratio lines, a cost line per column: the update's matmul FLOPs per device with every loop counted as it
runs (`perf/matmul_count.py`), XLA's bytes accessed (its cost analysis counts a loop body once: a
lower bound) and, for an accelerator target, the roofline lower bound max(FLOPs / peak bf16 FLOP/s, bytes /
bandwidth) from the device's published figures; and the FLOPs ratio to the first column (XLA:GPU
compiled without a GPU reports no bytes accessed: its bound is the compute one).
``--explain N`` also lists the N largest buffers at each update's peak and, where the sampler is
compiled, at its ``generate``'s, named by the JAX op or parameter path that made each one; each
list's total is XLA's memory analysis of that program (bytes two values share counted once).
``--hosts H`` plans a mesh that spans H hosts (``--target h100-8 --hosts 2``: 2 nodes of 8 GPUs,
16 devices; a TPU slice's hosts are already in its name): a device's memory does not depend on
which process drives it, so the table is per device as always, and the header adds each host's
share.
"""

import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile

from absl import flags

from launch import cli
from logra_jax import config as config_lib

_CONFIG = cli.define_config(help_string="A configs/*.py file (or a run's config.json).",
                            lock_config=False)
_MESH = flags.DEFINE_string("mesh", None, "Training mesh, e.g. fsdp=4,tensor=1 (default: config.mesh).")
_OPTIMIZER = flags.DEFINE_string("optimizer", None,
                                 "Optimizer to measure: any registered one, e.g. logra, adamw, "
                                 "adafactor, galore, lora (default: config.optimizer.name).")
_COMPARE = flags.DEFINE_list("compare", None,
                             "Also measure these columns (any registered optimizer: logra | adamw | "
                             "adafactor | galore | lora; optionally :bf16 or :fp32 weights) and print the ratio of the peaks to the first column.")
_MICRO_STEPS = flags.DEFINE_integer("micro_steps", None,
                                    "Micro-batches per update (default: the config's batch).")
_ROLLOUT = flags.DEFINE_integer("rollout_devices", None,
                                "Devices of the rollout engine; 0 = colocated with training "
                                "(default: config.sync.rollout_devices, else 0).")
_HOSTS = flags.DEFINE_integer("hosts", 1, "Hosts the training mesh spans (its devices split evenly).")
_EXPLAIN = flags.DEFINE_integer("explain", 0, "List the N largest buffers live at each peak.")
_HOIST = flags.DEFINE_bool("hoist_invariants", True,
                           "XLA's loop-invariant code motion for every column; false disables it: on "
                           "CPU it hoists f32 copies of whole bf16 weight stacks out of the layer "
                           "loops (bf16 dots run in f32 here, natively on GPUs). For bf16-weight "
                           "plans: --hoist_invariants=false.")
_JSON = flags.DEFINE_string("json", None, "Also write the numbers (bytes) to this JSON file.")
_TARGET = flags.DEFINE_string(
    "target", "cpu", "Compile for: cpu (XLA:CPU on simulated devices); a GPU node, compiled by "
    "XLA:GPU on this machine (the CUDA plugin, the 'gpu-plan' extra): a100-80gb-8, h100-8, h200-8, "
    "b200-8; or a TPU slice, compiled by the TPU compiler (libtpu, the 'tpu' extra): v4-8, v5p-8, "
    "v5p-16, v5p-32, v5p-64, v5e-8, v6e-8, v6e-16, tpu7x-8, ... (Cloud TPU names). FSDP over all "
    "devices unless --mesh says otherwise.")
_ROLLOUT_COMPILE = flags.DEFINE_bool(
    "compile_rollout", None, "Also compile the sampler's generate for the rollout batch, so the "
    "rollout phase is the compiler's figure, not weights + KV cache from shapes (default: on for "
    "GPU and TPU targets, off for cpu).")


def rollout_devices_of(config, flag_value) -> int:
    if flag_value is not None:
        value = flag_value
    else:
        value = config.get("sync", {}).get("rollout_devices", 0)
    if value < 0:
        raise ValueError(f"rollout_devices must be ≥ 0, got {value}")
    return int(value)


def devices_per_host(mesh_size: int, hosts: int) -> int:
    """Each host's share of a ``mesh_size``-device mesh; hosts must split it evenly."""
    if hosts < 1 or mesh_size % hosts:
        raise ValueError(f"--hosts {hosts}: the training mesh's {mesh_size} devices must split "
                         f"evenly over the hosts (e.g. --mesh fsdp=16 --hosts 2)")
    return mesh_size // hosts


@dataclasses.dataclass(frozen=True)
class Measured:
    """What `measure` compiled, for the columns that fit: one StepMemory, LoopMemory and (with
    ``compile_rollout``) RolloutMemory each, in column order; ``breakdowns`` {label: (bytes,
    buffers)} at each update's peak (``explain``), then at each compiled ``generate``'s;
    ``refused`` {label: oom.DoesNotFit} for the columns whose update or sampler the compiler
    refused (their figure is its "needs X of Y")."""

    mesh: object
    steps: list
    loops: list
    rollouts: list | None
    breakdowns: dict
    refused: dict


def measure(config, cols, mesh_sizes, rollout_devices, micro_steps, explain, hoist_invariants=True,
            hosts=1, devices=None, compile_rollout=False) -> Measured:
    """Compiles each of the columns ``cols`` (perf/memory.py: `columns`) on the run's own meshes
    over ``devices`` (default: this process's): the training mesh of ``mesh_sizes``, the last
    ``rollout_devices`` of them the sampler's, laid out as the config's ``sync.rollout_mesh``
    (perf/plan.py: `plan`, one abstract run per column). A column whose update or sampler the TPU
    compiler refuses is left out of the lists and kept with the refusal, so the columns that fit
    still make a table."""
    import jax
    from logra_jax.perf import hlo_dump, memory, oom
    from logra_jax.perf import plan as plan_lib
    from logra_jax.rl import optimizers

    devices = jax.devices() if devices is None else devices
    if rollout_devices >= len(devices):
        raise ValueError(f"rollout_devices={rollout_devices} leaves no training device of {len(devices)}")
    planned = plan_lib.planned(config, mesh_sizes, rollout_devices)
    steps, loops, rollouts, breakdowns, refused = [], [], [], {}, {}
    generate = {}   # the sampler's program differs between columns only by an optimizer's adapters
    sampler_breakdowns = {}   # listed after the updates'
    mesh = None
    for label, name, param_dtype in cols:
        run = planned.copy_and_resolve_references()
        run.optimizer.name = name
        run.model.param_dtype = param_dtype
        column = plan_lib.plan(run, devices)
        if mesh is None:
            mesh = column.mesh
            devices_per_host(mesh.size, hosts)  # before minutes of compiling
        try:
            if compile_rollout:   # first: the quicker compile, and the one a big batch overfills
                kind = name if optimizers.get(name).adapters is not None else None
                if kind not in generate:
                    try:
                        with (tempfile.TemporaryDirectory() if explain
                              else contextlib.nullcontext()) as dump:   # where its bytes go
                            generate[kind] = memory.generate_memory(
                                column.lower_generate(), column.sampler_mesh, dump_dir=dump)
                            if explain:
                                sampler_breakdowns[f"{label} generate"] = hlo_dump.peak_breakdown(
                                    dump, module="generate")
                    except oom.DoesNotFit as e:
                        generate[kind] = e
                if isinstance(generate[kind], oom.DoesNotFit):
                    raise generate[kind]
            with tempfile.TemporaryDirectory() if explain else contextlib.nullcontext() as dump:
                step = memory.update_memory(column.lower_update(micro_steps), mesh, label=label,
                                            dump_dir=dump, hoist_invariants=hoist_invariants)
                if explain:
                    breakdowns[label] = hlo_dump.peak_breakdown(dump)
        except oom.DoesNotFit as e:
            refused[label] = e
            continue
        if compile_rollout:
            rollouts.append(generate[kind])
        steps.append(step)
        loops.append(memory.resident_bytes(column))
    return Measured(mesh, steps, loops, rollouts if compile_rollout else None,
                    {**breakdowns, **sampler_breakdowns}, refused)


def host_devices(mesh: str | None, rollout_devices: int | None) -> int:
    """The CPU devices to simulate: enough for ``--mesh`` and ``--rollout_devices`` on XLA:CPU, at
    least 8 (a target other than cpu brings its own devices; these only hold the CPU side)."""
    try:
        wanted = math.prod(abs(size) for size in cli.parse_mesh(mesh).values()) if mesh else 8
    except ValueError:
        wanted = 8   # main names the malformed --mesh
    return max(8, wanted + (rollout_devices or 0))


def check_mesh_fits(mesh_sizes: dict[str, int], rollout_devices: int, devices: list,
                    target_name: str, hosts: int) -> None:
    """A mesh larger than the devices it is planned on is one line saying what fits: a smaller
    mesh, or as many whole nodes as it fills (``--hosts``); on XLA:CPU, more simulated devices."""
    fixed = [size for size in mesh_sizes.values() if size != -1]
    needed = math.prod(fixed) + rollout_devices
    if -1 in mesh_sizes.values() or needed <= len(devices):
        return
    layout = ",".join(f"{name}={size}" for name, size in mesh_sizes.items())
    per_host = len(devices) // hosts
    if target_name == "cpu":
        more = f" (XLA:CPU simulates {len(devices)} here: LOGRA_HOST_DEVICES={needed} gives more)"
    elif needed % per_host == 0:   # launch.memory splits a mesh evenly over whole nodes
        more = f", or --hosts {needed // per_host} for that many nodes of {per_host}"
    else:
        more = f" (or a multiple of {per_host} with --hosts: one node holds {per_host})"
    raise ValueError(f"--mesh {layout} needs {math.prod(fixed)} devices"
                     + (f" + {rollout_devices} for the rollout" if rollout_devices else "")
                     + f", and {target_name}" + (f" × {hosts} hosts" if hosts > 1 else "")
                     + f" has {len(devices)}: give a mesh of at most "
                     f"{len(devices) - rollout_devices} devices{more}")


def main(argv):
    del argv
    from launch import process
    process.setup(host_devices(_MESH.value, _ROLLOUT.value))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # XLA:CPU plans; targets compile deviceless
    try:   # what the flags alone can tell, before jax is imported (seconds)
        requested_mesh = cli.parse_mesh(_MESH.value) if _MESH.value else None
        if requested_mesh and -1 not in requested_mesh.values():   # its size is known already
            devices_per_host(math.prod(requested_mesh.values()), _HOSTS.value)
        if _OPTIMIZER.value and _OPTIMIZER.value not in config_lib.OPTIMIZERS.names():
            raise ValueError(f"--optimizer {_OPTIMIZER.value!r}: expected one of "   # the registry's
                             f"{', '.join(config_lib.OPTIMIZERS.names())}")
    except ValueError as e:
        sys.exit(f"error: {e}")
    from launch.memory_report import (cost_lines, fit_line, format_table, gib, refusal_line,
                                      target_header)
    from logra_jax.perf import machines, memory

    config = _CONFIG.value
    target, devices = None, None
    try:
        if _TARGET.value != "cpu":
            target = machines.machine(_TARGET.value).with_hosts(_HOSTS.value)
            devices = target.jax_devices()
        if _OPTIMIZER.value:
            config.optimizer.name = _OPTIMIZER.value
        cols = memory.columns(config, _COMPARE.value)
        rollout_devices = rollout_devices_of(config, _ROLLOUT.value)
        if requested_mesh is not None:
            mesh_sizes = requested_mesh
        elif target is not None:   # a config's mesh is its own layout; a target shards over all
            mesh_sizes = {"fsdp": len(devices) - rollout_devices, "tensor": 1}
        else:
            mesh_sizes = dict(config.mesh)
        if _MESH.value:
            import jax
            check_mesh_fits(mesh_sizes, rollout_devices, devices or jax.devices(),
                            target.name if target else "cpu", _HOSTS.value)
        compile_rollout = (target is not None if _ROLLOUT_COMPILE.value is None
                           else _ROLLOUT_COMPILE.value)
        measured = measure(
            config, cols, mesh_sizes, rollout_devices, _MICRO_STEPS.value, _EXPLAIN.value,
            hoist_invariants=_HOIST.value, hosts=_HOSTS.value, devices=devices,
            compile_rollout=compile_rollout)
        mesh, steps, loops, rollouts = measured.mesh, measured.steps, measured.loops, measured.rollouts
        breakdowns, refused = measured.breakdowns, measured.refused
        per_host = devices_per_host(mesh.size, _HOSTS.value)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    own = cols[0][0]   # the config's own column: its refusal is the run's verdict, printed last
    refusals = {label: {"program": e.program, "needed": e.needed, "available": e.available}
                for label, e in refused.items()}
    record = {"target": target.name if target else "cpu", "hosts": _HOSTS.value,
              "compiler": target.compiler() if target else "XLA:CPU",
              "memory_per_device": target.memory_per_device if target else None,
              "unit": target.unit if target else "device",
              "param_dtype": config.model.param_dtype, "refused": refusals}
    if not steps:
        if _JSON.value:   # every column refused: the refusals are the record
            with open(_JSON.value, "w") as f:
                json.dump(dict(record, steps=[], footprint={}), f, indent=1)
        sys.exit(refusal_line(refused[own], _TARGET.value))

    rl = config.rl
    hosts = f" = {_HOSTS.value} hosts × {per_host} devices" if _HOSTS.value > 1 else ""
    print(f"model {config.model.source} ({config.model.param_dtype} weights, {config.model.dtype} compute, "
          f"remat={config.model.remat}); training mesh {dict(mesh.shape)}{hosts}; "
          f"{steps[0].micro_steps} micro-step(s) of {rl.micro_batch_size} rows × "
          f"{rl.max_prompt_length + rl.max_completion_length} tokens; rollout: "
          f"{'colocated' if loops[0].colocated else f'{loops[0].rollout_devices} own devices'}")
    print(target_header(target, mesh))
    print(format_table(steps, loops, rollouts, unit=target.unit if target else "device"))
    for name, (peak, entries) in breakdowns.items():
        print(f"\nlargest buffers live at the {name} peak ({gib(peak)} GiB), MiB:")
        for label, size in entries[:_EXPLAIN.value]:
            print(f"  {size / 2**20:>9.1f}  {label}")
    if _JSON.value:
        payload = dict(record, mesh=dict(mesh.shape), loop=loops[0].__dict__,
                       loops={s.optimizer: loop.__dict__ for s, loop in zip(steps, loops)},
                       steps=[dict(s.__dict__, peak=s.peak) for s in steps],
                       footprint={s.optimizer: memory.rl_footprint(s, loop, r)
                                  for s, loop, r in zip(steps, loops, rollouts or [None] * len(steps))},
                       rollouts=[r.__dict__ for r in rollouts] if rollouts else None)
        with open(_JSON.value, "w") as f:
            json.dump(payload, f, indent=1)
    print("\n".join(cost_lines(steps, target)))
    a = steps[0]
    if a.optimizer == own:
        for b in steps[1:]:
            print(f"peak per device: {a.optimizer} {gib(a.peak)} GiB, {b.optimizer} "
                  f"{gib(b.peak)} GiB, ratio {a.peak / b.peak:.3f}")
        for label, e in refused.items():   # the compiler's figure stands in for the refused peak
            print(f"peak per device: {a.optimizer} {gib(a.peak)} GiB, {label} refused "
                  f"(needs {gib(e.needed)} GiB), ratio {a.peak / e.needed:.3f}")
    if target is not None:
        fits = {}
        for s, loop, r in zip(steps, loops, rollouts or [None] * len(steps)):
            fits[s.optimizer], line = fit_line(target, s.optimizer, memory.rl_footprint(s, loop, r), s.peak)
            print(line)
        for label, e in refused.items():
            if label != own:
                print(refusal_line(e, target.name))
        if own in refused:
            sys.exit(refusal_line(refused[own], target.name))
        if not fits[own]:
            sys.exit(1)


if __name__ == "__main__":
    cli.run(main, required=("config",))
