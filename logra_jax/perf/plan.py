"""A config's run as every planner sees it: its meshes, its rows and its programs, made once.

    p = plan(config, devices)       the trainer's own meshes over ``devices`` (`run_meshes`: the
                                    training mesh, the rollout mesh of ``sync.rollout_mesh``), the
                                    rows of a step, and the run's parts from shapes (one
                                    `Recipe.abstract`)
    p.lower_update(micro_steps)     the trainer's jitted update, lowered on abstract inputs
    p.lower_generate(rows, mode)    the sampler's generate, lowered where the trainer samples
                                    (`AbstractRun.sampler_mesh`), on the weights laid out as there

The memory planner (memory.py, launch.memory), the XLA:GPU cost model (gpu_programs.py,
launch.cost) and the benchmarks lower these programs and compile them; nothing is allocated.
`Plan.on` takes meshes a caller made itself (a compile target's mesh over all its devices).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from logra_jax import sharding as sharding_lib
from logra_jax.optim import predicted_kl
from logra_jax.rl import build
from logra_jax.rl.assembly import AbstractRun, Recipe, run_meshes
from logra_jax.rl.optimizers import Optimizer
from logra_jax.rl.update import TrainBatch


@dataclasses.dataclass(frozen=True)
class LoweredUpdate:
    """One update of a config lowered for a mesh's devices (not compiled), with its abstract inputs."""

    lowered: jax.stages.Lowered
    params: dict
    opt_state: object
    batch: TrainBatch
    optimizer: Optimizer
    micro_steps: int


@dataclasses.dataclass(frozen=True)
class LoweredGenerate:
    """The sampler's ``generate`` of a config lowered for a mesh's devices (not compiled), with its
    abstract arguments: the bf16 weights it samples with and the prompts."""

    lowered: jax.stages.Lowered
    weights: dict
    prompts: tuple
    rows: int
    rows_per_pass: int


def _bf16_on(params: dict, shardings: dict) -> dict:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=s),
                        params, shardings)


@dataclasses.dataclass(frozen=True)
class Plan(AbstractRun):
    """One config's run from shapes (`AbstractRun`: its meshes, params, optimizer state,
    reference, update and sampler), and how the planners lower its programs."""

    @classmethod
    def on(cls, config: ml_collections.ConfigDict, mesh: Mesh, rollout_mesh: Mesh | None = None) -> Plan:
        """The plan of ``config`` on meshes given (``rollout_mesh`` default ``mesh``: colocated)."""
        run = Recipe.of(config).abstract(mesh, rollout_mesh)
        return cls(**{f.name: getattr(run, f.name) for f in dataclasses.fields(run)})

    @property
    def rows(self) -> int:
        """Rows of a step's batch (`logra_jax.config.rows_per_step`)."""
        return self.recipe.rows

    def sampler_weights(self) -> dict:
        """The bf16 weights the sampler samples with (LoRA's adapters included), laid out on
        `sampler_mesh` as the trainer lays them out there."""
        on_rollout = self.sampler_mesh is not self.mesh
        return _bf16_on(self.params, self.rollout_shardings if on_rollout
                        else jax.tree.map(lambda x: x.sharding, self.params))

    def lower_update(self, micro_steps: int | None = None) -> LoweredUpdate:
        """The trainer's update lowered on the training mesh with abstract inputs; no arrays.
        ``micro_steps``: a batch of that many micro-batches of ``rl.micro_batch_size`` rows
        (default: a step's rows)."""
        rl, rows = self.config.rl, self.rows
        if micro_steps is not None:
            if micro_steps <= 0:
                raise ValueError(f"micro_steps must be positive, got {micro_steps}")
            rows = micro_steps * rl.micro_batch_size
        if rows % rl.micro_batch_size:
            raise ValueError(f"{rows} rows per update are not a multiple of rl.micro_batch_size="
                             f"{rl.micro_batch_size}")
        params, opt_state, batch = self.params, self.opt_state, self.batch(rows)
        with predicted_kl.host_checks_left_out():   # a plan never runs: see there
            lowered = self.update.jitted(params, opt_state).lower(params, opt_state, batch)
        return LoweredUpdate(lowered, params, opt_state, batch, self.optimizer,
                             rows // rl.micro_batch_size)

    def lower_generate(self, rows: int | None = None,
                       decode_weights: str | None = None) -> LoweredGenerate:
        """The trainer's sampler lowered on `sampler_mesh` for ``rows`` prompts (default: a
        step's), with the prompt window plus the completion length of cache; no arrays.
        ``decode_weights`` as `Sampler`'s, default ``rl.decode_weights``: "auto" lowers the
        program `decode_mode.rule` picks for the mesh's platform and devices, the one a run
        there executes."""
        rl, mesh = self.config.rl, self.sampler_mesh
        sampler = self.sampler
        if decode_weights:   # the same policy, another decode program
            rl = ml_collections.ConfigDict(rl.to_dict())
            rl.decode_weights = decode_weights
            sampler = build.build_sampler(rl, self.policy)
        rows = self.rows if rows is None else rows
        weights = self.sampler_weights()
        on_rows = sharding_lib.batch_sharding(mesh, rows)
        replicated = NamedSharding(mesh, P())
        tokens = jax.ShapeDtypeStruct((rows, rl.max_prompt_length), jnp.int32, sharding=on_rows)
        mask = jax.ShapeDtypeStruct((rows, rl.max_prompt_length), jnp.bool_, sharding=on_rows)
        key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
        temperature = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
        lowered = sampler.program.lower(weights, tokens, mask, key, temperature,
                                        top_k=int(rl.top_k), top_p=float(rl.top_p), greedy=False,
                                        mesh=sampler.mesh_of(weights, tokens))
        return LoweredGenerate(lowered, weights, (tokens, mask), rows,
                               rl.rollout_micro_batch or rows)


def planned(config: ml_collections.ConfigDict, mesh: dict[str, int] | None = None,
            rollout_devices: int | None = None) -> ml_collections.ConfigDict:
    """A copy of ``config`` with a planner's overrides: the training mesh's axis sizes ``mesh``
    and the sampler's own devices ``rollout_devices`` (each None: the config's). The rest, the
    rollout mesh's layout (``sync.rollout_mesh``) among it, stays the run's."""
    config = config.copy_and_resolve_references()
    if mesh is not None:
        config.mesh = ml_collections.ConfigDict(dict(mesh))
    if rollout_devices is not None:
        config.sync.rollout_devices = rollout_devices
    return config


def plan_meshes(config: ml_collections.ConfigDict, devices=None) -> tuple[Mesh, Mesh]:
    """(training mesh, rollout mesh) of a plan of ``config`` over ``devices`` (default: this
    process's): the trainer's (`run_meshes`), the training mesh allowed fewer devices than given
    (a plan of a smaller mesh on a larger machine)."""
    return run_meshes(config, devices, spare_devices=True)


def plan(config: ml_collections.ConfigDict, devices=None) -> Plan:
    """The plan of ``config`` on its meshes over ``devices`` (`plan_meshes`)."""
    return Plan.on(config, *plan_meshes(config, devices))
