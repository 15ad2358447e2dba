"""Config → objects: one builder per part of a run, each reading its own sections of the config.

The assembly (rl/assembly.py) composes them into a run's parts, for the trainer and for the memory
planner alike; the evaluation, export and benchmarks call the ones they need. The algorithm's and
the optimizer's parts come from their tables (rl/algorithms/, rl/optimizers/).

    validate(config)                         every value and cross-key rule (logra_jax/config/values.py)
    build_mesh(config.mesh, devices)         the device mesh
    build_model(config.model, mesh)          (model, tokenizer), sharded on the mesh
    build_model_config(config.model)         its ModelConfig without weights (early shape checks)
    build_prompt_source(config.data)         the examples
    build_data(config.data, seed, ...)       the prompt iterator (prompts checked against the window)
    replays_merge(config)                    whether a rollout engine replays LoGRA's merge
    build_policy_update(config, policy)      the jitted update (PolicyUpdate)
    build_sampler(config.rl, policy, tok)    the rollout sampler
    build_rollout_spec(config)               how prompts become rollouts (group size, sampling, text)
    build_grader(config.rl)                  the reward
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

# Every value and cross-key rule, jax-free (checked before anything is built or written), and
# whether a rollout engine replays LoGRA's merges: logra_jax/config/values.py.
from logra_jax.config import replays_merge, validate  # noqa: F401
from logra_jax import model_shapes
from logra_jax import sharding as sharding_lib
from logra_jax.data import PromptIterator
from logra_jax.models import Decoder, ModelConfig, from_pretrained, gguf_loader, hf_loader
from logra_jax.models.pretrained import KNOWN_MODELS
from logra_jax.models.tokenizer import Tokenizer
from logra_jax.rl import algorithms, optimizers
from logra_jax.rl.optimizers import Optimizer
from logra_jax.rl.policy import Policy
from logra_jax.rl.rollout import Grader, RolloutSpec, fit_prompt_window
from logra_jax.rl.sampler import Sampler
from logra_jax.rl.update import PolicyUpdate


def build_mesh(axes, devices=None, *, spare_devices: bool = False) -> Mesh:
    """A mesh of the named axis sizes over ``devices`` (default: all); -1 takes what is left.

    ``spare_devices``: the mesh may use only the first of the devices (a plan for a smaller mesh,
    as the memory report makes); otherwise its size must equal their number.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = dict(axes)
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {sizes}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if len(devices) % fixed:
            raise ValueError(f"mesh {sizes}: {len(devices)} devices are not divisible by {fixed}")
        sizes[free[0]] = len(devices) // fixed
    if spare_devices:
        needed = math.prod(sizes.values())
        if needed > len(devices):
            raise ValueError(f"mesh {sizes} needs {needed} devices, only {len(devices)} are "
                             f"available for training (raise LOGRA_HOST_DEVICES or lower "
                             f"rollout_devices)")
        devices = devices[:needed]
    return sharding_lib.make_mesh(sizes, devices=devices)


def uneven_micro_batches(rl: ml_collections.ConfigDict, mesh: Mesh) -> str | None:
    """The warning for micro-batches whose rows do not split over the mesh's ``fsdp`` axis, or None.

    Such rows are left to XLA's propagation (``sharding.shard_batch``), which may lay the update's
    activations out two ways that meet in the backward pass and then prints a "[SPMD] Involuntary
    full rematerialization" warning of several hundred characters (docs/reliability.md); said
    first, in one line, that warning has a cause and a fix the user can act on.
    """
    devices = mesh.shape.get(sharding_lib.BATCH_AXIS, 1)
    if rl.micro_batch_size % devices == 0:
        return None
    return (f"rl.micro_batch_size={rl.micro_batch_size} rows do not split over the {devices} "
            f"devices of the mesh's {sharding_lib.BATCH_AXIS} axis, so XLA lays out the update "
            f"itself and may warn of an 'Involuntary full rematerialization'; a multiple of "
            f"{devices} gives every device its own rows")


def build_model(cfg: ml_collections.ConfigDict, mesh: Mesh | None):
    """(model, tokenizer). ``source="tiny"`` is a random small decoder with SmolLM2's tokenizer,
    ``"random:<shape>"`` a published shape (model_shapes.py) with random weights and that tokenizer.
    Without a mesh the weights stay on the default device (export, tools)."""
    if model_shapes.is_shape_source(cfg.source):
        raise ValueError(f"model.source={cfg.source!r} is a model shape without weights, for "
                         "`python -m launch.memory`; to train, set model.source to a local Hugging "
                         "Face folder of that model")
    if cfg.source == "tiny":
        tokenizer = gguf_loader.smollm2_tokenizer()  # with its chat template, from the SmolLM2 GGUF
        model_config = model_shapes.tiny_model_config(
            cfg.tiny, vocab_size=tokenizer.vocab_size, dtype=cfg.dtype,
            param_dtype=cfg.param_dtype, remat=cfg.remat)
        model = Decoder(model_config, rngs=nnx.Rngs(cfg.init_seed))
        return (model if mesh is None else sharding_lib.shard_model(model, mesh)), tokenizer
    if model_shapes.is_random_source(cfg.source):
        model_config = model_shapes.model_config_from(cfg)   # an unknown shape: its error first
        return random_model(model_config, cfg.init_seed, mesh), gguf_loader.smollm2_tokenizer()
    with _naming_the_source(cfg):
        return from_pretrained(cfg.source, mesh=mesh, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                               remat=cfg.remat)


def build_tokenizer(cfg: ml_collections.ConfigDict) -> Tokenizer | None:
    """The tokenizer ``config.model`` names, read without the weights, for the checks that need
    one before the model is built (every prompt fits the prompt window): SmolLM2's for "tiny",
    "random:" and the packaged SmolLM2, a Hugging Face folder's own, a GGUF file's from its
    header (`gguf_loader.gguf_metadata`: a fraction of a second, the tensors untouched). None
    for a source `build_model` refuses."""
    if (cfg.source == "tiny" or model_shapes.is_random_source(cfg.source)
            or str(cfg.source).lower() in KNOWN_MODELS):
        return gguf_loader.smollm2_tokenizer()
    path = pathlib.Path(cfg.source)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        with _naming_the_source(cfg):
            return Tokenizer.from_hf_dir(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        with _naming_the_source(cfg):
            return gguf_loader.tokenizer_from_gguf(gguf_loader.gguf_metadata(path))
    return None


def random_model(model_config: ModelConfig, seed: int, mesh: Mesh | None) -> Decoder:
    """A Decoder of ``model_config`` with the random weights of ``nnx.Rngs(seed)``, initialised
    directly into its shards on ``mesh`` (a published shape never sits whole on one device first)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(model_config, rngs=nnx.Rngs(0))))
    # Each Variable's sharding by its logical axes, as shard_model places a built model's.
    shardings = None if mesh is None else sharding_lib.param_shardings(abstract, mesh)

    def init():
        return nnx.state(Decoder(model_config, rngs=nnx.Rngs(seed)))
    return nnx.merge(graphdef, jax.jit(init, out_shardings=shardings)())


@contextlib.contextmanager
def _naming_the_source(cfg: ml_collections.ConfigDict):
    """The loaders' own checks name the file; a parser's error (JSON, GGUF, a field the model's
    config lacks) does not, so the key and the source are added to it."""
    try:
        yield
    except (KeyError, ValueError, OSError) as e:
        message = f"the field {e} is missing from its config" if isinstance(e, KeyError) else str(e)
        if str(cfg.source) in message:
            raise
        raise ValueError(f"model.source={cfg.source!r} cannot be read: {message}") from e


def build_model_config(cfg: ml_collections.ConfigDict) -> ModelConfig | None:
    """The ModelConfig ``config.model`` names, from the config alone ("tiny", "shape:<name>") or a
    Hugging Face folder's config.json (no weights): its parameter shapes, for the checks that need
    them before the model is built. Errors as `build_model`'s. None for a GGUF file (its header
    holds the vocabulary: reading it costs as much as the 5 s the model build spends on it again)
    or a source that is neither, which `build_model` reports."""
    if (cfg.source == "tiny" or model_shapes.is_shape_source(cfg.source)
            or model_shapes.is_random_source(cfg.source)):
        return model_shapes.model_config_from(cfg)
    config_file = pathlib.Path(cfg.source) / "config.json"
    if not config_file.is_file():
        return None
    with _naming_the_source(cfg):
        return hf_loader.config_from_hf(json.loads(config_file.read_text()), dtype=cfg.dtype,
                                        param_dtype=cfg.param_dtype, remat=cfg.remat)


def build_prompt_source(cfg: ml_collections.ConfigDict):
    """The examples ``config.data`` names (a reasoning-gym task, local GSM8K files, or seeded
    two-number sums that need no package). Each source's module is imported here, in its own
    branch: reasoning_gym and tensorflow_datasets are heavy, and a run needs only the one it reads."""
    if cfg.source == "task":
        from logra_jax.data.tasks import make_task_source
        return make_task_source(cfg.task, size=cfg.size, seed=cfg.task_seed, **dict(cfg.task_kwargs))
    if cfg.source == "sums":   # no dependency: the loop's speed on a machine without either
        from logra_jax.data.sums import SumsSource
        return SumsSource(cfg.size, cfg.task_seed)
    if cfg.source == "gsm8k":
        if not cfg.gsm8k_dir:
            raise ValueError("data.source='gsm8k' needs data.gsm8k_dir: a folder with train.jsonl and "
                             "test.jsonl (nothing is downloaded)")
        from logra_jax.data.gsm8k import load_gsm8k
        return load_gsm8k(cfg.gsm8k_dir, cfg.split, cache_dir=cfg.gsm8k_cache_dir or None)
    raise ValueError(f"data.source must be 'task', 'gsm8k' or 'sums', got {cfg.source!r}")


def build_data(cfg: ml_collections.ConfigDict, seed: int, *, source=None, tokenizer=None,
               rollout_spec: RolloutSpec | None = None) -> PromptIterator:
    """The prompt iterator over ``source`` (default: `build_prompt_source`). With ``tokenizer``
    and ``rollout_spec`` every prompt is first checked against the prompt window
    (`fit_prompt_window`: an error, or ``data.skip_long_prompts``)."""
    source = build_prompt_source(cfg) if source is None else source
    if rollout_spec is not None:
        source = fit_prompt_window(source, tokenizer, rollout_spec, skip_long=cfg.skip_long_prompts)
    return PromptIterator(source, batch_size=cfg.prompts_per_step, seed=seed, shuffle=cfg.shuffle)


def build_policy_update(config: ml_collections.ConfigDict, policy: Policy, *,
                        optimizer: Optimizer | None = None,
                        return_updates: bool = False) -> PolicyUpdate:
    """The jitted update of ``config`` (optimizer, the algorithm's loss, micro-batching, KL probe)
    for ``policy``; ``optimizer`` defaults to the one the config builds.

    ``return_updates``: the step also returns the targets' LowRankUpdates (a factors sync needs them).
    """
    if optimizer is None:
        optimizer = optimizers.build(config.optimizer, replayed_merge=replays_merge(config))
    rl = config.rl
    return PolicyUpdate(policy, optimizer.tx, algorithms.get(rl.algorithm).loss(rl),
                        temperature=rl.temperature, micro_batch_size=rl.micro_batch_size,
                        probe_size=config.optimizer.probe_size, sketch=optimizer.sketch,
                        train_others=optimizer.train_others, kl_control=optimizer.kl_control,
                        return_updates=return_updates, subtree=optimizer.subtree)


def build_sampler(rl: ml_collections.ConfigDict, policy: Policy, tokenizer=None) -> Sampler:
    """The sampler of rollouts: the config's prompt and completion lengths, the tokenizer's EOS
    and padding ids, and rows per pass. Without a tokenizer (a memory plan of a shape, which has
    none) both ids are 0: a plan compiles the sampler's program and never runs it, and the ids are
    values in that program, not shapes."""
    if tokenizer is None:
        eos_id = pad_id = 0
    else:
        eos_id = tokenizer.eos_id
        pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    return Sampler(policy, max_prompt_length=rl.max_prompt_length,
                   max_completion_length=rl.max_completion_length, eos_ids=[eos_id],
                   pad_id=pad_id, decode_weights=rl.decode_weights,
                   rows_per_pass=rl.rollout_micro_batch, engine=rl.rollout_engine,
                   group_size=rl.num_generations, slots=rl.rollout_slots)


def build_rollout_spec(config: ml_collections.ConfigDict) -> RolloutSpec:
    rl, data = config.rl, config.data
    return RolloutSpec(num_generations=rl.num_generations, max_prompt_length=rl.max_prompt_length,
                       temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
                       system_prompt=data.system_prompt or None, instruction=data.instruction or None)


def build_grader(rl: ml_collections.ConfigDict,
                 data: ml_collections.ConfigDict | None = None) -> Grader:
    """The math reward; what a wrong answer earns is the algorithm's (REINFORCE: ``rl.failure_reward``,
    §7; GRPO: 0). ``data``: the prompts' section, to name their task when a reward fails."""
    task = "the prompts"
    if data is not None:
        task = f"data.task={data.task}" if data.source == "task" else f"data.source={data.source}"
    return Grader(failure_reward=algorithms.get(rl.algorithm).failure_reward(rl),
                  format_reward_weight=rl.format_reward_weight, task=task)
