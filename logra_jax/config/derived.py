"""Facts a run's config implies that several parts of the package need, each derived here once:
the rows of a step's batch, the sync a placement runs, and whether a rollout engine replays
LoGRA's merges. Plain arithmetic on the config: the checks (values.py, choices.py), the trainer
and the planners all read these."""

from __future__ import annotations

import ml_collections


def rows_per_step(config: ml_collections.ConfigDict) -> int:
    """Rows of a step's batch: data.prompts_per_step × rl.num_generations (every prompt's group)."""
    return config.data.prompts_per_step * config.rl.num_generations


def placed_sync_mode(mode: str, colocated: bool) -> str:
    """The sync a placement runs: colocated, ``factors`` and ``sparse`` become ``full`` (a local
    cast: nothing crosses a wire, and the encodings would only cost memory on the trainer's devices)."""
    return "full" if colocated and mode in ("factors", "sparse") else mode


def replays_merge(config: ml_collections.ConfigDict) -> bool:
    """Whether a rollout engine re-applies LoGRA's merges from the factors (a factors sync to
    devices of its own): only then must the trainer's U·A be order-free (the same bits there)."""
    return placed_sync_mode(config.sync.mode, not config.sync.rollout_devices) == "factors"
