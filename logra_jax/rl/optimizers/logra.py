"""LoGRA (docs/algorithm.md §2–6): sketched RowAdam for the projection matrices, AdamW or freezing
for the rest, optional predicted-KL control. Its section, ``optimizer.logra``, holds the keyword
arguments of `logra_jax.optim.logra`."""

from __future__ import annotations

import ml_collections

from logra_jax.config import choices
from logra_jax.optim import logra, logra_metrics, variant_defaults, warmup_constant
from logra_jax.optim.logra import sketch_spec_of
from logra_jax.rl.optimizers.base import Optimizer, OptimizerEntry

def build(section: ml_collections.ConfigDict, *, warmup_steps: int,
          replayed_merge: bool) -> Optimizer:
    """`logra(**section)` with ``learning_rate`` warmed up over ``warmup_steps``. ``exact_merge``
    left None is decided by ``replayed_merge``: order-free where a receiver replays the merge, one
    plain dot elsewhere. The SketchSpec is the transformation's own (`sketch_spec_of`), so the
    update's probes draw the A the optimizer reconstructs with."""
    kwargs = dict(section)
    if kwargs["exact_merge"] is None:
        kwargs["exact_merge"] = replayed_merge
    learning_rate = warmup_constant(kwargs.pop("learning_rate"), warmup_steps)
    tx = logra(learning_rate=learning_rate, **kwargs)
    others, kl_control = variant_defaults(kwargs["variant"], kwargs["others"], kwargs["kl_control"])
    return Optimizer(tx, sketch_spec_of(tx), train_others=others != "frozen", kl_control=kl_control,
                     learning_rate=learning_rate, metrics=logra_metrics, skipped_key="logra/skipped")


LOGRA = OptimizerEntry.implementing(choices.LOGRA, build=build)
