"""REINFORCE with truncated importance weights and a running baseline: the KL variant's objective
(docs/algorithm.md §7). It has no KL term, so it never reads a reference model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from logra_jax.config import choices
from logra_jax.rl import losses
from logra_jax.rl.algorithms.base import Algorithm


@dataclasses.dataclass(frozen=True)
class ReinforceLoss:
    """`losses.reinforce_loss` of one micro-batch, weighted by π_θ / π_rollout truncated
    (``correction="tis"``) or masked (``"mis"``) at ``is_cap``; ``with_max`` (a run with a lag)
    adds the largest ratio to the metrics."""

    is_cap: float = 2.0
    loss_agg_mode: str = "token-mean"
    correction: str = "tis"
    with_max: bool = False

    def __call__(self, logp: jax.Array, batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        return losses.reinforce_loss(logp, batch.rollout_logp, batch.advantages,
                                     batch.seqs.completion_mask, is_cap=self.is_cap,
                                     loss_agg_mode=self.loss_agg_mode, correction=self.correction,
                                     with_max=self.with_max)


@dataclasses.dataclass(frozen=True)
class RunningBaselineAdvantages:
    """A = outcome − b with the running baseline b (the state), which is updated after use
    (`losses.update_baseline`), so a response never serves as its own baseline. A row with a
    non-finite reward is masked: advantage 0, and not part of the baseline."""

    momentum: float = 0.9

    def __call__(self, rewards: np.ndarray, state: float) -> tuple[np.ndarray, float]:
        adv = np.where(np.isfinite(rewards), rewards - state, 0.0).astype(np.float32)
        return adv, float(losses.update_baseline(state, jnp.asarray(rewards), momentum=self.momentum))


def loss(rl: ml_collections.ConfigDict) -> ReinforceLoss:
    """Its cap is ``rl.is_cap`` (GRPO's ``rl.importance_cap``); ``rl.importance_correction``
    chooses truncation or masking at any lag (tis at lag 0 is the KL variant's own loss)."""
    return ReinforceLoss(is_cap=rl.is_cap, loss_agg_mode=rl.loss_agg_mode,
                         correction=rl.get("importance_correction", "tis"),
                         with_max=rl.get("max_lag", 0) >= 1)


def advantages(rl: ml_collections.ConfigDict) -> RunningBaselineAdvantages:
    return RunningBaselineAdvantages(momentum=rl.baseline_momentum)


def failure_reward(rl: ml_collections.ConfigDict) -> float:
    """A wrong answer earns ``rl.failure_reward`` (−0.01 by default, §7): with one response per
    prompt, an all-wrong batch would otherwise carry no signal at all."""
    return rl.failure_reward


REINFORCE = Algorithm.implementing(choices.REINFORCE, loss=loss, advantages=advantages,
                                   failure_reward=failure_reward)
