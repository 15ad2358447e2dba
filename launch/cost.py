"""What XLA:GPU's compiled rollout and update cost on a GPU: kernels, host syncs, bytes, FLOPs.

    python -m launch.cost --config configs/qwen2_5_1_5b.py --target h200-8 \\
        [--mesh fsdp=1,tensor=1] [--batches 1,16,64] [--modes per_layer,stacked|default] \\
        [--parts decode,update,generate,rollout] [--schedule lognormal:200|FILE] [--json out.json] \\
        [--calibrate] [--config.key=value ...]

The programs are the ones `launch.memory` compiles (perf/memory.py: the sampler's ``generate`` and
the trainer's update), compiled by XLA:GPU for the target's GPUs on this machine (deviceless, the
``gpu-plan`` extra), and read by perf/gpu_cost.py, which says how each instruction becomes
kernels, host syncs and bytes. Figures are per GPU of the mesh (default: FSDP over all of the
target's GPUs).

**decode**: for each batch of ``--batches`` and each decode mode a GPU run can use (the Sampler's
``DECODE_WEIGHTS`` but "auto"), one decode step — one token for every row — of the compiled
``generate``, read off its token loop (so its host syncs and loop structure are the program's
own): kernels per token (by kind), kernels per layer (the step's kernels at 4 layers less those at
3 layers of the same model: from 3 layers on XLA's count grows by that much per layer), host
syncs per token, bytes per token against the whole-cache floor (the GPU's share of the bf16
weights a step reads -- all, but of an untied input embedding only its rows' entries -- plus every
slot of its rows' KV cache, each read once: the least today's program, whose attention reads
every slot, could move) and the predicted tokens/s

    batch ÷ max(bytes per token ÷ the GPU's bandwidth, kernels per token × seconds per kernel)

with the seconds per kernel measured on one H200 (perf/gpu_cost.py's ``SECONDS_PER_KERNEL``, with
its evidence; ``--calibrate`` compiles today's decode at that run's shape beside the counts of
the program that ran). The mode a plan
compiles for the config's ``rl.decode_weights`` ("auto" measures only where it runs) is marked
``*`` (``default`` in the JSON); ``--modes default`` reads that one alone.

**update**: the config's optimizer and AdamW (fp32 master weights, as `launch.memory --compare
adamw`), side by side: kernels, bytes, host syncs, matmul FLOPs (loops as they run).

**generate**: the config's own rollout pass (``rl.rollout_micro_batch`` rows, or the whole
rollout batch) in the default mode: XLA's temporaries beside the KV cache that pass holds.

**rollout** (needs ``--schedule``): a whole rollout of the config's batch (prompts_per_step ×
num_generations rows) by both engines, side by side, for a schedule of completion lengths, the
two as wide (``rl.rollout_micro_batch`` rows per pass, or ``rl.rollout_slots`` slots; the whole
batch when neither is set):

- **static**, today's static engine (`gpu_programs.static_rollout`): a pass runs whole trips of
  its token loop until its longest row ends, each decode step costing the bytes and kernels of
  the step XLA:GPU compiles, deviceless, for a pass of that many rows;
- **new**, the slot engine (`gpu_programs.slot_rollout`): its own program compiled the same way,
  each loop (admission, and the tail at each executed size) costed per trip from the program,
  the trips counted by replaying its schedule over the lengths (`slot_schedule.replay`).

Neither counts its prefills (the static engine prefills every row, the slot engine each group
once: ``prefill_tokens`` in the detail). Per kept token (completion tokens up to and including
EOS): the bytes moved, the true floor (the batch decoded as one: the weights once per step, each
group's prompt KV once, each live row's completion KV so far, only while a row is live), the
kernels; and efficiency = kept tokens ÷ executed row-steps, decode_steps = the token steps run
one after another. A GPU's time per kept token follows as max(bytes ÷ bandwidth, kernels ×
seconds per kernel), part by part. ``--schedule``: ``lognormal:M`` draws every row's length as
round(M·e^Z), Z ~ N(0, 1) (median M, σ 1), clipped to 1 … rl.max_completion_length, Z from
numpy's generator seeded with ``gpu_programs.SCHEDULE_SEED`` (the same lengths every run); or a
file of one length per row, one integer per line.

``--json FILE`` writes every figure; the header names the compiler and its versions. Its
``rollout`` entry is ``{schedule, static: {bytes_per_kept_token, floor_bytes_per_kept_token,
kernels_per_kept_token, efficiency, decode_steps}, new: {the same}, static_detail, new_detail}``.
"""

import dataclasses
import json
import os
import sys

from absl import flags

from launch import cli
from logra_jax.config import rows_per_step

_CONFIG = cli.define_config(help_string="A configs/*.py file (or a run's config.json).",
                            lock_config=False)
_TARGET = flags.DEFINE_string("target", None, "A GPU node to compile for (XLA:GPU, the 'gpu-plan' "
                              "extra): a100-80gb-8, h100-8, h200-8, b200-8.")
_MESH = flags.DEFINE_string("mesh", None, "Mesh over the target's GPUs, e.g. fsdp=1,tensor=1 "
                            "(default: FSDP over all of them).")
_BATCHES = flags.DEFINE_list("batches", ["1", "16", "64"], "Rows decoded at once, per decode figure.")
_MODES = flags.DEFINE_list("modes", None, "Decode modes to read (default: every mode a GPU run can "
                           "use); 'default' is the one a plan compiles for rl.decode_weights.")
_PARTS = flags.DEFINE_list("parts", ["decode", "update", "generate"],
                           "What to compile and read: decode, update, generate, rollout.")
_SCHEDULE = flags.DEFINE_string(
    "schedule", None, "Completion lengths of the rollout part: lognormal:M (median M, sigma 1, "
    "capped at rl.max_completion_length, a fixed seed) or a file of one integer per row.")
_JSON = flags.DEFINE_string("json", None, "Also write every figure to this JSON file.")
_CALIBRATE = flags.DEFINE_bool(
    "calibrate", False, "Also compile today's decode at the shape of the H200 run the seconds per "
    "kernel come from (SmolLM2-135M's, batch 1, both modes) and print its kernels beside that run's.")

PARTS = ("decode", "update", "generate", "rollout")


def parse_batches(values) -> list[int]:
    try:
        batches = [int(v) for v in values]
    except ValueError:
        raise ValueError(f"--batches {','.join(values)}: expected positive integers, e.g. 1,16,64") from None
    if not batches or min(batches) < 1:
        raise ValueError(f"--batches {','.join(values)}: expected positive integers, e.g. 1,16,64")
    return list(dict.fromkeys(batches))


def parse_modes(values, known: list[str]) -> list[str]:
    """--modes: names from ``known`` or "default"; all of ``known`` when not given."""
    if not values:
        return list(known)
    bad = [v for v in values if v not in known and v != "default"]
    if bad:
        raise ValueError(f"--modes {','.join(values)}: expected some of {', '.join(known)}, default")
    return list(dict.fromkeys(values))


def gpu_target(name):
    """The GPU node ``name``; ValueError for a CPU or TPU target (no model of their programs here)."""
    from logra_jax.perf import machines
    nodes = [m.name for m in machines.MACHINES.values() if m.kind == "gpu"]
    if name is None:
        raise ValueError(f"--target is required: a GPU node, one of {', '.join(nodes)}")
    target = machines.machine(name) if name != "cpu" else None   # an unknown name: its own error
    if target is None or target.kind != "gpu":
        what = "XLA:CPU" if target is None else "the TPU compiler"
        raise ValueError(f"--target {name}: launch.cost reads XLA:GPU programs and has no model of "
                         f"what {what} launches; use a GPU node: {', '.join(nodes)}")
    return target


def calibration(mesh) -> dict:
    """Kernels per token of today's decode at the shape of the H200 run behind
    ``SECONDS_PER_KERNEL`` (`launch.sampler_bench`'s SmolLM2-135M shape: the tiny source at that
    shape, bf16, 64 + 128 tokens, batch 1), and the seconds per kernel they would give with the
    run's measured tokens/s. The constant itself comes from the program that ran
    (``gpu_cost.CALIBRATION``), which launched more kernels per token than today's."""
    from configs import default
    from logra_jax.perf import gpu_cost, gpu_programs
    config = default.get_config()
    config.model.update(source="tiny", dtype="bfloat16", param_dtype="bfloat16")
    config.model.tiny.update(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                             intermediate_size=1536, max_position_embeddings=2048)
    config.rl.update(max_prompt_length=64, max_completion_length=128, rollout_micro_batch=0)
    measured = gpu_cost.CALIBRATION["measured_tokens_per_s"]
    out = {}
    for mode, tokens_per_s in measured.items():
        step = gpu_programs.decode_step(config, mesh, 1, mode)[0]
        out[mode] = dict(kernels_per_token=step.kernels, bytes_per_token=step.bytes,
                         measured_tokens_per_s=tokens_per_s,
                         seconds_per_kernel=1 / (tokens_per_s * step.kernels))
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g}"


def print_report(record) -> None:
    from launch.memory_report import gib
    print(record["header"])
    print(f"model: {record['model']['shape']}; mesh {record['mesh']}; per GPU")
    if "decode" in record:
        print(f"\ndecode step (one token for every row), per GPU; predicted tokens/s = batch ÷ "
              f"max(bytes ÷ {record['bandwidth'] / 1e12:.2f} TB/s, kernels × "
              f"{record['seconds_per_kernel'] * 1e6:.2f} µs)")
        head = (f"{'batch':>5} {'mode':<10} {'kernels/token':>13} {'/layer':>6} {'syncs/token':>11} "
                f"{'GB/token':>8} {'floor GB':>8} {'×floor':>6} {'tokens/s':>9}  bound")
        print(head)
        print("-" * len(head))
        for d in record["decode"]:
            mode = d["mode"] + ("*" if d["default"] else "")
            print(f"{d['batch']:>5} {mode:<10} {d['kernels_per_token']:>13.1f} "
                  f"{d['kernels_per_layer']:>6.1f} {d['host_syncs_per_token']:>11.3f} "
                  f"{_gb(d['bytes_per_token']):>8} {_gb(d['floor_bytes_per_token']):>8} "
                  f"{d['bytes_over_floor']:>6.2f} {d['predicted_tokens_per_s']:>9.0f}  "
                  f"{'launches' if d['launch_bound'] else 'bytes'}")
        print("* the mode a plan compiles for rl.decode_weights="
              f"{record['decode_weights']!r}; floor: the weights a step reads (an untied input "
              "embedding: its rows' entries only) + every slot of its rows' KV cache")
        for d in record["decode"]:
            kinds = ", ".join(f"{k} {v:g}" for k, v in d["kernels_by_kind"].items())
            print(f"  batch {d['batch']} {d['mode']}: {kinds}")
    if "update" in record:
        print("\nupdate, per GPU (loops as they run)")
        names = list(record["update"])
        print(f"{'':<16}" + "".join(f"{n:>16}" for n in names))
        for key, fmt in (("kernels", "{:>16,.0f}"), ("bytes", "{:>16.4g}"),
                         ("matmul_flops", "{:>16.4g}"), ("host_syncs", "{:>16.0f}")):
            print(f"{key:<16}" + "".join(fmt.format(record["update"][n][key]) for n in names))
        if len(names) > 1:
            a, b = (record["update"][n] for n in names[:2])
            print(f"{names[0]} / {names[1]}: kernels {a['kernels'] / b['kernels']:.3f}, bytes "
                  f"{a['bytes'] / b['bytes']:.3f}, matmul FLOPs {a['matmul_flops'] / b['matmul_flops']:.3f}")
    if "generate" in record:
        g = record["generate"]
        print(f"\ngenerate ({g['rows']} rows, {g['rows_per_pass']} per pass, "
              f"{record['decode_weights_plan']}): temporaries {gib(g['temp_bytes'])} GiB beside a KV "
              f"cache of {gib(g['kv_cache_bytes'])} GiB per GPU (XLA's memory analysis)")
    if "rollout" in record:
        print_rollout(record)
    if "calibration" in record:
        print("\nseconds per kernel: the H200 run's tokens/s over its program's kernels "
              "(and over today's program at its shape):")
        from logra_jax.perf.gpu_cost import CALIBRATION
        ran = CALIBRATION["kernels_per_token"]
        for mode, c in record["calibration"].items():
            print(f"  {mode}: {c['measured_tokens_per_s']} tokens/s measured, {ran[mode]} kernels/token "
                  f"→ {1e6 / (c['measured_tokens_per_s'] * ran[mode]):.3f} µs "
                  f"(today {c['kernels_per_token']:g} → {c['seconds_per_kernel'] * 1e6:.3f} µs)")


def print_rollout(record) -> None:
    r = record["rollout"]
    schedule, static, detail = r["schedule"], r["static"], r["static_detail"]
    lengths = sorted(schedule["lengths"])
    median = (lengths[(len(lengths) - 1) // 2] + lengths[len(lengths) // 2]) / 2
    how = (f"median {schedule['median']:g}, σ 1, capped at {schedule['cap']}, seed {schedule['seed']}"
           if schedule["kind"] == "lognormal" else "one length per row from the file")
    print(f"\nrollout of {detail['rows']} rows, completion lengths {schedule['spec']} ({how}): "
          f"{detail['kept_tokens']:,} tokens kept, median {median:g}, "
          f"longest {lengths[-1]}")
    print(f"static engine, per GPU: passes of {detail['rows_per_pass']} rows, each to the end of its "
          f"longest row in trips of {detail['tokens_per_loop_trip']} steps; a decode step "
          f"({detail['mode']}, {detail['rows_per_pass']} rows) {_gb(detail['bytes_per_step'])} GB, "
          f"{detail['kernels_per_step']:.1f} kernels; prefill not counted")
    head = f"{'pass':>4} {'rows':>5} {'longest':>7} {'token steps':>11} {'forward passes':>14}"
    print(head)
    print("-" * len(head))
    for j, p in enumerate(detail["passes"]):
        print(f"{j:>4} {p['rows']:>5} {p['longest']:>7} {p['token_steps']:>11} "
              f"{p['forward_passes']:>14}")
    head = (f"{'engine':<7} {'GB/kept token':>13} {'floor GB':>8} {'×floor':>6} "
            f"{'kernels/kept token':>18} {'efficiency':>10} {'decode steps':>12} {'seconds':>9}")
    print(head)
    print("-" * len(head))
    new, slot = r["new"], r["new_detail"]
    for name, figures, seconds in (("static", static, detail["predicted_seconds"]),
                                   ("new", new, slot["predicted_seconds"])):
        print(f"{name:<7} {_gb(figures['bytes_per_kept_token']):>13} "
              f"{_gb(figures['floor_bytes_per_kept_token']):>8} "
              f"{figures['bytes_per_kept_token'] / figures['floor_bytes_per_kept_token']:>6.2f} "
              f"{figures['kernels_per_kept_token']:>18.2f} {figures['efficiency']:>10.3f} "
              f"{figures['decode_steps']:>12} {seconds:>9.4g}")
    print(f"new/static: bytes per kept token "
          f"{new['bytes_per_kept_token'] / static['bytes_per_kept_token']:.3f}, kernels "
          f"{new['kernels_per_kept_token'] / static['kernels_per_kept_token']:.3f}, seconds "
          f"{slot['predicted_seconds'] / detail['predicted_seconds']:.3f}")
    print(f"new: the slot engine, {slot['slots']} decode slots and {slot['prompt_slots']} prompt "
          f"slots, refilled every {slot['tokens_per_chunk']} steps; {slot['groups']} groups "
          f"prefilled once each ({slot['prefill_tokens']:,} prompt tokens against the static "
          f"engine's {detail['prefill_tokens']:,}, not counted); decode steps by executed size: "
          + ", ".join(f"{s['slots']} slots × {s['steps']} ({_gb(s['bytes_per_step'])} GB, "
                      f"{s['kernels_per_step']:.0f} kernels)" for s in slot["sizes"])
          + "; the attention kernel's completion reads are the columns each slot attends to "
            "(the schedule's), not its operands whole")
    print(f"floor: the batch decoded as one, each row only while live (weights once per step, "
          f"each group's {record['model']['prompt_window']}-token prompt KV once, each live row's "
          f"completion KV so far); seconds predicted: forward passes × max(bytes ÷ "
          f"{record['bandwidth'] / 1e12:.2f} TB/s, kernels × {record['seconds_per_kernel'] * 1e6:.2f} µs)")


def main(argv):
    del argv
    from launch import process
    process.setup(8)   # the CPU backend jax starts beside the GPU targets; no run uses it
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # XLA:GPU compiles deviceless for the targets
    config = _CONFIG.value
    try:
        target = gpu_target(_TARGET.value)
        batches = parse_batches(_BATCHES.value)
        from logra_jax.perf import gpu_programs
        parse_modes(_MODES.value, gpu_programs.decode_modes())   # before minutes of compiling
        parts = list(dict.fromkeys(_PARTS.value))
        bad = [p for p in parts if p not in PARTS]
        if bad or not parts:
            raise ValueError(f"--parts {','.join(_PARTS.value)}: expected some of {', '.join(PARTS)}")
        if "rollout" in parts:   # the schedule checked before minutes of compiling
            if not _SCHEDULE.value:
                raise ValueError("--parts rollout needs --schedule: lognormal:M (e.g. lognormal:200) "
                                 "or a file of completion lengths, one per row")
            from logra_jax.perf import gpu_programs
            schedule, lengths = gpu_programs.completion_schedule(
                _SCHEDULE.value, config.data.prompts_per_step * config.rl.num_generations,
                config.rl.max_completion_length)
        devices = target.jax_devices()
        from logra_jax import model_shapes
        from logra_jax.perf import gpu_cost, gpu_programs
        from logra_jax.rl.build import build_mesh
        sizes = cli.parse_mesh(_MESH.value) if _MESH.value else {"fsdp": len(devices), "tensor": 1}
        mesh = build_mesh(sizes, devices, spare_devices=True)
        model = model_shapes.model_config_from(config.model)
        record = dict(
            target=target.name, compiler=target.compiler(),
            header=(f"compiler: {target.compiler()}; {target.describe(mesh.size)}; devices "
                    f"'{mesh.devices.flat[0].device_kind}'"),
            mesh=dict(mesh.shape), devices=mesh.size,
            model=dict(source=config.model.source, shape=(
                f"{config.model.source}: {model.num_layers} layers, width {model.hidden_size}, "
                f"vocabulary {model.vocab_size}; rollout {config.rl.max_prompt_length} + "
                f"{config.rl.max_completion_length} tokens"), layers=model.num_layers,
                vocab_size=model.vocab_size, hidden_size=model.hidden_size,
                prompt_window=config.rl.max_prompt_length),
            bandwidth=target.bandwidth_per_device, seconds_per_kernel=gpu_cost.SECONDS_PER_KERNEL,
            seconds_per_kernel_evidence=gpu_cost.CALIBRATION,
            decode_weights=config.rl.decode_weights)
        if "decode" in parts:
            modes = parse_modes(_MODES.value, gpu_programs.decode_modes())
            record["decode"], record["decode_weights_plan"] = gpu_programs.decode_figures(
                config, mesh, target, batches, modes)
        if "update" in parts:
            record["update"] = gpu_programs.update_figures(config, mesh)
        if "generate" in parts:
            rows = rows_per_step(config)
            record.setdefault("decode_weights_plan",
                              gpu_programs.default_decode_mode(config, mesh, rows))
            record["generate"] = gpu_programs.generate_figures(config, mesh)
        if "rollout" in parts:
            static, detail = gpu_programs.static_rollout(config, mesh, lengths)
            detail["predicted_seconds"] = detail["forward_passes"] * max(
                detail["bytes_per_step"] / target.bandwidth_per_device,
                detail["kernels_per_step"] * gpu_cost.SECONDS_PER_KERNEL)
            new, new_detail = gpu_programs.slot_rollout(config, mesh, lengths,
                                                        bandwidth=target.bandwidth_per_device)
            record["rollout"] = dict(schedule=schedule, static=static, new=new,
                                     static_detail=detail, new_detail=new_detail)
        if _CALIBRATE.value:
            record["calibration"] = calibration(build_mesh({"fsdp": 1, "tensor": 1}, devices[:1]))
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print_report(record)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(record, f, indent=1, default=lambda o: dataclasses.asdict(o))


if __name__ == "__main__":
    cli.run(main, required=("config",))
