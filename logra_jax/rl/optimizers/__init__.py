"""The optimizers a run can name (``optimizer.name``): one module and one entry each.

    name                       module      trains
    logra                      logra.py    sketched RowAdam on the targets, AdamW or nothing on the rest
    adamw, adafactor, galore   dense.py    every parameter from its dense gradient
    lora                       lora.py     rank-r adapters on the targets, the base frozen

Each module builds an `Optimizer` (base.py) from its section of the config, ``optimizer.<name>``,
with an `OptimizerEntry` that implements the optimizer's jax-free record; the records, the one
list of the optimizers, are the registry `logra_jax.config.OPTIMIZERS`
(logra_jax/config/choices.py), which the config's checks read, and an optimizer's module is
imported only when a run asks for it (`get`). An optimizer from outside the package is one module
of its own and one `register(...)` call before the run is built (docs/extending.md). The loop,
the update and the memory planner ask the built `Optimizer` (its sketch, its adapters, its
metrics and skipped key), never the optimizer's name.
"""

from __future__ import annotations

import ml_collections

from logra_jax.config import OPTIMIZERS
from logra_jax.rl.optimizers.base import Adapters, Optimizer, OptimizerEntry

__all__ = ["Adapters", "Optimizer", "OptimizerEntry", "adapters_of", "build", "get", "names",
           "register", "unregister"]

names = OPTIMIZERS.names
get = OPTIMIZERS.get            # the OptimizerEntry ``optimizer.name`` names; ValueError listing the known ones
register = OPTIMIZERS.register  # an OptimizerEntry from outside the package (docs/extending.md)
unregister = OPTIMIZERS.unregister



def build(cfg: ml_collections.ConfigDict, *, replayed_merge: bool = True) -> Optimizer:
    """The Optimizer ``cfg`` (the config's ``optimizer`` section) names, from its own section.

    ``replayed_merge`` (`rl.build.replays_merge`) decides LoGRA's ``exact_merge`` when the config
    leaves it None: order-free where a receiver replays the merge, one plain dot elsewhere."""
    return get(cfg.name)(cfg, replayed_merge=replayed_merge)


def adapters_of(cfg: ml_collections.ConfigDict) -> Adapters | None:
    """The adapters the optimizer ``cfg`` names adds to the model's params (None: none), without
    building its transformation: what reading a run's checkpoint needs."""
    entry = get(cfg.name)
    return None if entry.adapters is None else entry.adapters(cfg[entry.name])

