"""What a policy sync sends and how many bytes that is, from parameter shapes alone (docs/algorithm.md §8).

With n_l the entries of leaf l, b the sampler's bytes per entry (2 for bf16) and f the factor's
(2 for the KL variant's bf16 U, 4 for the GRPO variant's fp32 U):

    full     Σ_{trainable l} n_l·b
    factors  Σ_{targets l} (stack_l·out_l·r_l·f + 4)  + 4  + Σ_{trainable non-targets l} n_l·b
             (U per layer, one fp32 weight_scale per target, one int32 update index)
    sparse   Σ_{trainable l} min(c_l·(4 + b), ⌈n_l/8⌉ + c_l·b, n_l·b)   at c_l changed entries
             (int32 indices + values, a bitmap + values, or the leaf dense: sync_sparse.py), so
             never more than full

so for the targets factors/full = Σ out·r·f / Σ out·in·b, at most max_l r_l/in_l when f = b.
"Trainable" leaves are the targets plus, unless the optimizer freezes them (the KL variant), every
other parameter: only those can change, so only those are ever sent.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from logra_jax.optim.targets import SketchSpec
from logra_jax.optim.lora import LORA_KEY
from logra_jax.rl import sync_sparse
from logra_jax.tree_paths import leaves_with_paths

INDEX_BYTES = 4        # int32 update index k
SCALE_BYTES = 4        # fp32 weight_scale per target


def trainable_paths(params, sketch: SketchSpec | None, train_others: bool = True) -> list[str]:
    """Paths of the leaves an update can change, in tree order.

    A dense optimizer (``sketch`` None) trains everything; ``train_others=False`` (the KL variant's
    frozen non-targets) keeps only the targets. Params holding LoRA adapters train those alone
    (the base is frozen): their syncs send adapters only, LoRA's native sync.
    """
    paths = [path for path, _ in leaves_with_paths(params)]
    if LORA_KEY in params:
        return [p for p in paths if p.startswith(LORA_KEY + "/")]
    if sketch is None:
        return paths
    targets = sketch.find_targets(params)  # raises if the pattern matches nothing
    return [p for p in paths if p in targets or train_others]


@dataclasses.dataclass(frozen=True)
class SyncBytes:
    """Bytes per sync of each mode for one model and optimizer setup (see the module docstring)."""

    weights: int            # every parameter in the sampler dtype: a plain copy of the bf16 weights
    full: int
    factors: int | None     # None for a dense optimizer (there are no factors)
    sparse: int             # at the assumed number of changed entries
    trainable_entries: int
    target_weights: int     # Σ_targets n_l·b
    target_factors: int     # Σ_targets stack·out·r·f
    max_rank_ratio: float   # max_l r_l / in_l over the targets (0 without targets)

    def ratio(self, mode: str) -> float:
        """Bytes of ``mode`` ("full" | "factors" | "sparse") relative to the full bf16 weights."""
        value = getattr(self, mode)
        return float("nan") if value is None else value / self.weights


def sync_bytes(params, sketch: SketchSpec | None, *, train_others: bool = True,
               itemsize: int = 2, factor_itemsize: int = 2,
               sparse_changed: int | None = None, sparse_fraction: float = 0.0) -> SyncBytes:
    """Bytes of each mode for ``params`` (arrays or ShapeDtypeStructs; only shapes are read).

    ``sparse_changed`` is the number of changed entries in one sync; when None it is
    ``sparse_fraction`` of the trainable entries (a measured or assumed fraction). Either is
    spread over the trainable leaves in proportion to their sizes, each leaf then sent in its
    cheapest encoding, padded as a real message pads it.
    """
    if not 0.0 <= sparse_fraction <= 1.0:
        raise ValueError(f"sparse_fraction must be in [0, 1], got {sparse_fraction}")
    shapes = {path: tuple(leaf.shape) for path, leaf in leaves_with_paths(params)}
    trainable = trainable_paths(params, sketch, train_others)
    targets = sketch.find_targets(params) if sketch is not None else {}
    entries = {path: math.prod(shape) for path, shape in shapes.items()}

    trainable_entries = sum(entries[p] for p in trainable)
    target_weights = sum(entries[p] for p in targets) * itemsize
    target_factors = sum(math.prod(info.sketch_shape) for info in targets.values()) * factor_itemsize
    dense_rest = sum(entries[p] for p in trainable if p not in targets) * itemsize
    factors = None
    if targets:
        factors = target_factors + SCALE_BYTES * len(targets) + INDEX_BYTES + dense_rest
    if sparse_changed is not None:
        sparse_fraction = sparse_changed / max(trainable_entries, 1)
    sparse = sum(sync_sparse.choose_encoding(round(sparse_fraction * entries[p]), entries[p],
                                             itemsize)[1] for p in trainable)
    ratios = [info.rank / info.in_dim for info in targets.values()]
    return SyncBytes(weights=sum(entries.values()) * itemsize, full=trainable_entries * itemsize,
                     factors=factors, sparse=sparse,
                     trainable_entries=trainable_entries, target_weights=target_weights,
                     target_factors=target_factors,
                     max_rank_ratio=float(np.max(ratios)) if ratios else 0.0)
