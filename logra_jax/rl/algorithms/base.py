"""What the loop needs of an RL algorithm: one `Algorithm` record per entry of the table.

An algorithm turns a step's rewards into per-row advantages and the rollouts' log-probabilities
into the loss of one micro-batch; it may read a frozen reference model's log-probabilities (a KL
term), and it reads some ``rl.*`` keys that no other algorithm reads. The loop, the update, the
grader and the memory planner ask the record, never the algorithm's name. What the config's
checks need of it (its name, its keys, its rules that span keys) is its jax-free part,
`logra_jax.config.Choice`, which `Algorithm` extends.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import jax
import ml_collections
import numpy as np

from logra_jax.config import Choice


class Loss(Protocol):
    """The objective of one micro-batch, a loss to minimise, traced inside the jitted update.

    ``logp`` [b, C]: log π_θ of the completion tokens (differentiable); ``batch`` the micro-batch
    (`rl.update.TrainBatch`: advantages, the sampler's and the reference's log-probs, masks).
    Returns (scalar loss, {name: scalar metric}).
    """

    def __call__(self, logp: jax.Array, batch) -> tuple[jax.Array, dict[str, jax.Array]]: ...


class Advantages(Protocol):
    """Rewards → advantages, on the host. ``state`` is what the algorithm carries from step to
    step (REINFORCE's running baseline; checkpointed as the loop's ``baseline``): the call returns
    (advantages, next state)."""

    def __call__(self, rewards: np.ndarray, state: float) -> tuple[np.ndarray, float]: ...


def _never(rl: ml_collections.ConfigDict) -> bool:
    del rl
    return False


def _nothing_for_a_wrong_answer(rl: ml_collections.ConfigDict) -> float:
    del rl
    return 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Algorithm(Choice):
    """One RL algorithm, as the run's config names it (``rl.algorithm``): its record (`Choice`:
    ``name``, ``rules`` — its own ``rl.*`` keys, by their name without ``rl.``, which only it
    reads: set under another algorithm, `launch.train` warns that they are ignored — and
    ``check``, its rules that span keys, run when the config is validated) and what a run asks of
    it:

    loss: ``rl`` section → the `Loss` of one micro-batch.
    advantages: ``rl`` section → the `Advantages` of a step's rewards.
    uses_reference: ``rl`` section → whether the loss reads the reference model's log-probs: only
      then does the run keep a frozen reference on its devices (and the memory planner count one).
    failure_reward: ``rl`` section → what the grader gives a wrong answer (0 unless the algorithm
      needs a signal from all-wrong batches).
    """

    loss: Callable[[ml_collections.ConfigDict], Loss]
    advantages: Callable[[ml_collections.ConfigDict], Advantages]
    uses_reference: Callable[[ml_collections.ConfigDict], bool] = _never
    failure_reward: Callable[[ml_collections.ConfigDict], float] = _nothing_for_a_wrong_answer

    @classmethod
    def implementing(cls, record: Choice, **parts) -> Algorithm:
        """The algorithm of a built-in ``record`` (logra_jax/config/choices.py) with its ``parts``."""
        return cls(**record.fields(), **parts)
