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
beta > 0), the sampler's weights and, while sampling, its KV cache; `rl_resident_bytes` counts them.

`peak_breakdown` reads XLA's own account of the buffers live at the peak (the ``live-range`` file
of an HLO dump, with its buffer assignment and the program's op names): where the bytes go.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from logra_jax import model_shapes
from logra_jax import sharding as sharding_lib
from logra_jax.models import Decoder, ModelConfig
from logra_jax.optim import predicted_kl
from logra_jax.perf import machines, matmul_count, oom
from logra_jax.rl import build
from logra_jax.rl.policy import Policy, Sequences
from logra_jax.rl.sampler import Sampler
from logra_jax.rl.update import TrainBatch, update_compiler_options
from logra_jax.tree_paths import leaves_with_paths

GIB = 2 ** 30


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
# Abstract training state with the trainer's shardings
# ----------------------------------------------------------------------------------------------
def abstract_model(model_config: ModelConfig) -> nnx.Module:
    """The Decoder with ShapeDtypeStructs instead of arrays: no memory, any size."""
    return nnx.eval_shape(lambda: Decoder(model_config, rngs=nnx.Rngs(0)))


def abstract_params(model: nnx.Module, mesh: Mesh, rules=None) -> dict:
    """The params dict (Policy's view) as ShapeDtypeStructs sharded by their logical axes."""
    state = nnx.state(model, nnx.Param)

    def place(variable):
        value = variable.get_value()
        axes = sharding_lib.get_logical_axes(variable) or (None,) * len(value.shape)
        sharding = sharding_lib.logical_sharding(axes, mesh, rules, value.shape)
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

    placed = jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(placed)


def abstract_opt_state(tx, params):
    shardings = sharding_lib.opt_state_shardings(tx, params)
    shapes = jax.eval_shape(tx.init, params)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings)


def abstract_batch(mesh: Mesh, rows: int, prompt_length: int, completion_length: int) -> TrainBatch:
    """A TrainBatch of ShapeDtypeStructs, rows sharded over ``fsdp`` as the trainer shards them."""
    sharding = sharding_lib.batch_sharding(mesh, rows)
    total = prompt_length + completion_length

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    seqs = Sequences(tokens=spec((rows, total), jnp.int32), segment_mask=spec((rows, total), jnp.bool_),
                     positions=spec((rows, total), jnp.int32),
                     completion_mask=spec((rows, completion_length), jnp.bool_),
                     prompt_length=prompt_length)
    return TrainBatch(seqs=seqs, advantages=spec((rows,), jnp.float32),
                      rollout_logp=spec((rows, completion_length), jnp.float32),
                      ref_logp=spec((rows, completion_length), jnp.float32),
                      completed=spec((rows,), jnp.bool_))


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


# ----------------------------------------------------------------------------------------------
# One update step, compiled ahead of time
# ----------------------------------------------------------------------------------------------
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
        if name not in build.OPTIMIZERS or (dtype and dtype not in _DTYPES):
            raise ValueError(f"--compare {spec!r}: expected one of {', '.join(build.OPTIMIZERS)}, "
                             f"optionally with :bf16 or :fp32 (e.g. adamw,logra:fp32)")
        # LoRA's base, like LoGRA's weights, in the config's dtype or the column's :bf16 / :fp32.
        param_dtype = "float32" if name in build.DENSE_OPTIMIZERS else _DTYPES.get(dtype, own)
        label = name if param_dtype == own else f"{name}/{_SHORT[param_dtype]}"
        if label not in [c[0] for c in out]:
            out.append((label, name, param_dtype))
    return out


@dataclasses.dataclass(frozen=True)
class LoweredUpdate:
    """One update of a config lowered for a mesh's devices (not compiled), with its abstract inputs."""

    lowered: jax.stages.Lowered
    params: dict
    opt_state: object
    batch: TrainBatch
    optimizer: build.Optimizer
    micro_steps: int


def lower_update(config: ml_collections.ConfigDict, mesh: Mesh, *,
                 micro_steps: int | None = None) -> LoweredUpdate:
    """The trainer's update of ``config`` (model shape, optimizer, batch) lowered on ``mesh``'s
    devices with abstract inputs; no arrays. ``micro_steps`` as `update_step_memory`'s."""
    model_config = model_shapes.model_config_from(config.model)
    model = abstract_model(model_config)
    policy = Policy(model, lora_scale=build.lora_scale(config.optimizer))
    params = build.with_adapters(config.optimizer, abstract_params(model, mesh))
    optimizer = build.build_optimizer(config.optimizer, replayed_merge=build.replays_merge(config))
    update = build.build_policy_update(config, policy, optimizer=optimizer)
    opt_state = abstract_opt_state(update.tx, params[optimizer.subtree] if optimizer.subtree else params)

    rl = config.rl
    rows = config.data.prompts_per_step * rl.num_generations
    if micro_steps is not None:
        if micro_steps <= 0:
            raise ValueError(f"micro_steps must be positive, got {micro_steps}")
        rows = micro_steps * rl.micro_batch_size
    if rows % rl.micro_batch_size:
        raise ValueError(f"{rows} rows per update are not a multiple of rl.micro_batch_size="
                         f"{rl.micro_batch_size}")
    batch = abstract_batch(mesh, rows, rl.max_prompt_length, rl.max_completion_length)
    with predicted_kl.host_checks_left_out():   # a plan never runs: see there
        lowered = update.jitted(params, opt_state).lower(params, opt_state, batch)
    return LoweredUpdate(lowered, params, opt_state, batch, optimizer, rows // rl.micro_batch_size)


def update_step_memory(config: ml_collections.ConfigDict, mesh: Mesh, *, micro_steps: int | None = None,
                       dump_dir: str | pathlib.Path | None = None,
                       label: str | None = None, hoist_invariants: bool = True) -> StepMemory:
    """Compiles one update of ``config`` (model shape, optimizer, batch) on ``mesh``; no arrays.

    ``micro_steps`` sets the batch to that many micro-batches of ``rl.micro_batch_size`` rows
    (default: the config's prompts_per_step × num_generations rows). ``dump_dir`` keeps XLA's HLO
    dump of the step there (for `peak_breakdown`). ``label`` names the column (default: the
    optimizer's name). ``hoist_invariants=False`` disables XLA's while-loop-invariant code motion:
    the CPU backend runs bf16 dots in f32 and hoists the f32 converts of whole bf16 weight stacks
    out of the layer loops (+6.4 GiB per device at 7B with bf16 weights), which a GPU with native
    bf16 dots never does; for planning bf16-weight runs on GPUs.
    """
    update = lower_update(config, mesh, micro_steps=micro_steps)
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
                                             program=f"the {label or config.optimizer.name} update")
    except oom.DoesNotFit as e:
        raise e.with_arguments(device_bytes((params, opt_state, batch))) from None
    stats = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}   # XLA:GPU deviceless: None
    return StepMemory(
        optimizer=label or config.optimizer.name, devices=mesh.size, micro_steps=update.micro_steps,
        params=device_bytes(params), opt_state=device_bytes(opt_state), batch=device_bytes(batch),
        gradients=gradient_bytes(params[optimizer.subtree] if optimizer.subtree else params,
                                 optimizer.sketch, optimizer.train_others),
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

    reference: the frozen reference policy (bf16, on the training devices) when beta > 0.
    sampler_weights: the rollout engine's bf16 weights, on the rollout devices (0 when a colocated
      sampler reads the policy's bf16 params themselves).
    kv_cache: the sampler's cache for one pass over the rollout batch (compute dtype; the whole
      batch, or ``rl.rollout_micro_batch`` rows), on the rollout devices; it exists only while
      sampling.
    colocated: the rollout devices are the training devices (then all of it adds up there).
    """

    reference: int
    sampler_weights: int
    kv_cache: int
    rollout_devices: int
    colocated: bool


def _bf16(params) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding), params)


def kv_cache_bytes(model_config: ModelConfig, rows: int, length: int, mesh: Mesh) -> int:
    """Per-device bytes of the KVCache of ``rows`` sequences of ``length`` slots (rows over fsdp)."""
    shape = (model_config.num_layers, rows, length, model_config.num_kv_heads, model_config.head_dim)
    axis = "fsdp" if "fsdp" in mesh.shape and rows % mesh.shape["fsdp"] == 0 else None
    sharding = NamedSharding(mesh, P(None, axis))
    one = jax.ShapeDtypeStruct(shape, model_config.compute_dtype, sharding=sharding)
    return 2 * device_bytes(one)  # keys and values


def rl_resident_bytes(config: ml_collections.ConfigDict, training: Mesh, rollout: Mesh) -> LoopMemory:
    """Reference, sampler weights and KV cache per device for ``config``'s model and rollout batch.

    ``rollout`` is the sampler's mesh: the training mesh itself when colocated.
    """
    model_config = model_shapes.model_config_from(config.model)
    model = abstract_model(model_config)
    rl = config.rl
    reference = device_bytes(_bf16(abstract_params(model, training))) if rl.beta > 0 else 0
    rows = rl.rollout_micro_batch or config.data.prompts_per_step * rl.num_generations
    kv = kv_cache_bytes(model_config, rows, rl.max_prompt_length + rl.max_completion_length, rollout)
    colocated = set(rollout.devices.flat) == set(training.devices.flat)
    # A colocated sampler without a sync reads the policy's own params: bf16 params are its weights
    # (no copy); from fp32 params it holds a bf16 cast of them while it samples.
    shares = colocated and config.sync.mode == "off" and config.model.param_dtype == "bfloat16"
    sampler = 0 if shares else device_bytes(_bf16(abstract_params(model, rollout)))
    return LoopMemory(reference=reference, sampler_weights=sampler, kv_cache=kv,
                      rollout_devices=rollout.size, colocated=colocated)


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


@dataclasses.dataclass(frozen=True)
class LoweredGenerate:
    """The sampler's ``generate`` of a config lowered for a mesh's devices (not compiled), with its
    abstract inputs."""

    lowered: jax.stages.Lowered
    params: dict
    tokens: jax.ShapeDtypeStruct
    mask: jax.ShapeDtypeStruct
    rows: int
    decode_weights: str


def lower_generate(config: ml_collections.ConfigDict, mesh: Mesh, *, rows: int | None = None,
                   decode_weights: str | None = None) -> LoweredGenerate:
    """The sampler's ``generate`` of ``config`` lowered on ``mesh``'s devices with bf16 weights
    placed by their logical axes; no arrays. ``rows``: the batch (default: the config's rollout
    batch, prompts_per_step × num_generations rows), each with the prompt window plus the
    completion length of cache. ``decode_weights`` as `Sampler`'s, default ``rl.decode_weights``:
    nothing runs here, so "auto" plans stacked and logs that it did not measure
    (`decode_mode.UNMEASURED`)."""
    model_config = model_shapes.model_config_from(config.model)
    model = abstract_model(model_config)
    policy = Policy(model, lora_scale=build.lora_scale(config.optimizer))
    params = _bf16(build.with_adapters(config.optimizer, abstract_params(model, mesh)))
    rl = config.rl
    rows = rows or config.data.prompts_per_step * rl.num_generations
    decode_weights = decode_weights or rl.decode_weights
    sampler = Sampler(policy, max_prompt_length=rl.max_prompt_length,
                      max_completion_length=rl.max_completion_length, eos_ids=[0], pad_id=0,
                      decode_weights=decode_weights, rows_per_pass=rl.rollout_micro_batch)
    on_rows = sharding_lib.batch_sharding(mesh, rows)
    replicated = NamedSharding(mesh, P())
    tokens = jax.ShapeDtypeStruct((rows, rl.max_prompt_length), jnp.int32, sharding=on_rows)
    mask = jax.ShapeDtypeStruct((rows, rl.max_prompt_length), jnp.bool_, sharding=on_rows)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
    temperature = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    lowered = sampler._generate.lower(params, tokens, mask, key, temperature, top_k=int(rl.top_k),
                                      top_p=float(rl.top_p), greedy=False,
                                      mesh=sampler.mesh_of(params, tokens))
    return LoweredGenerate(lowered, params, tokens, mask, rows, decode_weights)


def rollout_step_memory(config: ml_collections.ConfigDict, mesh: Mesh, *,
                        decode_weights: str | None = None) -> RolloutMemory:
    """Compiles the sampler's ``generate`` for ``config``'s rollout batch (`lower_generate`) on
    ``mesh`` and reads XLA's memory analysis; no arrays."""
    rl = config.rl
    generate = lower_generate(config, mesh, decode_weights=decode_weights)
    rows, params = generate.rows, generate.params
    try:
        stats = oom.compile_or_refuse(
            generate.lowered, program=f"the sampler's generate ({rows} rows)",
            compiler_options=machines.compiler_options_for(mesh) or None).memory_analysis()
    except oom.DoesNotFit as e:
        raise e.with_arguments(device_bytes((params, generate.tokens, generate.mask))) from None
    return RolloutMemory(rows=rows, rows_per_pass=rl.rollout_micro_batch or rows,
                         weights=device_bytes(params),
                         arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
                         temporaries=stats.temp_size_in_bytes)


def rl_footprint(step: StepMemory, loop: LoopMemory,
                 rollout: RolloutMemory | None = None) -> dict[str, int]:
    """Per training device: the update phase, the rollout phase and the larger of the two.

    update phase  = update peak + reference (+ sampler weights when colocated)
    rollout phase = params + optimizer state + reference (+ sampler weights + KV cache when colocated)

    With ``rollout`` (the compiled ``generate``) and a colocated sampler, the rollout phase's
    sampler part is the compiled peak instead of weights + KV cache from shapes: params + optimizer
    state + reference + generate's peak, less its weights where the sampler reads the policy's own
    bf16 params (``loop.sampler_weights`` is 0 then).
    """
    shared = loop.reference + (loop.sampler_weights if loop.colocated else 0)
    update = step.peak + shared
    rollout_phase = step.params + step.opt_state + shared + (loop.kv_cache if loop.colocated else 0)
    if rollout is not None and loop.colocated:
        rollout_phase = (step.params + step.opt_state + loop.reference + rollout.peak
                         - rollout.weights + loop.sampler_weights)
    return {"update": update, "rollout": rollout_phase, "total": max(update, rollout_phase)}


# ----------------------------------------------------------------------------------------------
# Where the bytes go: XLA's account of the buffers live at the peak
# ----------------------------------------------------------------------------------------------
_LIVE_LINE = re.compile(r"^\s+(?P<name>[^\s{]+)(?P<index>\{[\d,]*\}): (?P<bytes>\d+) bytes")
_VALUE_LINE = re.compile(r"^\s*value: <\d+ (?P<name>[^\s{]+)(?P<index>\{[\d,]*\})?(?: \(\w+\))? @\d+> "
                         r"\(size=(?P<size>\d+),offset=(?P<offset>\d+)\): (?P<shape>\S+)")
_OP_NAME = re.compile(r'^\s*(?:ROOT )?%(?P<name>\S+) = .*?metadata=\{op_name="(?P<op>(?:[^"\\]|\\.)*)"', re.M)


def _value_places(buffer_assignment: str) -> dict[str, tuple[int, int, int, str]]:
    """Each value's (allocation, offset, size, shape), by its name and tuple index, for the
    allocations in the default memory space (HBM, or host memory on CPU); a TPU's other memory
    spaces are printed with a ``color`` and hold no HBM bytes."""
    places, allocation = {}, None
    for line in buffer_assignment.splitlines():
        if line.startswith("allocation "):
            allocation = None if ", color " in line else int(line.split()[1].rstrip(":"))
            continue
        match = _VALUE_LINE.match(line)
        if match and allocation is not None:
            key = match["name"] + (match["index"] or "{}")
            places.setdefault(key, (allocation, int(match["offset"]), int(match["size"]), match["shape"]))
    return places


def _op_label(op_name: str) -> str:
    """A JAX op's name scope as it is; a parameter's pytree path ``params['mlp']['kernel']`` as
    ``params/mlp/kernel``."""
    op_name = op_name.replace("\\'", "'")
    return re.sub(r"\['([^']*)'\]", r"/\1", op_name)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges [begin, end) merged into disjoint ones."""
    out: list[tuple[int, int]] = []
    for begin, end in sorted(spans):
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def peak_breakdown(dump_dir: str | pathlib.Path, module: str = "_step_impl") -> tuple[int, list[tuple[str, int]]]:
    """(bytes live at the peak, [(buffer label, bytes)] largest first).

    Read from an HLO dump made with ``update_step_memory(..., dump_dir=...)``: XLA's
    ``*-live-range.txt`` lists the values live at the peak, the buffer assignment says which bytes
    of which allocation each one occupies, and the optimized program's metadata names the JAX op
    (or the parameter's path, e.g. ``params/layers/mlp/up_proj/kernel``) that made it; the label
    is that name and the buffer's shape, else the HLO instruction's name. Bytes are counted once:
    a loop's carried values share the buffers of the values outside the loop, and the TPU
    compiler lists both (its own "stack trace breakdown" adds them up: 8.2 GiB at a 4.9 GiB peak).
    """
    dump_dir = pathlib.Path(dump_dir)
    ranges = sorted(dump_dir.glob(f"*{module}*live-range.txt"))
    if not ranges:
        raise FileNotFoundError(f"no XLA live-range file for {module!r} in {dump_dir} (compile with "
                                f"update_step_memory(..., dump_dir=...))")
    stem = ranges[-1].name.removesuffix("-live-range.txt")
    places = _value_places((dump_dir / f"{stem}-buffer-assignment.txt").read_text())
    ops = {m["name"]: _op_label(m["op"]) for m in _OP_NAME.finditer((dump_dir / f"{stem}.txt").read_text())}
    lines = ranges[-1].read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().endswith("(peak):")), None)
    if start is None:
        raise ValueError(f"{ranges[-1]} has no 'Live ranges at ... (peak)' section")
    live = [m for m in map(_LIVE_LINE.match, lines[start + 1:]) if m]   # the section's lines
    live = [(m["name"], places[m["name"] + m["index"]]) for m in live if m["name"] + m["index"] in places]
    live.sort(key=lambda v: v[0] not in ops)     # values with a JAX name claim shared bytes first
    covered: dict[int, list[tuple[int, int]]] = {}
    sizes: dict[str, int] = {}
    for name, (allocation, offset, size, shape) in live:
        spans = covered.setdefault(allocation, [])   # disjoint byte ranges already counted
        new = size - sum(max(0, min(offset + size, end) - max(offset, begin)) for begin, end in spans)
        covered[allocation] = _merged(spans + [(offset, offset + size)])
        if new > 0:
            label = f"{ops.get(name, name)} {shape.split('{')[0]}"   # the shape without its layout
            sizes[label] = sizes.get(label, 0) + new
    entries = sorted(sizes.items(), key=lambda e: -e[1])
    return sum(sizes.values()), entries


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------
def gib(n: int) -> str:
    """GiB with two decimals; three significant digits below 0.01 GiB (tiny test models)."""
    value = n / GIB
    return f"{value:.2f}" if value >= 0.00995 or value == 0 else f"{value:.3g}"


def format_table(steps: list[StepMemory], loops: list[LoopMemory] | LoopMemory | None = None,
                 rollouts: list[RolloutMemory] | None = None, unit: str = "device") -> str:
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
        rows.append(("+ reference (bf16)", [gib(loop.reference) for loop in loops]))
        where = "colocated" if loops[0].colocated else f"own {loops[0].rollout_devices} devices"
        rows.append((f"sampler bf16 ({where})", [gib(loop.sampler_weights) for loop in loops]))
        if rollouts is not None and rollouts[0].rows_per_pass < rollouts[0].rows:
            where += f", {rollouts[0].rows_per_pass} of {rollouts[0].rows} rows per pass"
        rows.append((f"KV cache ({where})", [gib(loop.kv_cache) for loop in loops]))
        if rollouts is not None:
            rows.append((f"generate temporaries ({where}, XLA)",
                         [gib(r.temporaries) for r in rollouts]))
            rows.append((f"generate peak ({where}, XLA)", [gib(r.peak) for r in rollouts]))
        phases = [rl_footprint(s, loop, r)
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
