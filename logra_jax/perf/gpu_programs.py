"""A config's sampler and update as XLA:GPU compiles them, and what they cost per GPU.

`launch.cost` prints these figures and tests keep bounds on them. Each program is lowered as the
memory planner lowers it (memory.py: ``lower_generate``, ``lower_update``), compiled for a mesh
of a GPU target's devices without a GPU, and read by gpu_cost.py:

- a decode step (one token for every row) of the compiled ``generate``, found in its token loop:
  kernels (and by kind), kernels per layer, host syncs, bytes against the whole-cache floor, and the
  predicted tokens/s (gpu_cost.predicted_tokens_per_s);
- the update, the config's optimizer beside AdamW: kernels, bytes, matmul FLOPs;
- the config's own rollout pass: XLA's temporaries beside its KV cache;
- a whole rollout of the config's batch by the static engine, for a schedule of completion
  lengths (`completion_schedule`, `static_rollout`): bytes and kernels per kept token against
  the true floor, and the share of the executed row-steps that drew a kept token.

**Per layer.** From 3 layers on, XLA's kernels per decode step grow by the same amount for every
layer a model has (measured, both modes: Qwen2.5-1.5B's shape at 3, 4 and 28 layers; SmolLM2-135M's
at 3–6, 8 and 30; a 2-layer stacked program differs, a 1-layer one more). The figure per layer is
that amount: the step at 4 layers less the step at 3, of the same model (a published shape's fields
on the tiny source, with tiny's vocabulary: the vocabulary does not enter a layer).

**The weights a decode step reads**, per GPU (`weight_bytes_read`): its share of the bf16 weights
(read once over the mesh: each GPU reads what it holds, as XLA's FSDP decode does, or gathers as
much from the others), except an untied input-embedding table, of which a step looks up only its
rows' entries (rows × one row's share). A tied table is the head and is read whole.

**Two floors.** The decode part's ``floor_bytes_per_token`` is the whole-cache floor of today's
program: those weights once plus every slot of its rows' KV cache once (the static program's
attention reads every slot, masked). The true floor of a step (`true_floor_bytes`) reads only
what the step's tokens attend to: the weights once, each group's prompt KV once (a group's rows
share one prompt), and each live row's own completion KV so far.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import ml_collections
import numpy as np

from logra_jax import model_shapes
from logra_jax.perf import gpu_cost, machines, memory, oom
from logra_jax.rl.sampler import Sampler
from logra_jax.tree_paths import leaves_with_paths

MARGINAL_LAYERS = (3, 4)


def decode_modes() -> list[str]:
    """The decode modes a GPU run can use: the Sampler's, less "auto" (which picks one of them)."""
    return [mode for mode in Sampler.DECODE_WEIGHTS if mode != "auto"]


def with_layers(config: ml_collections.ConfigDict, layers: int) -> ml_collections.ConfigDict:
    """``config`` with a ``layers``-deep model, its shape otherwise the same. A published shape
    (``shape:`` / ``random:``) becomes the ``tiny`` source with the shape's fields, and so tiny's
    vocabulary: for differences between layer counts, not for a whole step."""
    out = config.copy_and_resolve_references()
    source = out.model.source
    if model_shapes.is_shape_source(source) or model_shapes.is_random_source(source):
        name = source.split(":", 1)[1]
        if name not in model_shapes.MODEL_SHAPES:
            raise ValueError(f"unknown model shape {name!r}; known: {sorted(model_shapes.MODEL_SHAPES)}")
        fields = dict(model_shapes.MODEL_SHAPES[name])
        del fields["vocab_size"]
        out.model.source = "tiny"
        out.model.tiny = fields
    elif source != "tiny":
        raise ValueError(f"model.source={source!r} has weights, not a shape: compile a shape "
                         f"('shape:<name>', 'random:<name>' or 'tiny')")
    out.model.tiny.num_layers = layers
    if out.model.tiny.get("layer_types"):
        out.model.tiny.layer_types = tuple(out.model.tiny.layer_types)[:layers]
    return out


def one_pass(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config with the whole batch in one pass: a decode figure's batch is one pass."""
    out = config.copy_and_resolve_references()
    out.rl.rollout_micro_batch = 0
    return out


def compile_for(lowered, mesh, what: str):
    """XLA:GPU's program of ``lowered``; a compiler failure as a ValueError naming ``what``."""
    try:
        return oom.compile_or_refuse(lowered, compiler_options=machines.compiler_options_for(mesh),
                                     program=what)
    except jax.errors.JaxRuntimeError as e:
        raise ValueError(f"XLA:GPU could not compile {what}: {str(e).splitlines()[0]}") from None


def default_decode_mode(config: ml_collections.ConfigDict, mesh, rows: int) -> str:
    """The mode ``generate`` lowers to for the config's own ``rl.decode_weights`` where nothing
    runs (a plan): the mode whose lowered program it is."""
    own = config.rl.decode_weights
    if own != "auto":
        return own
    text = memory.lower_generate(config, mesh, rows=rows).lowered.as_text()
    for mode in decode_modes():
        if memory.lower_generate(config, mesh, rows=rows, decode_weights=mode).lowered.as_text() == text:
            return mode
    raise RuntimeError("decode_weights=auto lowered to none of the modes' programs")


INPUT_EMBEDDING = "embed_tokens/embedding"   # the table a decode step looks its tokens up in


def weight_bytes_read(weights: dict, model, rows: int) -> int:
    """Per GPU, the bytes of ``weights`` (the sampler's, as `memory.lower_generate` lays them
    out) that a decode step of ``rows`` rows reads: all of them, except that of an untied input
    embedding only the rows it looks up, ``rows`` × one row's share of this GPU's part."""
    held = memory.device_bytes(weights)
    if model.tie_embeddings:
        return held   # the table is also the head: the step reads it whole
    tables = [leaf for path, leaf in leaves_with_paths(weights) if path == INPUT_EMBEDDING]
    if len(tables) != 1:
        raise ValueError(f"an untied model's weights hold no {INPUT_EMBEDDING!r} table")
    table = memory.device_bytes(tables[0])
    return held - table + rows * table // model.vocab_size


class DecodeProgram(NamedTuple):
    """A compiled ``generate``'s decode step and what the floors count, per GPU."""

    step: gpu_cost.StepCost
    temp_bytes: int          # XLA's temporaries of the whole program
    weight_bytes: int        # the weights the GPU holds
    weight_bytes_read: int   # what a decode step must read of them (`weight_bytes_read`)
    kv_cache_bytes: int      # its rows' whole cache: prompt window + completion, every slot
    weights: dict            # the abstract weights ``generate`` samples with


_STEPS: dict = {}   # one compile per (model, rollout settings, mesh, rows, mode)


def decode_step(config: ml_collections.ConfigDict, mesh, rows: int, mode: str) -> DecodeProgram:
    """One decode step of the config's ``generate`` for ``rows`` rows in ``mode``, per GPU."""
    key = (str(config.model), str(config.rl), str(mesh), rows, mode)
    if key not in _STEPS:
        model = model_shapes.model_config_from(config.model)
        generate = memory.lower_generate(config, mesh, rows=rows, decode_weights=mode)
        compiled = compile_for(generate.lowered, mesh, f"the sampler's generate ({rows} rows, {mode})")
        step = gpu_cost.decode_step(compiled.as_text(), vocab_size=model.vocab_size,
                                    hidden_size=model.hidden_size, shards=mesh.size)
        rl = config.rl
        kv = memory.kv_cache_bytes(model, rows, rl.max_prompt_length + rl.max_completion_length, mesh)
        _STEPS[key] = DecodeProgram(step, compiled.memory_analysis().temp_size_in_bytes,
                                    memory.device_bytes(generate.weights),
                                    weight_bytes_read(generate.weights, model, rows), kv,
                                    generate.weights)
    return _STEPS[key]


def decode_figures(config: ml_collections.ConfigDict, mesh, target, batches, modes) -> tuple[list[dict], str]:
    """(one dict of figures per batch and mode, the mode a plan compiles by default). A mode
    "default" in ``modes`` is that mode."""
    config = one_pass(config)
    layers = model_shapes.model_config_from(config.model).num_layers
    fewer_layers, more_layers = (one_pass(with_layers(config, n)) for n in MARGINAL_LAYERS)
    span = MARGINAL_LAYERS[1] - MARGINAL_LAYERS[0]
    default = default_decode_mode(config, mesh, batches[0])
    modes = list(dict.fromkeys(default if mode == "default" else mode for mode in modes))
    bandwidth = target.bandwidth_per_device
    out = []
    for batch in batches:
        for mode in modes:
            step, temp, weights, read, kv, _ = decode_step(config, mesh, batch, mode)
            fewer = decode_step(fewer_layers, mesh, batch, mode).step
            more = decode_step(more_layers, mesh, batch, mode).step
            floor = read + kv   # the whole-cache floor (module docstring)
            out.append(dict(
                batch=batch, mode=mode, default=mode == default,
                kernels_per_token=step.kernels,
                kernels_per_layer=(more.kernels - fewer.kernels) / span,
                bytes_per_token=step.bytes, floor_bytes_per_token=floor,
                bytes_over_floor=step.bytes / floor,
                bytes_per_layer=(more.bytes - fewer.bytes) / span,
                host_syncs_per_token=step.host_syncs,
                predicted_tokens_per_s=gpu_cost.predicted_tokens_per_s(
                    batch, step.bytes, step.kernels, bandwidth=bandwidth,
                    seconds_per_kernel=gpu_cost.SECONDS_PER_KERNEL),
                launch_bound=step.kernels * gpu_cost.SECONDS_PER_KERNEL > step.bytes / bandwidth,
                kernels_by_kind=step.kernels_by_kind(), bytes_by_kind=step.bytes_by_kind(),
                token_loop=step.loop, tokens_per_loop_trip=step.tokens_per_trip,
                weight_bytes=weights, weight_bytes_read=read, kv_cache_bytes=kv, temp_bytes=temp,
                layers=layers))
    return out, default


def update_figures(config: ml_collections.ConfigDict, mesh) -> dict:
    """{optimizer: figures} of the update for the config's optimizer and AdamW (fp32 master
    weights and moments, as `launch.memory --compare adamw`), loops as they run."""
    out = {}
    for label, name, param_dtype in memory.columns(config, ["adamw"]):
        run = config.copy_and_resolve_references()
        run.optimizer.name = name
        run.model.param_dtype = param_dtype
        update = memory.lower_update(run, mesh)
        cost = gpu_cost.of_compiled(compile_for(update.lowered, mesh, f"the {label} update"))
        out[name] = dict(kernels=cost.kernels, bytes=cost.bytes, matmul_flops=cost.matmul_flops,
                         host_syncs=cost.host_syncs, dynamic_loops=cost.dynamic_loops,
                         kernels_by_kind=cost.kernels_by_kind, param_dtype=param_dtype,
                         micro_steps=update.micro_steps)
    return out


def generate_figures(config: ml_collections.ConfigDict, mesh) -> dict:
    """The config's own rollout pass (``rl.rollout_micro_batch`` rows, or all), in the mode a
    plan compiles: XLA's temporaries beside the KV cache it holds."""
    rl = config.rl
    generate = memory.lower_generate(config, mesh)
    compiled = compile_for(generate.lowered, mesh, f"the sampler's generate ({generate.rows} rows)")
    per_pass = rl.rollout_micro_batch or generate.rows
    kv = memory.kv_cache_bytes(model_shapes.model_config_from(config.model), per_pass,
                               rl.max_prompt_length + rl.max_completion_length, mesh)
    return dict(rows=generate.rows, rows_per_pass=per_pass,
                temp_bytes=compiled.memory_analysis().temp_size_in_bytes, kv_cache_bytes=kv,
                weight_bytes=memory.device_bytes(generate.weights))


SCHEDULE_SEED = 0   # numpy's generator for lognormal:M: the same lengths on every run


def completion_schedule(text: str, rows: int, max_length: int) -> tuple[dict, list[int]]:
    """(a description, the completion length of each of ``rows`` rows) for `launch.cost`'s
    ``--schedule``, each 1 … ``max_length``:

    - "lognormal:M": round(M·e^Z) per row, Z ~ N(0, 1) (median M, σ 1), clipped to 1 …
      ``max_length``, the Z from numpy's ``default_rng(SCHEDULE_SEED)``: the same lengths on
      every run;
    - a file of one integer per line (blank lines skipped), exactly one per row.

    ValueError naming the cause (and the line) otherwise."""
    if text.startswith("lognormal:"):
        try:
            median = float(text.split(":", 1)[1])
        except ValueError:
            median = 0.0
        if not median >= 1:
            raise ValueError(f"--schedule {text}: expected lognormal:M with a median M ≥ 1 tokens, "
                             f"e.g. lognormal:200")
        z = np.random.default_rng(SCHEDULE_SEED).standard_normal(rows)
        lengths = np.clip(np.rint(median * np.exp(z)), 1, max_length).astype(int)
        return (dict(spec=text, kind="lognormal", median=median, sigma=1.0, seed=SCHEDULE_SEED,
                     cap=max_length, lengths=lengths.tolist()), lengths.tolist())
    try:
        with open(text) as f:
            lines = [(n, line.strip()) for n, line in enumerate(f, 1) if line.strip()]
    except OSError as e:
        raise ValueError(f"--schedule {text}: neither lognormal:M nor a readable file "
                         f"({e.strerror})") from None
    lengths = []
    for n, line in lines:
        try:
            length = int(line)
        except ValueError:
            length = 0
        if not 1 <= length <= max_length:
            raise ValueError(f"--schedule {text}, line {n}: {line!r} is not a completion length "
                             f"1 … {max_length} (rl.max_completion_length)")
        lengths.append(length)
    if len(lengths) != rows:
        raise ValueError(f"--schedule {text}: {len(lengths)} lengths for a rollout of {rows} rows "
                         f"(data.prompts_per_step × rl.num_generations); give one per row")
    return dict(spec=text, kind="file", lengths=lengths), lengths


def true_floor_bytes(*, weights_read: float, kv_per_token: float, prompt_length: int,
                     live_groups: int, completion_tokens: int) -> float:
    """What a decode step must read at least, per GPU (the true floor of the module docstring):

        weights_read + kv_per_token × (prompt_length × live_groups + completion_tokens)

    ``weights_read``: `weight_bytes_read` at the step's live rows; ``kv_per_token``: one token's
    K and V over every layer; ``live_groups``: the groups with a row still decoding (a group's
    rows share one prompt, whose KV is read once); ``completion_tokens``: the live rows'
    completion tokens so far, each row's own KV."""
    return weights_read + kv_per_token * (prompt_length * live_groups + completion_tokens)


def static_rollout(config: ml_collections.ConfigDict, mesh, lengths) -> tuple[dict, dict]:
    """A whole rollout of ``config``'s batch by today's static engine, for completion ``lengths``
    (the tokens each row keeps, EOS included: [prompts_per_step × num_generations], a group's
    rows adjacent), per GPU. Returns (figures, the detail they come from).

    The engine: the batch in passes of ``rl.rollout_micro_batch`` rows (all rows when 0), pass j
    holding rows j, j + k, j + 2k, … (k passes, as `Sampler`'s ``rows_per_pass``). A pass prefills,
    draws every row's first token from the prefill, then runs trips of its token loop until its
    longest row (L_max) has ended: T = the loop's tokens per trip (16 on a GPU), so
    F = T·⌈(L_max − 1)/T⌉ decode forward passes and 1 + F token steps for each of its rows
    (`SampleOutput.token_steps`). Each forward pass costs the bytes and kernels per token of the
    decode step XLA:GPU compiles, deviceless, for a one-pass ``generate`` of that many rows in the
    mode a plan compiles (`decode_step`). The prefill (and the first draw) is not counted.

    - ``bytes_per_kept_token`` = Σ_passes F × bytes per step ÷ kept tokens;
    - ``kernels_per_kept_token`` = Σ_passes F × kernels per step ÷ kept tokens;
    - ``floor_bytes_per_kept_token`` = `rollout_floor_bytes` ÷ kept tokens;
    - ``efficiency`` = kept tokens ÷ executed row-steps (rows per pass × token steps, summed);
    - ``decode_steps`` = the token steps of all passes, one pass after the other.

    Time follows as bytes ÷ bandwidth or kernels × seconds per kernel (`gpu_cost`'s model), per
    kept token."""
    rl = config.rl
    lengths = check_lengths(config, lengths)
    rows = lengths.size
    config = static_config(config)
    rl = config.rl
    per_pass = rl.rollout_micro_batch or rows
    if rows % per_pass:
        raise ValueError(f"rl.rollout_micro_batch={per_pass} does not divide the {rows}-row batch")
    passes = rows // per_pass
    one = one_pass(config)
    mode = default_decode_mode(one, mesh, per_pass)
    program = decode_step(one, mesh, per_pass, mode)
    step = program.step
    if not step.dynamic:
        raise ValueError("the token loop of the compiled generate has a fixed trip count: a pass "
                         "would not stop when its rows end")
    per_trip = round(step.tokens_per_trip)
    detail_passes = []
    for j in range(passes):
        longest = int(lengths[j::passes].max())
        forward = per_trip * math.ceil((longest - 1) / per_trip)
        detail_passes.append(dict(rows=per_pass, longest=longest, token_steps=1 + forward,
                                  forward_passes=forward))
    kept = int(lengths.sum())
    forward = sum(p["forward_passes"] for p in detail_passes)
    token_steps = sum(p["token_steps"] for p in detail_passes)

    floor, kv_per_token = rollout_floor_bytes(config, mesh, program.weights, lengths)
    figures = dict(bytes_per_kept_token=forward * step.bytes / kept,
                   floor_bytes_per_kept_token=floor / kept,
                   kernels_per_kept_token=forward * step.kernels / kept,
                   efficiency=kept / (per_pass * token_steps),
                   decode_steps=token_steps)
    detail = dict(mode=mode, rows=rows, rows_per_pass=per_pass, kept_tokens=kept,
                  passes=detail_passes, forward_passes=forward, tokens_per_loop_trip=per_trip,
                  bytes_per_step=step.bytes, kernels_per_step=step.kernels,
                  weight_bytes_read=program.weight_bytes_read, kv_bytes_per_token=kv_per_token,
                  floor_bytes=floor, prefill_tokens=rows * rl.max_prompt_length)
    return figures, detail


def check_lengths(config: ml_collections.ConfigDict, lengths) -> np.ndarray:
    """``lengths`` as an array of one completion length per row of the config's rollout batch,
    each 1 … rl.max_completion_length; ValueError otherwise."""
    rl = config.rl
    rows = config.data.prompts_per_step * rl.num_generations
    lengths = np.asarray(lengths, np.int64)
    if lengths.shape != (rows,):
        raise ValueError(f"{lengths.size} completion lengths for a rollout of {rows} rows")
    if lengths.min() < 1 or lengths.max() > rl.max_completion_length:
        raise ValueError(f"completion lengths must be 1 … rl.max_completion_length="
                         f"{rl.max_completion_length}, got {lengths.min()} … {lengths.max()}")
    return lengths


def rollout_floor_bytes(config: ml_collections.ConfigDict, mesh, weights, lengths) -> tuple[float, float]:
    """(the true floor of a whole rollout, one token's KV over every layer), per GPU: the batch
    decoded as one by an ideal engine. At forward pass s = 1 … max(lengths) − 1 the rows still
    live (L > s) read the weights once, their groups' prompt windows (rl.max_prompt_length
    tokens: no prompt lengths are known here) once, and s completion tokens each
    (`true_floor_bytes`). The same for every engine: what they are measured against."""
    rl = config.rl
    rows = lengths.size
    model = model_shapes.model_config_from(config.model)
    weights_fixed = weight_bytes_read(weights, model, 0)
    weights_per_row = weight_bytes_read(weights, model, 1) - weights_fixed
    kv_per_token = memory.kv_cache_bytes(model, rows, 1, mesh) / rows
    s = np.arange(1, int(lengths.max()))[:, None]
    live = lengths[None, :] > s                                      # [steps, rows]
    live_rows = live.sum(axis=1)
    live_groups = live.reshape(len(s), -1, rl.num_generations).any(axis=2).sum(axis=1)
    floor = sum(true_floor_bytes(weights_read=weights_fixed + n * weights_per_row,
                                 kv_per_token=kv_per_token, prompt_length=rl.max_prompt_length,
                                 live_groups=int(g), completion_tokens=int(step_s * n))
                for step_s, n, g in zip(s[:, 0], live_rows, live_groups))
    return floor, kv_per_token


def static_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config`` on the static engine, its passes as wide as the slot engine's slots when it
    was on that engine (``rl.rollout_slots``, 0: the whole batch)."""
    out = config.copy_and_resolve_references()
    if out.rl.rollout_engine == "slots":
        out.rl.rollout_micro_batch = out.rl.rollout_slots
    out.rl.rollout_engine, out.rl.rollout_slots = "static", 0
    return out


def slot_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config`` on the slot engine with as many decode slots as the static engine's pass has
    rows (``rl.rollout_slots`` when set, else ``rl.rollout_micro_batch``, else the whole batch):
    the two engines compared at the same executed width."""
    rl = config.rl
    out = config.copy_and_resolve_references()
    out.rl.rollout_engine = "slots"
    out.rl.rollout_slots = rl.rollout_slots or rl.rollout_micro_batch or (
        config.data.prompts_per_step * rl.num_generations)
    out.rl.rollout_micro_batch = 0
    return out


class _Part(NamedTuple):
    """Bytes and kernels of a part of a program, per run of it."""

    bytes: float
    kernels: float
    host_syncs: float = 0.0

    @staticmethod
    def of(cost: gpu_cost.Cost) -> "_Part":
        return _Part(cost.bytes, cost.kernels, cost.host_syncs)

    def __add__(self, other):
        return _Part(*(a + b for a, b in zip(self, other)))

    def __sub__(self, other):
        return _Part(*(a - b for a, b in zip(self, other)))

    def __mul__(self, times: float):
        return _Part(*(a * times for a in self))

    def seconds(self, bandwidth: float) -> float:
        """`gpu_cost`'s model: bytes ÷ bandwidth or kernels × seconds per kernel, the longer."""
        return max(self.bytes / bandwidth, self.kernels * gpu_cost.SECONDS_PER_KERNEL)


SEGMENTED_KERNEL = 'name = "segmented_decode_attention"'   # its pallas_call's backend_config


def kernel_completion_bytes(program: gpu_cost.Program, computation: str) -> float:
    """The bytes of the completion segments (a kernel's last two operands, K and V: updated in
    place) that the slot engine's attention kernels in one run of ``computation`` take whole:
    what `gpu_cost` counts them reading. 0 where the step has none (XLA's ops read them)."""
    total = 0.0
    for key, (launch, times) in program.cost(computation).launches.items():
        if launch.kind != "Pallas kernel":
            continue
        where, name = key.split("#")[0].rsplit("/", 1)
        call = program.module.instruction(where, name)
        if SEGMENTED_KERNEL in call.attributes:
            total += times * sum(program.module.instruction(where, operand).bytes
                                 for operand in call.operands[-2:])
    return total


def slot_rollout(config: ml_collections.ConfigDict, mesh, lengths, *,
                 bandwidth: float) -> tuple[dict, dict]:
    """A whole rollout of ``config``'s batch by the slot engine (`slot_config`: as many slots as
    the static engine's pass has rows) for completion ``lengths``, per GPU, as `static_rollout`.
    Returns (figures, the detail they come from).

    XLA:GPU compiles the engine's program, deviceless. Its top-level loops are the admission
    loop (a loop admitting groups, one prefill each, then one chunk of `slots.REFILL_EVERY`
    decode steps of every slot) and one tail loop per executed size (a chunk of decode steps of
    that many slots per trip); each chunk is an inner loop of known trip count whose body is
    one decode step at that size. `slot_schedule.replay` counts, from the lengths, the trips of
    each loop and the groups admitted. The rollout then costs

        Σ_loops (trips × one trip + the exit test) + the entry's own work (state, compactions)
          − the admissions' prefills (not counted, as `static_rollout`'s prefill)

    - ``bytes_per_kept_token``, ``kernels_per_kept_token``: that ÷ kept tokens;
    - ``floor_bytes_per_kept_token``: `rollout_floor_bytes` ÷ kept tokens, the static engine's;
    - ``efficiency`` = kept tokens ÷ executed row-steps (each row's prefill draw, and n per
      decode step of n slots, slots holding no live row included: `SlotSchedule.row_steps`);
    - ``decode_steps`` = 1 (the prefill draw) + the decode steps of every loop, one after the
      other."""
    from logra_jax.rl.sampler import slot_schedule, slots as slot_engine   # a jax program's rules

    lengths = check_lengths(config, lengths)
    config = slot_config(config)
    rl = config.rl
    rows, group = lengths.size, rl.num_generations
    n_slots = rl.rollout_slots
    prompt_slots = slot_engine.default_prompt_slots(rows, n_slots, group)
    schedule = slot_schedule.replay(lengths, group_size=group, slots=n_slots,
                                    prompt_slots=prompt_slots, refill_every=slot_engine.REFILL_EVERY)
    model = model_shapes.model_config_from(config.model)
    generate = memory.lower_generate(config, mesh)
    compiled = compile_for(generate.lowered, mesh, f"the slot engine's generate ({n_slots} slots)")
    program = gpu_cost.Program(compiled.as_text())
    heads = gpu_cost.head_parameters(program, model.vocab_size, model.hidden_size, mesh.size)

    def reads_head(loop) -> float:
        return program.trip(loop).reads_whole(lambda c, n: program.origin(c, n) in heads)

    loops = program.loops()
    top = [loop for loop in loops if not loop.parents]
    sizes = schedule.sizes
    if len(top) != 1 + len(sizes) or any(loop.trip_count is not None for loop in top):
        raise ValueError(f"the slot engine's program has {len(top)} top-level loops, expected "
                         f"{1 + len(sizes)} of run-time trip counts (admission, sizes {sizes})")

    def inner(outer, trip_count):
        return [loop for loop in loops if loop.parents == (outer.name,)
                and loop.trip_count == trip_count]

    def check(loop) -> _Part:   # one test of a run-time loop's condition, read on the host
        return _Part.of(program.cost(loop.condition)) + _Part(0.0, 0.0, 1.0)

    # The loops in program order: admission, then the tail's sizes, largest first.
    admission, tails = top[0], dict(zip(sizes, top[1:]))
    admits = inner(admission, None)
    if len(admits) != 1:
        raise ValueError("the slot engine's admission loop holds no loop admitting groups")
    admit = admits[0]
    prefill = _Part.of(program.cost(admit.body))
    # Each part of the rollout: (what one run of it costs, how many times it runs). A trip of
    # the admission loop holds one admission as a run-time loop counted once (its body and two
    # tests): that goes, and the admissions are counted apart, their prefills left out.
    admit_once = prefill + check(admit) * 2
    parts, steps, whole_by_size = [], {}, {}
    for size, loop, trips in ([(sizes[0], admission, schedule.admission_trips)]
                              + [(n, tails[n], schedule.tail_trips[n]) for n in sizes]):
        chunks = inner(loop, slot_engine.REFILL_EVERY)
        if len(chunks) != 1 or reads_head(chunks[0]) != 1:
            raise ValueError(f"a loop of the slot engine's program ({loop.name}) holds no chunk of "
                             f"{slot_engine.REFILL_EVERY} decode steps")
        step = _Part.of(program.cost(chunks[0].body))
        # The attention kernel reads each slot's completion only to the slot's column (its loop's
        # trip count): the bytes of its operands whole go, the columns the schedule reads come.
        whole = kernel_completion_bytes(program, chunks[0].body)
        steps.setdefault(size, step)
        whole_by_size[size] = whole
        trip = (_Part.of(program.trip(loop)) - _Part(whole * slot_engine.REFILL_EVERY, 0)
                - (admit_once if loop is admission else _Part(0, 0)))
        parts += [(trip, trips), (check(loop), 1)]
    parts.append((check(admit), schedule.admission_trips + schedule.groups))
    kept = int(lengths.sum())
    floor, kv_per_token = rollout_floor_bytes(config, mesh, generate.weights, lengths)
    for size in sizes:   # what the kernels read, a slot's columns at a time (one kernel per layer)
        if whole_by_size[size]:
            parts.append((_Part(kv_per_token, 0.0), schedule.columns_read.get(size, 0)))
    entry_own = _Part.of(program.cost()) - sum(
        (_Part.of(program.trip(loop)) + check(loop) for loop in top), _Part(0.0, 0.0))
    parts.append((entry_own, 1))   # the state's set-up, the compactions, the outputs
    decode = sum((part * times for part, times in parts), _Part(0.0, 0.0))

    def bounded_step_bytes(n):   # a step of n slots, its kernels reading the columns they read
        if not whole_by_size[n] or not schedule.steps[n]:
            return steps[n].bytes
        return (steps[n].bytes - whole_by_size[n]
                + kv_per_token * schedule.columns_read.get(n, 0) / schedule.steps[n])
    figures = dict(bytes_per_kept_token=decode.bytes / kept,
                   floor_bytes_per_kept_token=floor / kept,
                   kernels_per_kept_token=decode.kernels / kept,
                   efficiency=kept / schedule.row_steps,
                   decode_steps=1 + sum(schedule.steps.values()))
    detail = dict(rows=rows, slots=n_slots, prompt_slots=prompt_slots, kept_tokens=kept,
                  tokens_per_chunk=slot_engine.REFILL_EVERY,
                  admission_trips=schedule.admission_trips, groups=schedule.groups,
                  sizes=[dict(slots=n, steps=schedule.steps[n],
                              bytes_per_step=bounded_step_bytes(n),
                              program_bytes_per_step=steps[n].bytes,
                              kernels_per_step=steps[n].kernels,
                              kernel_whole_completion_bytes_per_step=whole_by_size[n],
                              completion_columns_read=schedule.columns_read.get(n, 0))
                         for n in sizes],
                  bytes=decode.bytes, kernels=decode.kernels, host_syncs=decode.host_syncs,
                  entry_bytes=entry_own.bytes, prefill_bytes_per_group=prefill.bytes,
                  prefill_tokens=schedule.groups * rl.max_prompt_length, floor_bytes=floor,
                  kv_bytes_per_token=kv_per_token,
                  predicted_seconds=sum(part.seconds(bandwidth) * times for part, times in parts))
    return figures, detail
