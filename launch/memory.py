"""Per-device memory of one policy update and of the whole RL loop, ahead of time, on CPU.

    python -m launch.memory --config configs/qwen2_5_7b_gsm8k.py [--mesh fsdp=4,tensor=1] \
        [--optimizer logra|adamw|adafactor|galore] [--compare adamw[,adafactor,galore,logra:fp32,...]] [--micro_steps N] \
        [--rollout_devices N] [--hosts H] [--explain 15] [--json out.json] [--config.key=value ...]

The trainer's jitted update is compiled for the config's model shape on simulated CPU devices
(abstract inputs: nothing is allocated, 7B and 27B shapes compile in about a minute) and XLA's
memory analysis is printed per training device: params, optimizer state, gradients or sketches,
temporaries and the peak, plus the reference and sampler weights and the KV cache the RL loop
keeps. ``--compare`` adds columns, each an optimizer with the config's weight dtype or with
``:bf16`` / ``:fp32`` weights; AdamW is always the usual mixed-precision baseline, fp32 master
weights and moments (bf16-weight AdamW is not offered). Each extra column ends in a line

    peak per device: logra X GiB, adamw Y GiB, ratio Z        (Z = X / Y, update peaks)

``--explain N`` also lists the N largest buffers live at each peak, as XLA names them.
``--hosts H`` plans a mesh that spans H hosts (``--mesh fsdp=16 --hosts 2``: 2 × 8 GPUs): a device's
memory does not depend on which process drives it, so the table is per device as always, and the
header adds each host's share.
"""

import math
import os
import sys

from launch import simulate_host_devices

# Simulated devices must be configured before jax starts its CPU backend: enough for the mesh and
# rollout devices named on the command line, at least 8; LOGRA_HOST_DEVICES or an XLA_FLAGS count wins.
def _host_devices(argv) -> int:
    mesh, rollout = 8, 0
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
        try:
            if arg.startswith("--mesh"):
                mesh = math.prod(abs(int(part.split("=")[1])) for part in value.split(","))
            elif arg.startswith("--rollout_devices"):
                rollout = int(value)
        except (IndexError, ValueError):
            pass  # a malformed flag is reported once the flags are parsed
    return max(8, mesh + rollout)


simulate_host_devices(_host_devices(sys.argv[1:]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import tempfile  # noqa: E402

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from logra_jax import config as config_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.",
                                          lock_config=False)
_MESH = flags.DEFINE_string("mesh", None, "Training mesh, e.g. fsdp=4,tensor=1 (default: config.mesh).")
_OPTIMIZER = flags.DEFINE_enum("optimizer", None, ["logra", "adamw", "adafactor", "galore"],
                               "Optimizer to measure (default: config.optimizer.name).")
_COMPARE = flags.DEFINE_list("compare", None,
                             "Also measure these columns (logra | adamw | adafactor | galore; "
                             "logra optionally :bf16 or :fp32 weights) and print the ratio of the peaks to the first column.")
_MICRO_STEPS = flags.DEFINE_integer("micro_steps", None,
                                    "Micro-batches per update (default: the config's batch).")
_ROLLOUT = flags.DEFINE_integer("rollout_devices", None,
                                "Devices of the rollout engine; 0 = colocated with training "
                                "(default: config.sync.rollout_devices, else 0).")
_HOSTS = flags.DEFINE_integer("hosts", 1, "Hosts the training mesh spans (its devices split evenly).")
_EXPLAIN = flags.DEFINE_integer("explain", 0, "List the N largest buffers live at each peak.")
_NO_LICM = flags.DEFINE_bool("no_licm", False,
                             "Disable XLA's loop-invariant code motion for every column: on CPU it "
                             "hoists f32 copies of whole bf16 weight stacks out of the layer loops "
                             "(bf16 dots run in f32 here, natively on GPUs). For bf16-weight plans.")
_JSON = flags.DEFINE_string("json", None, "Also write the numbers (bytes) to this JSON file.")
flags.mark_flags_as_required(["config"])


def parse_mesh(text: str) -> dict[str, int]:
    """"fsdp=4,tensor=1" → {"fsdp": 4, "tensor": 1}."""
    sizes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        try:
            sizes[name.strip()] = int(size)
        except ValueError:
            raise ValueError(f"--mesh {text!r}: expected name=size pairs such as fsdp=4,tensor=1") from None
    return sizes


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


def measure(config, cols, mesh_sizes, rollout_devices, micro_steps, explain, hoist=True, hosts=1):
    import jax
    from logra_jax.perf import memory
    from logra_jax.rl.build import build_mesh

    devices = jax.devices()
    if rollout_devices >= len(devices):
        raise ValueError(f"rollout_devices={rollout_devices} leaves no training device of {len(devices)}")
    training_devices = devices[:len(devices) - rollout_devices] if rollout_devices else devices
    mesh = build_mesh(mesh_sizes, training_devices, spare_devices=True)
    devices_per_host(mesh.size, hosts)  # before minutes of compiling
    rollout = (build_mesh({"fsdp": rollout_devices, "tensor": 1},
                          devices[len(devices) - rollout_devices:])
               if rollout_devices else mesh)
    steps, loops, breakdowns = [], [], {}
    for label, name, param_dtype in cols:
        run = config.copy_and_resolve_references()
        run.optimizer.name = name
        run.model.param_dtype = param_dtype
        if explain:
            with tempfile.TemporaryDirectory() as dump:
                steps.append(memory.update_step_memory(run, mesh, micro_steps=micro_steps,
                                                       dump_dir=dump, label=label,
                                                       hoist_invariants=hoist))
                breakdowns[label] = memory.peak_breakdown(dump)
        else:
            steps.append(memory.update_step_memory(run, mesh, micro_steps=micro_steps, label=label,
                                                   hoist_invariants=hoist))
        loops.append(memory.rl_resident_bytes(run, mesh, rollout))
    return mesh, steps, loops, breakdowns


def main(argv):
    del argv
    from logra_jax.perf import memory

    config = _CONFIG.value
    try:
        if _OPTIMIZER.value:
            config.optimizer.name = _OPTIMIZER.value
        cols = memory.columns(config, _COMPARE.value)
        mesh_sizes = parse_mesh(_MESH.value) if _MESH.value else dict(config.mesh)
        rollout_devices = rollout_devices_of(config, _ROLLOUT.value)
        mesh, steps, loops, breakdowns = measure(config, cols, mesh_sizes, rollout_devices,
                                                 _MICRO_STEPS.value, _EXPLAIN.value,
                                                 hoist=not _NO_LICM.value, hosts=_HOSTS.value)
        per_host = devices_per_host(mesh.size, _HOSTS.value)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")

    rl = config.rl
    hosts = f" = {_HOSTS.value} hosts × {per_host} devices" if _HOSTS.value > 1 else ""
    print(f"model {config.model.source} ({config.model.param_dtype} weights, {config.model.dtype} compute, "
          f"remat={config.model.remat}); training mesh {dict(mesh.shape)}{hosts}; "
          f"{steps[0].micro_steps} micro-step(s) of {rl.micro_batch_size} rows × "
          f"{rl.max_prompt_length + rl.max_completion_length} tokens; rollout: "
          f"{'colocated' if loops[0].colocated else f'{loops[0].rollout_devices} own devices'}")
    print(memory.format_table(steps, loops))
    for name, (peak, entries) in breakdowns.items():
        print(f"\nlargest buffers live at the {name} peak ({memory.gib(peak)} GiB), MiB:")
        for label, size in entries[:_EXPLAIN.value]:
            print(f"  {size / 2**20:>9.1f}  {label}")
    if _JSON.value:
        payload = {"mesh": dict(mesh.shape), "hosts": _HOSTS.value, "loop": loops[0].__dict__,
                   "loops": {s.optimizer: loop.__dict__ for s, loop in zip(steps, loops)},
                   "steps": [dict(s.__dict__, peak=s.peak) for s in steps],
                   "footprint": {s.optimizer: memory.rl_footprint(s, loop)
                                 for s, loop in zip(steps, loops)}}
        with open(_JSON.value, "w") as f:
            json.dump(payload, f, indent=1)
    a = steps[0]
    for b in steps[1:]:
        print(f"peak per device: {a.optimizer} {memory.gib(a.peak)} GiB, {b.optimizer} "
              f"{memory.gib(b.peak)} GiB, ratio {a.peak / b.peak:.3f}")


if __name__ == "__main__":
    config_lib.check_argv(sys.argv[1:])
    app.run(main)
