"""GRPO (docs/algorithm.md §7): group-relative advantages and the clipped surrogate, with an
optional KL term to a frozen reference model (β > 0)."""

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
class GRPOLoss:
    """`losses.grpo_loss` of one micro-batch, with the reference KL term when ``beta`` > 0.

    On-policy (``importance_correction`` None: ``rl.max_lag`` = 0) π_old is the policy itself,
    detached (one update per batch): ρ = 1 and the clip never binds. Off-policy (a lag ≥ 1) π_old
    is the behaviour policy, the log-probs the sampler recorded (``batch.rollout_logp``), and the
    ratio is corrected at ``importance_cap`` (tis | mis)."""

    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    loss_agg_mode: str = "token-mean"
    importance_correction: str | None = None
    importance_cap: float = 2.0

    def __call__(self, logp: jax.Array, batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        if self.importance_correction is None:
            old_logp, off_policy = jax.lax.stop_gradient(logp), {}
        else:
            old_logp = batch.rollout_logp
            off_policy = dict(importance_correction=self.importance_correction,
                              importance_cap=self.importance_cap)
        return losses.grpo_loss(
            logp, old_logp, batch.advantages, batch.seqs.completion_mask,
            ref_logp=batch.ref_logp if self.beta > 0 else None, epsilon=self.epsilon,
            epsilon_high=self.epsilon_high, beta=self.beta, kl_estimator=self.kl_estimator,
            loss_agg_mode=self.loss_agg_mode, **off_policy)


@dataclasses.dataclass(frozen=True)
class GroupAdvantages:
    """`losses.group_advantages` over the step's groups of ``num_generations`` rows (baseline: the
    group mean, or each response's leave-one-out mean); nothing is carried between steps."""

    num_generations: int = 2
    scale_by_std: bool = True
    baseline: str = "mean"

    def __call__(self, rewards: np.ndarray, state: float) -> tuple[np.ndarray, float]:
        adv = losses.group_advantages(jnp.asarray(rewards), self.num_generations,
                                      scale_by_std=self.scale_by_std, baseline=self.baseline)
        return np.asarray(adv), state


def loss(rl: ml_collections.ConfigDict) -> GRPOLoss:
    """π_old is the behaviour policy, corrected by ``rl.importance_correction`` at
    ``rl.importance_cap``, only when the rollouts lag (``rl.max_lag`` ≥ 1)."""
    off_policy = rl.get("max_lag", 0) >= 1
    return GRPOLoss(epsilon=rl.epsilon, epsilon_high=rl.epsilon_high or None, beta=rl.beta,
                    kl_estimator=rl.kl_estimator, loss_agg_mode=rl.loss_agg_mode,
                    importance_correction=rl.importance_correction if off_policy else None,
                    importance_cap=rl.importance_cap)


def advantages(rl: ml_collections.ConfigDict) -> GroupAdvantages:
    return GroupAdvantages(num_generations=rl.num_generations, scale_by_std=rl.scale_rewards,
                           baseline=rl.advantage_baseline)


def uses_reference(rl: ml_collections.ConfigDict) -> bool:
    """The KL term reads the reference's log-probs only when it is on (β > 0)."""
    return rl.beta > 0


GRPO = Algorithm.implementing(choices.GRPO, loss=loss, advantages=advantages,
                              uses_reference=uses_reference)
