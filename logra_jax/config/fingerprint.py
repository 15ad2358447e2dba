"""What a checkpoint records of the config that trained it, and which keys a resume may change.

A resume may change only keys that leave the saved state's meaning alone (`RESUMABLE_CHANGES`);
the rest is the config's fingerprint, written into every checkpoint, so that a resume is checked
against the checkpoint itself as well as against the workdir's config.json.
"""

from __future__ import annotations

import json
from typing import Sequence

import ml_collections

from logra_jax.config.keys import flatten

# Keys a resumed run may change: they do not change what the saved state means. The process layout
# is one of them (each process of a run has its own process_id; the checkpoint holds global arrays),
# and so is how the sampler reads its weights and how many rows it decodes at once
# (rl.decode_weights, rl.rollout_micro_batch, rl.rollout_engine, rl.rollout_slots: the same model
# and draws, another loop).
RESUMABLE_CHANGES = ("max_steps", "log.", "checkpoint.every", "checkpoint.keep", "distributed.",
                     "rl.decode_weights", "rl.rollout_micro_batch", "rl.rollout_engine",
                     "rl.rollout_slots")

# The decode program a run's sampler resolved ``rl.decode_weights="auto"`` to ("stacked" or
# "per_layer"): recorded in config.json and each checkpoint's fingerprint under this key, so that
# a resumed process runs that program (a workdir written on another platform, or by an older
# version that timed its pick).
DECODE_KEY = "rl.decode_weights"


def as_json(config: ml_collections.ConfigDict) -> dict:
    """The config as plain JSON values (what a workdir's config.json holds)."""
    return json.loads(json.dumps(config.to_dict(), default=str))


def resumable(key: str) -> bool:
    """Whether a resume may change the dotted ``key`` (`RESUMABLE_CHANGES`)."""
    return any(key == h or (h.endswith(".") and key.startswith(h)) for h in RESUMABLE_CHANGES)


def state_changes(saved: dict, current: dict) -> list[str]:
    """Keys whose value differs between two configs' JSON (nested, or flat as `fingerprint`'s),
    except `RESUMABLE_CHANGES`."""
    old, new = flatten(saved), flatten(current)
    changed = sorted(k for k in set(old) | set(new) if old.get(k, "<absent>") != new.get(k, "<absent>"))
    return [k for k in changed if not resumable(k)]


def fingerprint(config: ml_collections.ConfigDict) -> dict[str, object]:
    """{dotted key: JSON value} of every key that changes what training computes (all but
    `RESUMABLE_CHANGES`): what a checkpoint records of the config that trained it, so that a resume
    can be checked against the checkpoint itself, not only against the workdir's config.json."""
    return {k: v for k, v in flatten(as_json(config)).items() if not resumable(k)}


def recorded_decode_mode(recorded: dict | None) -> str | None:
    """The decode program ("stacked" / "per_layer") a fingerprint or a config.json (nested or flat)
    records; None when it records none (a run that never sampled, or "auto" unresolved)."""
    mode = flatten(recorded or {}).get(DECODE_KEY)
    return mode if mode in ("stacked", "per_layer") else None


def describe_changes(saved: dict, current: dict, keys: Sequence[str], most: int = 6) -> str:
    """"seed 0 → 1, optimizer.name 'logra' → 'adamw'" for ``keys`` (`state_changes`), at most
    ``most`` of them spelled out."""
    old, new = flatten(saved), flatten(current)

    def value(values, key):
        return repr(values[key]) if key in values else "(absent)"
    shown = [f"{k} {value(old, k)} → {value(new, k)}" for k in keys[:most]]
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return ", ".join(shown) + more
