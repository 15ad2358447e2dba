"""What the loop needs of an optimizer (`Optimizer`), and one entry of the table (`OptimizerEntry`).

An entry builds its `Optimizer` from its section of the config (``config.optimizer.<name>``): the
optax transformation and what the update, the metrics row, the divergence check, the sync and the
memory planner need to know of it. No code outside the entries' modules branches on a name. What
the config's checks need of an entry is its jax-free record (`logra_jax.config.OptimizerChoice`),
which `OptimizerEntry` extends.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import ml_collections
import optax
from jax.sharding import NamedSharding, PartitionSpec

from logra_jax import sharding as sharding_lib
from logra_jax.config import OptimizerChoice
from logra_jax.optim import SketchSpec, skip_metrics
from logra_jax.tree_paths import leaves_with_paths


@dataclasses.dataclass(frozen=True)
class Adapters:
    """Trained parameters an optimizer adds beside the model's (LoRA's ``params[key]``).

    key: the params entry that holds them. scale: what the policy applies them with (`Policy`'s
    ``lora_scale``). init: the model's params (arrays, or ShapeDtypeStructs: it is traced) →
    {adapter key: {name: array}}. kernel_of: adapter key → path of the kernel it belongs to;
    each adapter array is laid out like that kernel's in / out axes.
    """

    key: str
    scale: float
    init: Callable[[dict], dict]
    kernel_of: Callable[[str], str]

    def added_to(self, params: dict) -> dict:
        """``params`` plus the initial adapters, each sharded like its kernel; abstract params
        (ShapeDtypeStructs, a memory plan) get abstract adapters."""
        abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
        adapters = jax.eval_shape(self.init, params) if abstract else self.init(params)
        kernels = dict(leaves_with_paths(params))

        def place(x, kernel):
            sharding = getattr(kernel, "sharding", None)
            if not isinstance(sharding, NamedSharding):
                return x
            s = (sharding_lib.sharded_like_matrix(x.shape, kernel)
                 or NamedSharding(sharding.mesh, PartitionSpec()))
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) if abstract else jax.device_put(x, s)

        return dict(params, **{self.key: {
            key: {name: place(x, kernels[self.kernel_of(key)]) for name, x in adapter.items()}
            for key, adapter in adapters.items()}})

    def shardings_beside(self, params: dict, shardings: dict) -> dict:
        """Model-param ``shardings`` (e.g. the rollout mesh's) plus those of the adapters of
        ``params``, each laid out like its kernel there."""
        by_path = dict(leaves_with_paths(shardings))
        flat = dict(leaves_with_paths(params))
        out = {}
        for key, adapter in params[self.key].items():
            path = self.kernel_of(key)
            kernel = jax.ShapeDtypeStruct(flat[path].shape, flat[path].dtype, sharding=by_path[path])
            out[key] = {name: sharding_lib.sharded_like_matrix(x.shape, kernel)
                        or NamedSharding(kernel.sharding.mesh, PartitionSpec())
                        for name, x in adapter.items()}
        return dict(shardings, **{self.key: out})


class Optimizer(NamedTuple):
    """What ``config.optimizer`` builds.

    tx: the optax chain. sketch: its SketchSpec (None for a dense optimizer). train_others: False
    when non-target params are frozen (KL variant). kl_control: the update needs a predicted-KL
    probe. learning_rate: the schedule of the step size (logged each step). subtree: the params
    entry `tx` alone trains (LoRA's adapters), None for all params. metrics: opt_state → the
    optimizer's scalars for the metrics row. skipped_key: the row's metric that says the update
    was dropped as non-finite (counted by the divergence check). adapters: parameters the
    optimizer adds to the model's (`Adapters`), or None.
    """

    tx: optax.GradientTransformation
    sketch: SketchSpec | None
    train_others: bool
    kl_control: bool
    learning_rate: optax.Schedule
    subtree: str | None = None
    metrics: Callable[[Any], dict[str, Any]] = skip_metrics
    skipped_key: str = "skipped"
    adapters: Adapters | None = None

    def trained(self, params: dict) -> dict:
        """The part of ``params`` that `tx` sees (`subtree`)."""
        return params[self.subtree] if self.subtree else params

    def with_adapters(self, params: dict) -> dict:
        """``params`` plus the optimizer's initial adapters, if it adds any."""
        return params if self.adapters is None else self.adapters.added_to(params)

    def adapter_shardings(self, params: dict, shardings: dict) -> dict:
        """Model-param ``shardings`` plus those of ``params``'s adapters, if any."""
        return shardings if self.adapters is None else self.adapters.shardings_beside(params, shardings)

    @property
    def lora_scale(self) -> float | None:
        """The scale the policy applies the adapters with (None: no adapters)."""
        return None if self.adapters is None else self.adapters.scale


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerEntry(OptimizerChoice):
    """One optimizer, as the run's config names it (``optimizer.name``): its record
    (`logra_jax.config.OptimizerChoice`: ``name``, the value of ``optimizer.name`` and the config
    section it reads, ``optimizer.<name>``; ``rules``, its section's keys by their key within the
    section; ``check``; ``low_rank_factors``) and what a run asks of it:

    build: (its section, ``warmup_steps`` = ``optimizer.warmup_steps``, ``replayed_merge`` =
      whether a rollout engine replays the trainer's merges: `rl.build.replays_merge`) → Optimizer.
    adapters: its section → the `Adapters` it adds to the model's params, for an optimizer that
      trains parameters of its own (LoRA); the built Optimizer carries them. Asked alone by what
      only reads a run's checkpoint (export: the checkpoint's layout).
    master_weights: the weights' dtype a memory comparison gives its column: None for the
      config's (or the column's ``:bf16`` / ``:fp32``), "float32" for a dense baseline, which is
      always compared in the usual mixed precision (fp32 master weights and moments).
    """

    build: Callable[..., Optimizer]
    adapters: Callable[[ml_collections.ConfigDict], Adapters] | None = None
    master_weights: str | None = None

    @classmethod
    def implementing(cls, record: OptimizerChoice, **parts) -> OptimizerEntry:
        """The optimizer of a built-in ``record`` (logra_jax/config/choices.py) with its ``parts``."""
        return cls(**record.fields(), **parts)

    def __call__(self, cfg: ml_collections.ConfigDict, *, replayed_merge: bool = True) -> Optimizer:
        """The Optimizer of ``cfg`` (the config's ``optimizer`` section)."""
        section = cfg[self.name]
        optimizer = self.build(section, warmup_steps=cfg.warmup_steps, replayed_merge=replayed_merge)
        return optimizer if self.adapters is None else optimizer._replace(adapters=self.adapters(section))
