"""LoGRA as optax transformations (docs/algorithm.md §2–6).

LoGRA is the method of "Scaling LLM Reinforcement Learning with Low-Rank Gradient Sketches"
(Zhang et al., arXiv 2610.06647). These modules import one another without cycles, and outside
optim/ only the package's bottom layer (projections.py: A_l(k) and the SketchProbe a target Linear
takes; tree_paths.py; sharding.py):

- order_free.py   U·A with the same bits on every backend and mesh (the merge's product, §5)
- rounding.py     fp32 → bf16 weights: to nearest, or stochastically (unbiased, keyed)
- targets.py      which weights are sketched (SketchSpec) and the trainer's probe/split/merge helpers
- row_adam.py     RowAdam (§4): sketch → direction D; state = v per output row
- predicted_kl.py predicted-KL step control (§6) and the JVP helper that predicts KL
- low_rank.py     A-dependent arithmetic: dense → sketch, reconstructed norms, LowRankUpdate merge
- transforms.py   clipping, step sizes, wrapping into LowRankUpdate, the non-finite guard (§5)
- logra.py        logra(...): the assembled chain; update_index, logra_metrics
"""

from logra_jax.optim.logra import (LOGRA_STATIC_ARGS, logra, logra_metrics, skip_metrics,
                                   update_index, variant_defaults, warmup_constant)
from logra_jax.optim.low_rank import LowRankUpdate, apply_updates, apply_updates_counting_changes
from logra_jax.optim.predicted_kl import (PredictedKLState, exact_kl, exact_kl_from_hidden,
                                          kl_budget_schedule, make_candidate_kl, make_predict_kl,
                                          predicted_kl_from_tangent, scale_by_predicted_kl)
from logra_jax.projections import KernelLayout, SketchProbe, projection, projection_keys
from logra_jax.optim.row_adam import RowAdamState, scale_by_row_adam
from logra_jax.optim.targets import (DEFAULT_TARGETS, SketchSpec, TargetInfo, make_probes,
                                     merge_targets, probe_factors, split_targets, with_factors,
                                     with_update_factors)
from logra_jax.optim.transforms import (clip_by_reconstructed_norm, scale_by_step_size,
                                        scale_by_update_ratio, skip_nonfinite,
                                        skip_nonfinite_gradients, to_low_rank_updates)

__all__ = [
    "DEFAULT_TARGETS", "KernelLayout", "LOGRA_STATIC_ARGS", "LowRankUpdate", "PredictedKLState", "RowAdamState",
    "SketchProbe", "SketchSpec", "TargetInfo", "apply_updates", "apply_updates_counting_changes", "clip_by_reconstructed_norm",
    "exact_kl", "exact_kl_from_hidden", "kl_budget_schedule", "logra", "logra_metrics",
    "make_candidate_kl", "make_predict_kl", "make_probes",
    "merge_targets", "predicted_kl_from_tangent", "probe_factors", "projection", "projection_keys",
    "scale_by_predicted_kl", "scale_by_row_adam", "scale_by_step_size", "scale_by_update_ratio",
    "skip_metrics", "skip_nonfinite", "skip_nonfinite_gradients", "split_targets", "to_low_rank_updates", "update_index", "variant_defaults",
    "warmup_constant",
    "with_factors", "with_update_factors",
]
