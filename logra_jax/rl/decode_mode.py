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


# The pick where nothing runs (a program lowered only to be compiled: a TPU slice's or a GPU's
# memory plan made on a CPU host, `launch.memory`; a call traced inside another jit), except on
# one GPU (`unmeasured`). stacked holds no second copy of the layer weights: the smaller plan.
UNMEASURED = "stacked"


def unmeasured(platform: str, devices: int) -> str:
    """The mode a program lowered without running takes, for ``devices`` of ``platform``: what
    a run there is expected to measure faster, so that a plan is of the program a run executes.

    On one GPU, per_layer. XLA:GPU's compiled decode step shows why: its Triton matmuls take an
    operand sliced out of a larger array only when that array is a parameter of the program, and
    inside a loop every array is an element of the loop's state, so a stacked step copies each
    layer's weights (and, for attention's products, its KV cache) out of the stack before
    multiplying, about 2.7× the bytes a step needs at batch 1 and 3× at batch 64 for
    Qwen2.5-1.5B's shape; the per-layer arrays are read where they lie (docs/results/sampler.md).
    Where the weights are split over several devices each decode step gathers every layer's
    weights into a new array, which the matmuls read in place in either mode: stacked, without
    the second copy. Elsewhere (XLA:CPU, a TPU, whose compiler reads the stack's slices in
    place) `UNMEASURED`.
    """
    if platform == "gpu" and devices == 1:
        return "per_layer"
    return UNMEASURED


def estimate(time_call: Callable[[str, int], float], tokens: int,
             decode_steps: int = DECODE_STEPS) -> dict[str, float]:
    """Estimated seconds of a call drawing ``tokens`` tokens, per mode. ``time_call(mode, limit)``
    runs one call that draws at most ``limit`` tokens (compiled beforehand) and returns its
    seconds. ``decode_steps``: the decode steps of the longer call (a GPU's sampler decodes whole
    chunks, `sampler.DECODE_CHUNK`, so it times one chunk)."""
    decode = min(decode_steps, tokens - 1)
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
