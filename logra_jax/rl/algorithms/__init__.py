"""The RL algorithms a run can name (``rl.algorithm``): one module and one entry each.

    name        module          advantages                         reference model
    grpo        grpo.py         group-relative (mean or RLOO)      when rl.beta > 0 (its KL term)
    reinforce   reinforce.py    outcome − running baseline         never

Each module defines its loss, its advantages and an `Algorithm` (base.py) that implements the
algorithm's jax-free record; the records, the one list of the algorithms, are the registry
`logra_jax.config.ALGORITHMS` (logra_jax/config/choices.py), which the config's checks read, and
an algorithm's module is imported only when a run asks for it (`get`). An algorithm from outside
the package is one module of its own and one `register(...)` call before the run is built
(docs/extending.md). Everything that differs between algorithms is asked of the entry: no code
outside these modules branches on a name.
"""

from __future__ import annotations

from logra_jax.config import ALGORITHMS
from logra_jax.rl.algorithms.base import Advantages, Algorithm, Loss

__all__ = ["Advantages", "Algorithm", "Loss", "get", "names", "register", "unregister"]

names = ALGORITHMS.names
get = ALGORITHMS.get            # the Algorithm ``rl.algorithm`` names; ValueError listing the known ones
register = ALGORITHMS.register  # an Algorithm from outside the package (docs/extending.md)
unregister = ALGORITHMS.unregister

