"""A config's sampler and update as XLA:GPU compiles them, and what they cost per GPU.

`launch.cost` prints these figures and tests keep bounds on them. Each program is lowered as the
memory planner lowers it (memory.py: ``lower_generate``, ``lower_update``), compiled for a mesh
of a GPU target's devices without a GPU, and read by gpu_cost.py:

- a decode step (one token for every row) of the compiled ``generate``, found in its token loop:
  kernels (and by kind), kernels per layer, host syncs, bytes against the floor, and the
  predicted tokens/s (gpu_cost.predicted_tokens_per_s);
- the update, the config's optimizer beside AdamW: kernels, bytes, matmul FLOPs;
- the config's own rollout pass: XLA's temporaries beside its KV cache.

**Per layer.** From 3 layers on, XLA's kernels per decode step grow by the same amount for every
layer a model has (measured, both modes: Qwen2.5-1.5B's shape at 3, 4 and 28 layers; SmolLM2-135M's
at 3–6, 8 and 30; a 2-layer stacked program differs, a 1-layer one more). The figure per layer is
that amount: the step at 4 layers less the step at 3, of the same model (a published shape's fields
on the tiny source, with tiny's vocabulary: the vocabulary does not enter a layer).

**The floor** of a step, per GPU: its share of the bf16 weights (the weights read once over the
mesh: each GPU reads what it holds, as XLA's FSDP decode does, or gathers as much from the others)
plus its rows' KV cache, read once.
"""

from __future__ import annotations

import jax
import ml_collections

from logra_jax import model_shapes
from logra_jax.perf import gpu_cost, machines, memory, oom
from logra_jax.rl.sampler import Sampler

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


_STEPS: dict = {}   # one compile per (model, rollout settings, mesh, rows, mode)


def decode_step(config: ml_collections.ConfigDict, mesh, rows: int, mode: str):
    """(gpu_cost.StepCost, the program's temporaries, (weight bytes, KV-cache bytes) of the floor)
    of one decode step of the config's ``generate`` for ``rows`` rows in ``mode``, per GPU."""
    key = (str(config.model), str(config.rl), str(mesh), rows, mode)
    if key not in _STEPS:
        model = model_shapes.model_config_from(config.model)
        generate = memory.lower_generate(config, mesh, rows=rows, decode_weights=mode)
        compiled = compile_for(generate.lowered, mesh, f"the sampler's generate ({rows} rows, {mode})")
        step = gpu_cost.decode_step(compiled.as_text(), vocab_size=model.vocab_size,
                                    hidden_size=model.hidden_size, shards=mesh.size)
        rl = config.rl
        kv = memory.kv_cache_bytes(model, rows, rl.max_prompt_length + rl.max_completion_length, mesh)
        _STEPS[key] = (step, compiled.memory_analysis().temp_size_in_bytes,
                       (memory.device_bytes(generate.weights), kv))
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
            step, temp, (weights, kv) = decode_step(config, mesh, batch, mode)
            fewer = decode_step(fewer_layers, mesh, batch, mode)[0]
            more = decode_step(more_layers, mesh, batch, mode)[0]
            floor = weights + kv
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
                weight_bytes=weights, kv_cache_bytes=kv, temp_bytes=temp, layers=layers))
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
