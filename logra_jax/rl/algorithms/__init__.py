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

from logra_jax.rl import config_schema
from logra_jax.rl.algorithms.base import Advantages, Algorithm, Loss
from logra_jax.rl.algorithms.grpo import GRPO
from logra_jax.rl.algorithms.reinforce import REINFORCE

__all__ = ["ALGORITHMS", "Advantages", "Algorithm", "Loss", "get", "names", "register", "unregister"]

_REGISTRY: config_schema.Registry[Algorithm] = config_schema.Registry(
    "rl.algorithm", "an RL algorithm", (GRPO, REINFORCE),
    rules_of=lambda a: {f"rl.{key}": rule for key, rule in a.rules.items()},
    options_of=lambda a: (a.name, a.options))
ALGORITHMS: dict[str, Algorithm] = _REGISTRY.table
names = _REGISTRY.names
get = _REGISTRY.get            # the algorithm ``rl.algorithm`` names; ValueError listing the known ones
register = _REGISTRY.register  # ``rl.algorithm=<its name>`` then runs it (docs/extending.md)
unregister = _REGISTRY.unregister
