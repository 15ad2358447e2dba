"""The dense-gradient baselines (`logra_jax.optim.baselines`): AdamW, Adafactor and GaLore, each
after global-norm clipping with non-finite steps skipped. Each one's section holds the keyword
arguments of its baseline function. They are compared in memory reports with fp32 master weights
and moments, the usual mixed precision."""

from __future__ import annotations

from typing import Callable

import ml_collections
import optax

from logra_jax.config import choices
from logra_jax.optim import warmup_constant
from logra_jax.optim.baselines import adafactor_baseline, adamw_baseline, galore_baseline
from logra_jax.rl.optimizers.base import Optimizer, OptimizerEntry


def _builder(baseline: Callable[..., optax.GradientTransformation]):
    def build(section: ml_collections.ConfigDict, *, warmup_steps: int,
              replayed_merge: bool) -> Optimizer:
        del replayed_merge   # dense updates are plain array updates: nothing to replay
        kwargs = dict(section)
        learning_rate = warmup_constant(kwargs.pop("learning_rate"), warmup_steps)
        return Optimizer(baseline(learning_rate, **kwargs), None, train_others=True,
                         kl_control=False, learning_rate=learning_rate)
    return build


ADAMW = OptimizerEntry.implementing(choices.ADAMW, build=_builder(adamw_baseline),
                                    master_weights="float32")
ADAFACTOR = OptimizerEntry.implementing(choices.ADAFACTOR, build=_builder(adafactor_baseline),
                                        master_weights="float32")
GALORE = OptimizerEntry.implementing(choices.GALORE, build=_builder(galore_baseline),
                                     master_weights="float32")
