"""The RL algorithms a run can name (``rl.algorithm``): one module and one entry each.

    name        module          advantages                         reference model
    grpo        grpo.py         group-relative (mean or RLOO)      when rl.beta > 0 (its KL term)
    reinforce   reinforce.py    outcome − running baseline         never

Each module defines its loss, its advantages and an `Algorithm` record (base.py); `ALGORITHMS`
below is the table of the built-in ones. An algorithm from outside the package is one module of
its own and one `register(...)` call before the run is built (docs/extending.md). Everything that
differs between algorithms is asked of the record: no code outside these modules branches on a
name.
"""

from __future__ import annotations

from typing import Callable

from logra_jax.rl import config_schema
from logra_jax.rl.algorithms.base import Advantages, Algorithm, Loss
from logra_jax.rl.algorithms.grpo import GRPO
from logra_jax.rl.algorithms.reinforce import REINFORCE

__all__ = ["ALGORITHMS", "Advantages", "Algorithm", "Loss", "get", "names", "register", "unregister"]

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (GRPO, REINFORCE)}
_UNDO: dict[str, Callable[[], None]] = {}


def names() -> tuple[str, ...]:
    return tuple(ALGORITHMS)


def get(name: str) -> Algorithm:
    """The algorithm ``rl.algorithm`` names; ValueError listing the known ones."""
    if name not in ALGORITHMS:
        raise ValueError(f"rl.algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, "
                         f"got {name!r}")
    return ALGORITHMS[name]


def register(algorithm: Algorithm) -> Algorithm:
    """Adds ``algorithm`` to the table: ``rl.algorithm=<its name>`` then runs it, and its own
    ``rl.*`` keys are checked by their rules with the rest of the config. A name already taken is
    an error (`unregister` it first)."""
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"an RL algorithm named {algorithm.name!r} is already registered")
    ALGORITHMS[algorithm.name] = algorithm
    _UNDO[algorithm.name] = config_schema.admit(
        "rl.algorithm", ALGORITHMS, {f"rl.{key}": rule for key, rule in algorithm.rules.items()},
        algorithm_options=(algorithm.name, algorithm.options))
    return algorithm


def unregister(name: str) -> None:
    """Removes an algorithm `register` added (the built-in ones stay), and its rules."""
    if name not in _UNDO:
        raise ValueError(f"{name!r} was not registered from outside the package")
    del ALGORITHMS[name]
    _UNDO.pop(name)()
    if _UNDO:   # others registered after it: their names stay valid
        config_schema.admit("rl.algorithm", ALGORITHMS, {})
