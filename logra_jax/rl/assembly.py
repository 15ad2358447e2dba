"""A run's parts from its config, assembled once: as arrays for the trainer, as shapes for the planner.

    recipe = Recipe.checked(config)   the config checked (`config.validate`), its algorithm and
                                      its optimizer chosen and built (`Recipe.of`: unchecked)
    parts = recipe.build()            RunParts: the model's weights, the reference model, the
                                      jitted update and the sampler on the run's devices (training)
    plan = recipe.abstract(mesh)      AbstractRun: the same parts from the model's shapes alone,
                                      every array a ShapeDtypeStruct with its sharding (the memory
                                      planner, the benchmarks, the checks before a run is built)

Both are made by the same code (`_assemble`): the policy, LoRA's adapters, the part of the params
the optimizer trains, the reference model (kept only when the algorithm's loss reads it, in the
compute dtype), the optimizer state and every sharding. Only where the weights come from differs:
a model built from its source, or `nnx.eval_shape` of its config. tests/test_assembly.py checks
that the two agree, leaf by leaf, for every shipped config and optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from logra_jax import distributed, host_arrays, model_shapes
from logra_jax.config import rows_per_step
from logra_jax import sharding as sharding_lib
from logra_jax.models import Decoder, ModelConfig
from logra_jax.optim.low_rank import all_finite
from logra_jax.rl import algorithms, build, optimizers, sync
from logra_jax.rl.algorithms import Algorithm
from logra_jax.rl.optimizers import Optimizer
from logra_jax.rl.policy import Policy, Sequences
from logra_jax.rl.rollout import Rollouts, RolloutSource, process_prompts, rollout_source
from logra_jax.rl.sampler import Sampler
from logra_jax.rl.update import PolicyUpdate, TrainBatch


def _placed(shapes, shardings):
    """ShapeDtypeStructs of ``shapes`` with the matching leaves of ``shardings``."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings)


def abstract_model(model_config: ModelConfig) -> nnx.Module:
    """The Decoder with ShapeDtypeStructs instead of arrays: no memory, any size."""
    return nnx.eval_shape(lambda: Decoder(model_config, rngs=nnx.Rngs(0)))


def param_shardings(model: nnx.Module, mesh: Mesh) -> dict:
    """Params-shaped NamedShardings of ``model`` on ``mesh``, by each Variable's logical axes (the
    layout `build.build_model` places the weights in)."""
    return nnx.to_pure_dict(sharding_lib.param_shardings(model, mesh))


def abstract_params(model: nnx.Module, mesh: Mesh) -> dict:
    """The params dict (Policy's view) of ``model`` as ShapeDtypeStructs sharded on ``mesh``."""
    return _placed(Policy.params_of(model), param_shardings(model, mesh))


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


def _in_compute_dtype(params: dict, compute) -> dict:
    return jax.tree.map(lambda x: x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params)


@dataclasses.dataclass(frozen=True)
class _Assembled:
    """What `_assemble` makes, the same for arrays and for shapes."""

    policy: Policy
    params: dict                  # the trained params (model + adapters): arrays or shapes
    param_shardings: dict
    rollout_shardings: dict       # the same params laid out on the rollout mesh
    reference: dict | None        # the frozen reference's params, or None
    opt_state_shardings: Any
    update: PolicyUpdate
    sampler: Sampler


def _assemble(recipe: Recipe, model: nnx.Module, tokenizer, mesh: Mesh, rollout_mesh: Mesh, *,
              abstract: bool, return_updates: bool) -> _Assembled:
    """The parts of a run around ``model`` (built, or `abstract_model`), on ``mesh``.

    The reference model is the model's own initial weights (LoRA's adapters, zero at the start,
    add nothing to its log-probs), kept only when the algorithm's loss reads it, in the compute
    dtype: every layer casts its weights to that dtype anyway, so its log-probs are unchanged
    (fp32 master weights would cost 4 instead of 2 bytes per parameter at bf16 compute).
    """
    config, optimizer = recipe.config, recipe.optimizer
    policy = Policy(model, lora_scale=optimizer.lora_scale)
    model_params = abstract_params(model, mesh) if abstract else Policy.params_of(model)
    params = optimizer.with_adapters(model_params)
    rollout_shardings = optimizer.adapter_shardings(params, param_shardings(model, rollout_mesh))
    shardings = jax.tree.map(lambda x: x.sharding, params)
    reference = None
    if recipe.algorithm.uses_reference(config.rl):
        compute = jnp.dtype(config.model.dtype)
        cast = functools.partial(_in_compute_dtype, compute=compute)
        on_params = jax.tree.map(lambda x: x.sharding, model_params)
        reference = (_placed(jax.eval_shape(cast, model_params), on_params) if abstract
                     else jax.jit(cast, out_shardings=on_params)(model_params))
    # Optimizer state sharded like the params it belongs to (RowAdam's v like the kernel's out
    # dim): jit(tx.init) alone would put every output on one device, since none depends on values.
    opt_state_shardings = sharding_lib.opt_state_shardings(optimizer.tx, optimizer.trained(params))
    update = build.build_policy_update(config, policy, optimizer=optimizer,
                                       return_updates=return_updates)
    sampler = build.build_sampler(config.rl, policy, tokenizer)
    return _Assembled(policy, params, shardings, rollout_shardings, reference, opt_state_shardings,
                      update, sampler)


def run_meshes(config: ml_collections.ConfigDict, devices=None, *,
               spare_devices: bool = False) -> tuple[Mesh, Mesh]:
    """(training mesh, rollout mesh) of ``config`` over ``devices`` (default: all): the training
    mesh laid out as ``mesh`` on the devices ``sync.rollout_devices`` leaves it, the rollout mesh
    as ``sync.rollout_mesh`` on the rest, or on the training devices when colocated (0).

    ``spare_devices``: a plan's training mesh may use only the first of its devices (a smaller mesh
    than the machine); a colocated rollout mesh then lies on that mesh's devices, as the trainer's
    would on a machine of that size. The trainer and every planner take their meshes from here.
    """
    train_devices, rollout_devices = sync.split_devices(config.sync.rollout_devices, devices)
    mesh = build.build_mesh(config.mesh, train_devices, spare_devices=spare_devices)
    if spare_devices and not config.sync.rollout_devices:
        rollout_devices = train_devices[:mesh.size]
    return mesh, build.build_mesh(config.sync.rollout_mesh, rollout_devices)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A run's config, checked, with the algorithm it names and the optimizer it builds.

    rows: the rows of a step's batch (`rows_per_step`). sync_mode: the sync the placement runs
    (`sync.placed_mode`: colocated, every sync is a local cast of the trainer's weights).
    """

    config: ml_collections.ConfigDict
    algorithm: Algorithm
    optimizer: Optimizer
    rows: int
    sync_mode: str

    def meshes(self, devices=None) -> tuple[Mesh, Mesh]:
        """The run's (training mesh, rollout mesh) over ``devices`` (`run_meshes`)."""
        return run_meshes(self.config, devices)

    def abstract(self, mesh: Mesh, rollout_mesh: Mesh | None = None, *,
                 model_config: ModelConfig | None = None) -> AbstractRun:
        """The run's parts from shapes, on ``mesh`` (a plan's mesh: any devices, a compile
        target's included); ``rollout_mesh`` defaults to ``mesh`` (colocated). ``model_config``
        defaults to the shape ``model.source`` names (`model_shapes.model_config_from`: "shape:",
        "random:" or "tiny")."""
        if model_config is None:
            model_config = model_shapes.model_config_from(self.config.model)
        rollout_mesh = mesh if rollout_mesh is None else rollout_mesh
        made = _assemble(self, abstract_model(model_config), None, mesh, rollout_mesh,
                         abstract=True, return_updates=self.sync_mode == "factors")
        opt_state = _placed(jax.eval_shape(self.optimizer.tx.init, self.optimizer.trained(made.params)),
                            made.opt_state_shardings)
        return AbstractRun(recipe=self, model_config=model_config, mesh=mesh,
                           rollout_mesh=rollout_mesh, policy=made.policy, params=made.params,
                           opt_state=opt_state, reference=made.reference,
                           rollout_shardings=made.rollout_shardings, update=made.update,
                           sampler=made.sampler)

    def check_shapes(self) -> None:
        """The checks that need the model's parameters (targets that match nothing or no matrix,
        ranks against widths, LoRA's adapters), on the abstract run of the model's config alone
        (`build.build_model_config`: a Hugging Face config.json, no weights): the optimizer's init
        is traced, nothing is allocated. A ValueError names the optimizer's section."""
        config = self.config
        if model_shapes.is_shape_source(config.model.source):
            return   # a plan without weights: build_model refuses it, naming launch.memory
        model_config = build.build_model_config(config.model)
        if model_config is None:
            return
        mesh, rollout_mesh = self.meshes()
        try:
            self.abstract(mesh, rollout_mesh, model_config=model_config)
        except ValueError as e:   # the optimizer's own message, with the section it comes from
            name = config.optimizer.name
            section = f"optimizer.{name}"
            message = str(e).replace("lower rank", f"lower {section}.rank")
            rank = config.optimizer.get(name, {}).get("rank")
            given = f" ({section}.rank={rank})" if rank is not None and "rank" in message else ""
            raise ValueError(f"{section} on this model{given}: {message}") from None

    def build(self) -> RunParts:
        """The run's parts on this process's devices (`RunParts`)."""
        return RunParts(self)

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> Recipe:
        """The recipe of ``config`` as it is, unchecked: what a memory plan reads (a plan may
        name a shape without weights, or rollout devices a run would need a sync for), and what
        `launch.train` makes of a config it checked before jax was imported. A run's own config
        is checked first: `checked`."""
        algorithm = algorithms.get(config.rl.algorithm)
        optimizer = optimizers.build(config.optimizer, replayed_merge=build.replays_merge(config))
        mode = sync.placed_mode(config.sync.mode, not config.sync.rollout_devices)
        return cls(config, algorithm, optimizer, rows_per_step(config), mode)

    @classmethod
    def checked(cls, config: ml_collections.ConfigDict) -> Recipe:
        """The recipe of a run: ``config`` checked (`build.validate`: every value, the rules that
        span keys, the chosen algorithm's and optimizer's own), then `of`, before any model: a bad
        value or a mismatch between sections is refused in a moment. `launch.train` does the same
        in two halves, the check before jax is imported and `of` after it."""
        build.validate(config)
        return cls.of(config)


@dataclasses.dataclass(frozen=True)
class AbstractRun:
    """A run's parts from shapes alone (`Recipe.abstract`): what the memory planner compiles.

    params / opt_state / reference: ShapeDtypeStructs with the trainer's shardings (reference
    None when the algorithm reads none). update, sampler: the trainer's own jitted programs, to be
    lowered on these. rollout_shardings: the params' layout on the rollout mesh.
    """

    recipe: Recipe
    model_config: ModelConfig
    mesh: Mesh
    rollout_mesh: Mesh
    policy: Policy
    params: dict
    opt_state: Any
    reference: dict | None
    rollout_shardings: dict
    update: PolicyUpdate
    sampler: Sampler

    @property
    def config(self) -> ml_collections.ConfigDict:
        return self.recipe.config

    @property
    def optimizer(self) -> Optimizer:
        return self.recipe.optimizer

    @property
    def sampler_mesh(self) -> Mesh:
        """The mesh the sampler runs on: the training mesh where it reads the policy's own params
        (``sync.mode='off'``, colocated: `RunParts.rollout_source`), else the rollout mesh."""
        colocated = not self.config.sync.rollout_devices
        return self.mesh if colocated and self.recipe.sync_mode == "off" else self.rollout_mesh

    @property
    def model_params(self) -> dict:
        """`params` without the optimizer's adapters: the model's own weights."""
        adapters = self.optimizer.adapters
        return self.params if adapters is None else {k: v for k, v in self.params.items()
                                                     if k != adapters.key}

    def batch(self, rows: int | None = None) -> TrainBatch:
        """An abstract TrainBatch of ``rows`` (default: a step's) on the training mesh."""
        rl = self.config.rl
        return abstract_batch(self.mesh, self.recipe.rows if rows is None else rows,
                              rl.max_prompt_length, rl.max_completion_length)

    def random_state(self, seed: int = 0) -> tuple[dict, Any]:
        """(params, opt_state) as arrays laid out as `params` and `opt_state` are: the model's
        weights drawn from ``nnx.Rngs(seed)`` straight into their shards (`build.random_model`),
        the optimizer's adapters and state at their start. For benchmarks of a shape without
        weights; a run builds its own (`RunParts`)."""
        model = build.random_model(self.model_config, seed, self.mesh)
        params = self.optimizer.with_adapters(Policy.params_of(model))
        shardings = jax.tree.map(lambda x: x.sharding, self.opt_state)
        opt_state = jax.jit(lambda p: self.optimizer.tx.init(self.optimizer.trained(p)),
                            out_shardings=shardings)(params)
        return params, opt_state


class RunParts:
    """Every long-lived part of a run, built once from its recipe (jitted functions included);
    `trainer.Run` trains with them, and runs of one config (a resumed run, tests) may share them.

    The devices hold one copy of the weights during training: the policy's. The initial weights
    (the start of every Run of these parts) wait on the host, each process keeping its own shards.
    """

    def __init__(self, recipe: Recipe):
        config = recipe.config
        distributed.check_joined(config.distributed)
        if jax.process_count() > 1 and config.sync.rollout_devices:
            raise ValueError(f"sync.rollout_devices={config.sync.rollout_devices} with "
                             f"{jax.process_count()} processes: a sampler on its own devices runs "
                             f"in one process only for now; colocate it (sync.rollout_devices=0)")
        self.recipe = recipe
        self.config = config
        self.algorithm = recipe.algorithm
        self.optimizer = recipe.optimizer
        self.tx, self.sketch = self.optimizer.tx, self.optimizer.sketch
        self.mesh, self.rollout_mesh = recipe.meshes()
        if (uneven := build.uneven_micro_batches(config.rl, self.mesh)) is not None:
            logging.warning(uneven)
        self.sync_mode = recipe.sync_mode
        if self.sync_mode != config.sync.mode:
            logging.info("sync.mode=%s with a colocated sampler runs as a local cast of the trainer's "
                         "weights (exact, no master copy or mirror); sync.rollout_devices > 0 puts "
                         "the sampler on its own devices and sends %s", config.sync.mode,
                         config.sync.mode)
        model, self.tokenizer = build.build_model(config.model, self.mesh)
        made = _assemble(recipe, model, self.tokenizer, self.mesh, self.rollout_mesh,
                         abstract=False, return_updates=self.sync_mode == "factors")
        del model
        self.policy, self.update, self.sampler = made.policy, made.update, made.sampler
        self.rollout_shardings, self.param_shardings = made.rollout_shardings, made.param_shardings
        self.reference_params = made.reference
        params = made.params
        self._initial = host_arrays.HostShards(params)
        self.rollout_spec = build.build_rollout_spec(config)
        self.grader = build.build_grader(config.rl, config.data)
        self.advantages = self.algorithm.advantages(config.rl)
        self.batch_sharding = sharding_lib.batch_sharding(self.mesh, recipe.rows)
        self.rollout_batch_sharding = sharding_lib.batch_sharding(self.rollout_mesh, recipe.rows)
        for batch_sharding in (self.batch_sharding, self.rollout_batch_sharding):  # whole groups
            process_prompts(batch_sharding, config.data.prompts_per_step, config.rl.num_generations)
        self._ref_logprobs = jax.jit(self._ref_logprobs_impl)
        self.params_finite = jax.jit(all_finite)
        self.weight_norm = jax.jit(optax.tree.norm)
        self.initial_norm = float(self.weight_norm(params))
        self._init_opt = jax.jit(lambda p: self.tx.init(self.optimizer.trained(p)),
                                 out_shardings=made.opt_state_shardings)
        del params, made

    def _ref_logprobs_impl(self, ref_params, seqs: Sequences):
        logp, _ = self.policy.completion_logprobs(ref_params, seqs, temperature=self.config.rl.temperature)
        return logp

    @property
    def initial_params(self):
        """The initial weights as numpy (one process: tests and tools read them)."""
        return self._initial.to_numpy()

    def init_state(self):
        """(params, opt_state) at the initial weights, on the training devices."""
        params = self._initial.to_devices(self.param_shardings)
        return params, self._init_opt(params)

    def rollout_source(self, params) -> RolloutSource:
        """Where rollouts are sampled from, starting at ``params`` (rollout.py)."""
        s = self.config.sync
        return rollout_source(
            self.sync_mode, params, policy=self.policy, shardings=self.rollout_shardings,
            batch_sharding=self.batch_sharding if self.sync_mode == "off" else self.rollout_batch_sharding,
            sketch=self.sketch, train_others=self.optimizer.train_others, master_copy=s.master_copy,
            dtype=s.dtype, temperature=self.config.rl.temperature)

    def reference_logprobs(self, ro: Rollouts) -> jax.Array:
        """log π_ref of the completions; zeros when the algorithm reads none (the loss never does)."""
        if self.reference_params is None:
            return jnp.zeros_like(ro.rollout_logp)
        return self._ref_logprobs(self.reference_params, ro.seqs)


def build_run(config: ml_collections.ConfigDict) -> RunParts:
    """`Recipe.checked(config).build()`: a checked config's parts, on this process's devices."""
    return Recipe.checked(config).build()
