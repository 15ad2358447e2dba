"""The packages only the RL loop needs, and the one error line when one is missing.

``pip install .`` brings what the optax transforms, the NNX sketch, the models and the memory
planner need. The RL loop's own packages come with the ``rl`` extra (pyproject.toml): reasoning-gym
(the task prompts; its pycosat has no wheel for some Pythons), tensorboardX (the TensorBoard
writer) and matplotlib (launch.report's plots). Each is imported through `require`, in the code
path that uses it alone, so an optax user never needs them and a run that does says which extra
to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

RL = "rl"


class MissingExtra(ImportError, ValueError):
    """A package of an extra that is not installed (or does not import). Also a ValueError: a
    config or command asking for what this install lacks is bad input, which every entry point
    reports as its one ``error:`` line."""


def require(module: str, package: str, needed_by: str, extra: str = RL) -> ModuleType:
    """``import module``; where that fails, `MissingExtra` naming ``needed_by`` (what asked for
    it), the ``package`` to install and the ``extra`` that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(f"{needed_by} needs {package}, which does not import here ({e}); it "
                           f"comes with the {extra} extra: pip install -e '.[{extra}]'",
                           name=module) from None
