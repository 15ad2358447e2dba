"""Pytree leaves named by their '/'-joined paths ("layers/mlp/up_proj/kernel").

Everything that selects parameters by name (targets, shardings, sync messages, checkpoints) uses
these, so params, optimizer state, gradients and updates of one model agree on the names. A class
that sets ``tree_path_leaf = True`` (LowRankUpdate, SketchProbe) counts as one leaf, not as its
fields.
"""

from __future__ import annotations

from typing import Any

import jax


def path_str(keypath: tuple) -> str:
    """'/'-join of a pytree key path: ("layers", "mlp", "up_proj", "kernel") → "layers/mlp/up_proj/kernel".

    A trailing ``.value`` attribute (how an ``nnx.Variable`` exposes its array) is dropped, so an
    ``nnx.State`` of Variables and its pure-dict form give the same paths.
    """
    parts = []
    for entry in keypath:
        if isinstance(entry, jax.tree_util.DictKey):
            parts.append(str(entry.key))
        elif isinstance(entry, jax.tree_util.SequenceKey):
            parts.append(str(entry.idx))
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            parts.append(entry.name)
        elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
            parts.append(str(entry.key))
        else:
            parts.append(str(entry))
    if keypath and isinstance(keypath[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


def _is_path_leaf(x) -> bool:
    return x is None or getattr(type(x), "tree_path_leaf", False)


def leaves_with_paths(tree) -> list[tuple[str, Any]]:
    """[(path string, leaf)] for every array leaf (a ``tree_path_leaf`` object counts as one).

    ``None`` and ``optax.MaskedNode`` holes are skipped.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_path_leaf)
    return [(path_str(kp), leaf) for kp, leaf in flat if leaf is not None]


def map_with_paths(fn, tree, *rest):
    """tree_map(fn(path, leaf, *rest_leaves)), ``tree_path_leaf`` objects and None as leaves."""
    return jax.tree_util.tree_map_with_path(lambda kp, x, *r: fn(path_str(kp), x, *r), tree, *rest,
                                            is_leaf=_is_path_leaf)


def nonfinite_leaves(tree) -> list[str]:
    """The paths of the floating-point leaves of ``tree`` that hold a NaN or an infinity. One
    jitted reduction over the whole tree (each array where it lies, sharded or not), one small
    transfer of its answers."""
    import jax.numpy as jnp
    named = [(path, x) for path, x in leaves_with_paths(tree)
             if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    if not named:
        return []
    finite = jax.jit(lambda xs: jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))(
        [x for _, x in named])
    return [path for (path, _), ok in zip(named, jax.device_get(finite)) if not ok]
