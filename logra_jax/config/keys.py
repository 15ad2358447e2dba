"""A run's config as dotted keys (``rl.micro_batch_size``): how every check names what it found."""

from __future__ import annotations

import ml_collections


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a.b": value} for a nested dict (a ConfigDict's ``to_dict()``)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def get(config: ml_collections.ConfigDict, dotted: str):
    """The value at ``dotted`` ("rl.beta")."""
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node
