"""LoRA (`logra_jax.optim.lora`): rank-r adapters s·B·A on the target kernels, AdamW (after the
same clipping as the dense baselines) on the adapters only; the base frozen in the model's
param_dtype. Its section is ``optimizer.lora``."""

from __future__ import annotations

import functools

import ml_collections

from logra_jax.config import choices
from logra_jax.optim import warmup_constant
from logra_jax.optim.baselines import adamw_baseline
from logra_jax.optim.lora import LORA_KEY, init_adapters, kernel_path
from logra_jax.rl.optimizers.base import Adapters, Optimizer, OptimizerEntry


def build(section: ml_collections.ConfigDict, *, warmup_steps: int,
          replayed_merge: bool) -> Optimizer:
    del replayed_merge   # adapters are dense arrays: nothing to replay
    learning_rate = warmup_constant(section.learning_rate, warmup_steps)
    tx = adamw_baseline(learning_rate, b1=section.b1, b2=section.b2, eps=section.eps,
                        weight_decay=section.weight_decay, max_grad_norm=section.max_grad_norm)
    return Optimizer(tx, None, train_others=False, kl_control=False, learning_rate=learning_rate,
                     subtree=LORA_KEY)


def adapters(section: ml_collections.ConfigDict) -> Adapters:
    """One rank-r adapter per target kernel under ``params["lora"]``, A uniform and B zero
    (training starts at the base model), applied with s = α / r."""
    return Adapters(key=LORA_KEY, scale=section.alpha / section.rank, kernel_of=kernel_path,
                    init=functools.partial(init_adapters, targets=section.targets,
                                           rank=section.rank, seed=section.init_seed))


LORA = OptimizerEntry.implementing(choices.LORA, build=build, adapters=adapters)
