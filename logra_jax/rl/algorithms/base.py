"""What the loop needs of an RL algorithm: one `Algorithm` record per entry of the table.

An algorithm turns a step's rewards into per-row advantages and the rollouts' log-probabilities
into the loss of one micro-batch; it may read a frozen reference model's log-probabilities (a KL
term), and it reads some ``rl.*`` keys that no other algorithm reads. The loop, the update, the
grader and the memory planner ask the record, never the algorithm's name.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Protocol

import jax
import ml_collections
import numpy as np

from logra_jax.config import Rule


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


def _no_rule(config: ml_collections.ConfigDict) -> None:
    del config


def _nothing_for_a_wrong_answer(rl: ml_collections.ConfigDict) -> float:
    del rl
    return 0.0


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One RL algorithm, as the run's config names it (``rl.algorithm``).

    name: the value of ``rl.algorithm``.
    loss: ``rl`` section → the `Loss` of one micro-batch.
    advantages: ``rl`` section → the `Advantages` of a step's rewards.
    uses_reference: ``rl`` section → whether the loss reads the reference model's log-probs: only
      then does the run keep a frozen reference on its devices (and the memory planner count one).
    options: the ``rl.*`` keys only this algorithm reads: set under another algorithm they change
      nothing, and `launch.train` warns that they are ignored.
    check: the rules of this algorithm that span keys (the whole config), one ValueError each;
      run once, when the run's config is validated.
    failure_reward: ``rl`` section → what the grader gives a wrong answer (0 unless the algorithm
      needs a signal from all-wrong batches).
    rules: value rules (`logra_jax.config.Rule`) of ``rl.*`` keys the algorithm adds to the
      config, by their key without ``rl.``; an algorithm registered from outside the package
      brings its own (configs/base.py holds those of the built-in ones).
    """

    name: str
    loss: Callable[[ml_collections.ConfigDict], Loss]
    advantages: Callable[[ml_collections.ConfigDict], Advantages]
    uses_reference: Callable[[ml_collections.ConfigDict], bool] = _never
    options: tuple[str, ...] = ()
    check: Callable[[ml_collections.ConfigDict], None] = _no_rule
    failure_reward: Callable[[ml_collections.ConfigDict], float] = _nothing_for_a_wrong_answer
    rules: Mapping[str, Rule] = dataclasses.field(default_factory=dict)
