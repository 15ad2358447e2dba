"""Per-device memory of one policy update, ahead of time, for any model shape (no hardware needed).

The update measured is the trainer's own: `PolicyUpdate` (micro-batched gradients with remat →
optimizer → in-place merge → realized KL on the probe) jitted with donated params and optimizer
state, lowered on abstract inputs (``jax.ShapeDtypeStruct`` with shardings) and compiled by XLA for
the simulated devices. ``compiled.memory_analysis()`` then gives, per device,

    peak = arguments + outputs − aliased (donated) outputs + temporaries

where arguments are the params, optimizer state and batch, and temporaries are every buffer XLA
allocates inside the step (gradients or sketches, activations, gathered weights, logits). Params,
optimizer state and gradient bytes are also computed from shapes and shardings, so the table can
say what the temporaries hold. The RL loop keeps more than the update: a reference model (when
the algorithm's loss reads one), the sampler's weights and, while sampling, its KV cache;
`rl_resident_bytes` counts them.

Every program and abstract array comes from the run's own assembly, made once per column on the
trainer's own meshes (plan.py: `Plan`, from `Recipe.abstract`), so a plan holds exactly what the
trainer builds. Where the bytes at the peak go
is read from an HLO dump by hlo_dump.py; the tables are launch/memory_report.py's.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from logra_jax import sharding as sharding_lib
from logra_jax.models import ModelConfig
from logra_jax.perf import machines, matmul_count, oom
from logra_jax.rl import optimizers
from logra_jax.perf.plan import LoweredGenerate, LoweredUpdate, Plan
from logra_jax.rl.update import update_compiler_options
from logra_jax.tree_paths import leaves_with_paths


# ----------------------------------------------------------------------------------------------
# Bytes of (abstract) arrays on one device
# ----------------------------------------------------------------------------------------------
def device_bytes(tree) -> int:
    """Bytes one device holds of every array in ``tree`` (its shard; the whole array if unsharded).

    Uneven shardings are counted by their largest shard, i.e. the device that holds the most.
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


# ----------------------------------------------------------------------------------------------
# One update step, compiled ahead of time
# ----------------------------------------------------------------------------------------------
def gradient_bytes(params, sketch, train_others: bool) -> int:
    """Per-device bytes of one gradient tree of the step, from shapes.

    Dense optimizer: a params-shaped tree (LoRA: the adapters' tree is passed). LoGRA: one fp32 sketch (*stack, out, r) per target,
    sharded as PolicyUpdate constrains it (`sketch_shardings`), plus dense gradients of the
    non-targets when they are trained.
    """
    if sketch is None:
        return device_bytes(params)
    layouts = sharding_lib.sketch_shardings(params, sketch)
    total = 0
    for path, leaf in leaves_with_paths(params):
        if sketch.is_target(path):
            info = sketch.info(path, tuple(leaf.shape))
            total += device_bytes(jax.ShapeDtypeStruct(info.sketch_shape, jnp.float32,
                                                       sharding=layouts.get(path)))
        elif train_others:
            total += device_bytes(leaf)
    return total


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Per-device bytes of one compiled policy update (see the module docstring)."""

    optimizer: str
    devices: int
    micro_steps: int
    params: int          # from shapes and shardings
    opt_state: int       # from shapes and shardings
    batch: int           # from shapes and shardings
    gradients: int       # one gradient tree (sketches + dense non-target grads, or dense grads)
    arguments: int       # XLA: params + opt_state + batch as the executable sees them
    outputs: int         # XLA
    aliased: int         # XLA: outputs written into donated arguments
    temporaries: int     # XLA
    code: int            # XLA: generated code
    flops: float = 0.0             # matmul FLOPs per device, loops as they run (perf/matmul_count.py)
    bytes_accessed: float = 0.0    # XLA's cost analysis: each loop body counted once (a lower bound)

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @property
    def other_temporaries(self) -> int:
        """Temporaries that are not the gradient tree: activations, gathered weights, logits, ..."""
        return self.temporaries - self.gradients


_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
_SHORT = {v: k for k, v in _DTYPES.items()}


def columns(config: ml_collections.ConfigDict, compare) -> list[tuple[str, str, str]]:
    """(label, optimizer, param_dtype) per column of a memory report: the config's own first, then
    ``compare``'s ('logra' or a dense baseline — adamw, adafactor, galore — optionally ':bf16' /
    ':fp32' weights for LoGRA). The dense baselines are always the usual mixed precision: fp32
    master weights and optimizer state."""
    own = config.model.param_dtype
    out = []
    for spec in [config.optimizer.name] + list(compare or []):
        name, _, dtype = spec.partition(":")
        if name not in optimizers.names() or (dtype and dtype not in _DTYPES):
            raise ValueError(f"--compare {spec!r}: expected one of {', '.join(optimizers.names())}, "
                             f"optionally with :bf16 or :fp32 (e.g. adamw,logra:fp32)")
        # LoRA's base, like LoGRA's weights, in the config's dtype or the column's :bf16 / :fp32.
        param_dtype = optimizers.get(name).master_weights or _DTYPES.get(dtype, own)
        label = name if param_dtype == own else f"{name}/{_SHORT[param_dtype]}"
        if label not in [c[0] for c in out]:
            out.append((label, name, param_dtype))
    return out


def lower_update(config: ml_collections.ConfigDict, mesh: Mesh, *,
                 micro_steps: int | None = None) -> LoweredUpdate:
    """The trainer's update of ``config`` lowered on ``mesh`` (`Plan.lower_update`)."""
    return Plan.on(config, mesh).lower_update(micro_steps)


def update_step_memory(config: ml_collections.ConfigDict, mesh: Mesh, *, micro_steps: int | None = None,
                       dump_dir: str | pathlib.Path | None = None,
                       label: str | None = None, hoist_invariants: bool = True) -> StepMemory:
    """Compiles one update of ``config`` (model shape, optimizer, batch) on ``mesh``; no arrays.

    ``micro_steps`` sets the batch to that many micro-batches of ``rl.micro_batch_size`` rows
    (default: the config's prompts_per_step × num_generations rows). ``dump_dir`` keeps XLA's HLO
    dump of the step there (for `hlo_dump.peak_breakdown`). ``label`` names the column (default: the
    optimizer's name). ``hoist_invariants=False`` disables XLA's while-loop-invariant code motion:
    the CPU backend runs bf16 dots in f32 and hoists the f32 converts of whole bf16 weight stacks
    out of the layer loops (+6.4 GiB per device at 7B with bf16 weights), which a GPU with native
    bf16 dots never does; for planning bf16-weight runs on GPUs.
    """
    return update_memory(lower_update(config, mesh, micro_steps=micro_steps), mesh,
                         label=label or config.optimizer.name, dump_dir=dump_dir,
                         hoist_invariants=hoist_invariants)


def update_memory(update: LoweredUpdate, mesh: Mesh, *, label: str,
                  dump_dir: str | pathlib.Path | None = None,
                  hoist_invariants: bool = True) -> StepMemory:
    """Compiles a lowered update (`Plan.lower_update`) on ``mesh``: its `StepMemory`, the column
    named ``label``. ``dump_dir``, ``hoist_invariants``: as `update_step_memory`'s."""
    params, opt_state, batch, optimizer = update.params, update.opt_state, update.batch, update.optimizer
    options = dict(machines.compiler_options_for(mesh))
    if dump_dir is not None:
        options.update({"xla_dump_to": str(dump_dir), "xla_dump_hlo_as_text": True,
                        "xla_dump_hlo_module_re": ".*_step_impl.*"})
    if not hoist_invariants:   # added to the update's own disabled passes (this option replaces them)
        options["xla_disable_hlo_passes"] = ",".join(filter(None, [
            update_compiler_options(params).get("xla_disable_hlo_passes"),
            "while-loop-invariant-code-motion"]))
    try:
        compiled = oom.compile_or_refuse(update.lowered, compiler_options=options or None,
                                             program=f"the {label} update")
    except oom.DoesNotFit as e:
        raise e.with_arguments(device_bytes((params, opt_state, batch))) from None
    stats = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}   # XLA:GPU deviceless: None
    return StepMemory(
        optimizer=label, devices=mesh.size, micro_steps=update.micro_steps,
        params=device_bytes(params), opt_state=device_bytes(opt_state), batch=device_bytes(batch),
        gradients=gradient_bytes(optimizer.trained(params), optimizer.sketch, optimizer.train_others),
        arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
        aliased=stats.alias_size_in_bytes, temporaries=stats.temp_size_in_bytes,
        code=stats.generated_code_size_in_bytes, flops=matmul_count.of_compiled(compiled).flops,
        bytes_accessed=float(cost.get("bytes accessed", 0.0)))


# ----------------------------------------------------------------------------------------------
# What the RL loop keeps besides the update
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoopMemory:
    """Per-device bytes the RL loop holds besides the update step.

    reference: the frozen reference model, on the training devices, when the algorithm's loss
      reads one (GRPO with beta > 0), in ``reference_dtype``, the compute dtype.
    sampler_weights: the rollout engine's bf16 weights, on the rollout devices (0 when a colocated
      sampler reads the policy's bf16 params themselves).
    kv_cache: the sampler's cache (compute dtype, `rollout_kv_bytes`: one static pass of the
      whole batch or ``rl.rollout_micro_batch`` rows, or the slot engine's prompt and completion
      segments), on the rollout devices; it exists only while sampling.
    colocated: the rollout devices are the training devices (then all of it adds up there).
    queued_rollouts: the rollouts sampled ahead under ``rl.max_lag`` = η (rl/pipeline.py), held
      on the training devices between steps and through both phases: η rollouts' arrays
      (`queued_rollout_bytes`).
    """

    reference: int
    sampler_weights: int
    kv_cache: int
    rollout_devices: int
    colocated: bool
    reference_dtype: str = "bfloat16"
    queued_rollouts: int = 0


def kv_cache_bytes(model_config: ModelConfig, rows: int, length: int, mesh: Mesh) -> int:
    """Per-device bytes of the KVCache of ``rows`` sequences of ``length`` slots (rows over fsdp)."""
    shape = (model_config.num_layers, rows, length, model_config.num_kv_heads, model_config.head_dim)
    axis = "fsdp" if "fsdp" in mesh.shape and rows % mesh.shape["fsdp"] == 0 else None
    sharding = NamedSharding(mesh, P(None, axis))
    one = jax.ShapeDtypeStruct(shape, model_config.compute_dtype, sharding=sharding)
    return 2 * device_bytes(one)  # keys and values


def rollout_kv_bytes(config: ml_collections.ConfigDict, model_config: ModelConfig, rows: int,
                     mesh: Mesh) -> int:
    """Per-device bytes of the sampler's KV cache for a rollout of ``rows`` rows:

    - the static engine: one pass (``rl.rollout_micro_batch`` rows, or all), each row holding its
      prompt window and completion, rows × (P + C) tokens;
    - the slot engine: each prompt slot one group's prompt window, each decode slot one row's
      completion (C rounded up to `kv_segments.BLOCK`): prompt slots × P + slots × C tokens; for
      a batch in one set of slots, groups × P + rows × C, against rows × (P + C) = G·(P + C)
      per group."""
    rl = config.rl
    prompt, completion = rl.max_prompt_length, rl.max_completion_length
    if rl.rollout_engine != "slots":
        return kv_cache_bytes(model_config, rl.rollout_micro_batch or rows, prompt + completion, mesh)
    from logra_jax.models.kv_segments import BLOCK
    from logra_jax.rl.sampler.slots import default_prompt_slots
    slots = rl.rollout_slots or rows
    prompt_slots = default_prompt_slots(rows, slots, rl.num_generations)
    return (kv_cache_bytes(model_config, prompt_slots, prompt, mesh)
            + kv_cache_bytes(model_config, slots, -(-completion // BLOCK) * BLOCK, mesh))


def queued_rollout_bytes(config: ml_collections.ConfigDict, rows: int, mesh: Mesh) -> int:
    """Per-device bytes of the ``rl.max_lag`` = η rollouts a pipelined run holds between steps
    (`pipeline.RolloutQueue`), rows over the mesh's batch sharding: each rollout's token,
    segment-mask and position arrays [rows, P + C] (int32, bool, int32), its completion mask and
    behaviour log-probs [rows, C] (bool, float32), and its completed flags and token steps
    [rows] (bool, int32). Its rewards are host arrays."""
    rl = config.rl
    if not rl.max_lag:
        return 0
    window, completion = rl.max_prompt_length + rl.max_completion_length, rl.max_completion_length
    arrays = [((rows, window), jnp.int32), ((rows, window), jnp.bool_), ((rows, window), jnp.int32),
              ((rows, completion), jnp.bool_), ((rows, completion), jnp.float32),
              ((rows,), jnp.bool_), ((rows,), jnp.int32)]
    return rl.max_lag * sum(
        device_bytes(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_lib.batch_sharding(mesh, rows)))
        for shape, dtype in arrays)


def rl_resident_bytes(config: ml_collections.ConfigDict, training: Mesh, rollout: Mesh) -> LoopMemory:
    """`resident_bytes` of ``config`` on ``training`` and ``rollout`` (the sampler's mesh: the
    training mesh itself when colocated)."""
    return resident_bytes(Plan.on(config, training, rollout))


def resident_bytes(plan: Plan) -> LoopMemory:
    """Reference, sampler weights and KV cache per device for a plan's model and rollout batch,
    the sampler's on the mesh it samples on (`Plan.sampler_mesh`)."""
    config = plan.config
    rl = config.rl
    reference = device_bytes(plan.reference) if plan.reference is not None else 0
    kv = rollout_kv_bytes(config, plan.model_config, plan.rows, plan.sampler_mesh)
    colocated = set(plan.sampler_mesh.devices.flat) == set(plan.mesh.devices.flat)
    # A colocated sampler without a sync reads the policy's own params: bf16 params are its weights
    # (no copy); from fp32 params it holds a bf16 cast of them while it samples.
    shares = colocated and config.sync.mode == "off" and config.model.param_dtype == "bfloat16"
    weights = plan.sampler_weights()
    sampler = 0 if shares else device_bytes({k: weights[k] for k in plan.model_params})
    return LoopMemory(reference=reference, sampler_weights=sampler, kv_cache=kv,
                      rollout_devices=plan.sampler_mesh.size, colocated=colocated,
                      reference_dtype=config.model.dtype,
                      queued_rollouts=queued_rollout_bytes(config, plan.rows, plan.mesh))


@dataclasses.dataclass(frozen=True)
class RolloutMemory:
    """Per-device bytes of the sampler's compiled ``generate`` for one rollout batch: its arguments
    (the bf16 weights it samples with, the prompts), outputs and temporaries (the KV cache, the
    decode's activations and logits)."""

    rows: int
    rows_per_pass: int    # rl.rollout_micro_batch, or all rows: what the KV cache holds at once
    weights: int          # from shapes and shardings: the sampler's weights among the arguments
    arguments: int        # XLA
    outputs: int          # XLA
    temporaries: int      # XLA

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs + self.temporaries


def lower_generate(config: ml_collections.ConfigDict, mesh: Mesh, *, rows: int | None = None,
                   decode_weights: str | None = None) -> LoweredGenerate:
    """The trainer's sampler of ``config`` lowered on ``mesh`` (`Plan.lower_generate`)."""
    return Plan.on(config, mesh).lower_generate(rows, decode_weights)


def rollout_step_memory(config: ml_collections.ConfigDict, mesh: Mesh, *,
                        decode_weights: str | None = None,
                        dump_dir: str | pathlib.Path | None = None) -> RolloutMemory:
    """Compiles the sampler's ``generate`` for ``config``'s rollout batch on ``mesh``
    (`lower_generate`); no arrays. ``dump_dir`` keeps XLA's HLO dump of it there (for
    `hlo_dump.peak_breakdown(dump_dir, module="generate")`)."""
    return generate_memory(lower_generate(config, mesh, decode_weights=decode_weights), mesh,
                           dump_dir=dump_dir)


def generate_memory(generate: LoweredGenerate, mesh: Mesh, *,
                    dump_dir: str | pathlib.Path | None = None) -> RolloutMemory:
    """Compiles a lowered generate (`Plan.lower_generate`) on ``mesh``, the sampler's: its
    `RolloutMemory`. ``dump_dir`` as `rollout_step_memory`'s."""
    options = dict(machines.compiler_options_for(mesh))
    if dump_dir is not None:
        options.update({"xla_dump_to": str(dump_dir), "xla_dump_hlo_as_text": True,
                        "xla_dump_hlo_module_re": ".*generate.*"})
    try:
        stats = oom.compile_or_refuse(
            generate.lowered, program=f"the sampler's generate ({generate.rows} rows)",
            compiler_options=options or None).memory_analysis()
    except oom.DoesNotFit as e:
        raise e.with_arguments(device_bytes((generate.weights, *generate.prompts))) from None
    return RolloutMemory(rows=generate.rows, rows_per_pass=generate.rows_per_pass,
                         weights=device_bytes(generate.weights),
                         arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
                         temporaries=stats.temp_size_in_bytes)


def rl_footprint(step: StepMemory, loop: LoopMemory,
                 rollout: RolloutMemory | None = None) -> dict[str, int]:
    """Per training device: the update phase, the rollout phase and the larger of the two.

    update phase  = update peak + reference + queued rollouts (+ sampler weights when colocated)
    rollout phase = params + optimizer state + reference + queued rollouts
                    (+ sampler weights + KV cache when colocated)

    With ``rollout`` (the compiled ``generate``) and a colocated sampler, the rollout phase's
    sampler part is the compiled peak instead of weights + KV cache from shapes: params + optimizer
    state + reference + generate's peak, less its weights where the sampler reads the policy's own
    bf16 params (``loop.sampler_weights`` is 0 then).
    """
    shared = (loop.reference + loop.queued_rollouts
              + (loop.sampler_weights if loop.colocated else 0))
    update = step.peak + shared
    rollout_phase = step.params + step.opt_state + shared + (loop.kv_cache if loop.colocated else 0)
    if rollout is not None and loop.colocated:
        rollout_phase = (step.params + step.opt_state + loop.reference + loop.queued_rollouts
                         + rollout.peak - rollout.weights + loop.sampler_weights)
    return {"update": update, "rollout": rollout_phase, "total": max(update, rollout_phase)}
