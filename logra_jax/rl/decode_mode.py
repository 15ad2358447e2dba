"""Which decode loop a Sampler with ``decode_weights="auto"`` runs: measured where it runs.

A stacked decode step scans the layers over the stacked weights and KV cache; a per-layer step runs
them one after the other on per-layer arrays, split once per call (`Sampler`). Which is faster
is a property of a backend's kernels and of the shapes, not of a rule: XLA:CPU copies a scanned
layer's weights out of the stack before every dot (per-layer 1.3× faster at batch 16 on SmolLM2,
docs/results/sampler.md), and one H200 decoded SmolLM2's shape at batch 1 1.87× faster per layer
(docs/results/gpu.md), where stacked had been assumed for every accelerator. So the first call of
each input signature times both programs on its own inputs, for a few decode steps, and keeps the
faster (`Sampler._decode_mode`).

A call's seconds are modelled as fixed + tokens × per step. ``fixed`` (prefill, the per-layer
split, the first draw) comes from a call stopped after its first draw, the per-step cost from one
that decodes ``DECODE_STEPS`` more; the estimate for a whole call of ``max_completion_length``
tokens weighs the two as that call does, so a split that costs more than a few steps save is seen.
"""

from __future__ import annotations

import math
from typing import Callable

MODES = ("stacked", "per_layer")   # a tie goes to the first: no second copy of the weights
DECODE_STEPS = 4    # per mode and round: enough to see the step, cheap on a test's tiny model
ROUNDS = 3          # the best of 3 rounds, each alternating the modes: a slow spell of a shared
                    # host hits both (one round alone put a ~30 ms call at 118 ms on a loaded
                    # 2-core CPU); a round is 4 calls of a few decode steps


# The pick where nothing runs: a program lowered only to be compiled (a TPU slice's or a GPU's
# memory plan made on a CPU host, `launch.memory`), or a call traced inside another jit. stacked
# holds no second copy of the layer weights: the smaller plan, and what the plans assumed so far.
UNMEASURED = "stacked"


def estimate(time_call: Callable[[str, int], float], tokens: int) -> dict[str, float]:
    """Estimated seconds of a call drawing ``tokens`` tokens, per mode. ``time_call(mode, limit)``
    runs one call that draws at most ``limit`` tokens (compiled beforehand) and returns its
    seconds."""
    decode = min(DECODE_STEPS, tokens - 1)
    fixed = dict.fromkeys(MODES, math.inf)
    longer = dict.fromkeys(MODES, math.inf)
    for _ in range(ROUNDS):
        for mode in MODES:
            fixed[mode] = min(fixed[mode], time_call(mode, 1))
            if decode:
                longer[mode] = min(longer[mode], time_call(mode, 1 + decode))
    if not decode:   # one token: the prefill and its draw, no decode step
        return fixed
    return {mode: fixed[mode] + (tokens - 1) * max(longer[mode] - fixed[mode], 0.0) / decode
            for mode in MODES}


def pick(seconds: dict[str, float]) -> str:
    """The mode of the fewest estimated seconds (a tie: the first of MODES)."""
    return min(MODES, key=lambda mode: seconds[mode])


def describe(mode: str, seconds: dict[str, float], what: str) -> str:
    """The one line a measured choice is logged with."""
    timings = ", ".join(f"{m} {seconds[m] * 1e3:.1f} ms" for m in MODES)
    return (f"decode_weights=auto: {mode} for {what} (measured: {timings} per call, from "
            f"the best of {ROUNDS} rounds of a call stopped after its first token and one "
            f"{DECODE_STEPS} decode steps longer)")
