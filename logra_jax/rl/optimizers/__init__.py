"""The optimizers a run can name (``optimizer.name``): one module and one entry each.

    name                       module      trains
    logra                      logra.py    sketched RowAdam on the targets, AdamW or nothing on the rest
    adamw, adafactor, galore   dense.py    every parameter from its dense gradient
    lora                       lora.py     rank-r adapters on the targets, the base frozen

Each module builds an `Optimizer` (base.py) from its section of the config, ``optimizer.<name>``;
`OPTIMIZERS` below is the table of the built-in ones. An optimizer from outside the package is
one module of its own and one `register(...)` call before the run is built (docs/extending.md).
The loop, the update and the memory planner ask the built `Optimizer` (its sketch, its adapters,
its metrics and skipped key), never the optimizer's name.
"""

from __future__ import annotations

from typing import Callable

import ml_collections

from logra_jax.rl import config_schema
from logra_jax.rl.optimizers.base import Adapters, Optimizer, OptimizerEntry
from logra_jax.rl.optimizers.dense import ADAFACTOR, ADAMW, GALORE
from logra_jax.rl.optimizers.logra import LOGRA
from logra_jax.rl.optimizers.lora import LORA

__all__ = ["Adapters", "OPTIMIZERS", "Optimizer", "OptimizerEntry", "adapters_of", "build", "get",
           "names", "register", "unregister"]

OPTIMIZERS: dict[str, OptimizerEntry] = {e.name: e for e in (LOGRA, ADAMW, ADAFACTOR, GALORE, LORA)}
_UNDO: dict[str, Callable[[], None]] = {}


def names() -> tuple[str, ...]:
    return tuple(OPTIMIZERS)


def get(name: str) -> OptimizerEntry:
    """The entry ``optimizer.name`` names; ValueError listing the known ones."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name must be one of {names()}, got {name!r}")
    return OPTIMIZERS[name]


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


def register(entry: OptimizerEntry) -> OptimizerEntry:
    """Adds ``entry`` to the table: ``optimizer.name=<its name>`` then builds it from the config's
    ``optimizer.<name>`` section, whose keys are checked by the entry's rules with the rest of the
    config. A name already taken is an error (`unregister` it first)."""
    if entry.name in OPTIMIZERS:
        raise ValueError(f"an optimizer named {entry.name!r} is already registered")
    OPTIMIZERS[entry.name] = entry
    _UNDO[entry.name] = config_schema.admit(
        "optimizer.name", OPTIMIZERS,
        {f"optimizer.{entry.name}.{key}": rule for key, rule in entry.rules.items()})
    return entry


def unregister(name: str) -> None:
    """Removes an optimizer `register` added (the built-in ones stay), and its rules."""
    if name not in _UNDO:
        raise ValueError(f"{name!r} was not registered from outside the package")
    del OPTIMIZERS[name]
    _UNDO.pop(name)()
    if _UNDO:   # others registered after it: their names stay valid
        config_schema.admit("optimizer.name", OPTIMIZERS, {})
