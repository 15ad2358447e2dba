"""Which decode loop a Sampler with ``decode_weights="auto"`` runs: a rule of the platform and the
device count, never a clock.

A stacked decode step scans the layers over the stacked weights and KV cache; a per-layer step runs
them one after the other on per-layer arrays, split once per call (`Sampler`). The two programs
compute the same arithmetic but round differently in the last bits, so whichever one a run takes
decides its numbers. A pick made by timing the two in each new process made a run and its repeat
(or its resume) differ with the machine's load; this rule makes the same config, seed, machine
and software give the same bits. `launch.sampler_bench` times both where it runs and prints
whether the rule's pick is the faster there: the evidence to change the rule with, not the run.

The evidence behind the rule (docs/results/sampler.md, docs/results/gpu.md):

- XLA:CPU copies a scanned layer's weights out of the stack before every dot: per_layer is the
  faster on XLA:CPU at batches 1–64 (1.3× at batch 16 on SmolLM2-135M).
- One GPU: XLA:GPU's Triton matmuls take an operand sliced out of a larger array only when that
  array is a parameter of the program; inside a loop every array is an element of the loop's
  state, so a stacked step copies each layer's weights (and, for attention's products, its KV
  cache) out of the stack before multiplying, about 2.7× the bytes a step needs at batch 1 and 3×
  at batch 64 for Qwen2.5-1.5B's shape (XLA:GPU's program); one H200 decoded SmolLM2's shape at
  batch 1 1.87× faster per layer (measured). per_layer.
- Weights split over several GPUs: each decode step gathers every layer's weights into a new
  array, which the matmuls read in place in either mode: stacked, without per_layer's second
  copy of the layer weights.
- A TPU: its compiler reads the stack's slices in place: stacked, the smaller plan.

A plan compiled for a machine that is not this one (`launch.memory`, `launch.cost`) lowers the
program a run there takes, by the same rule.
"""

from __future__ import annotations

MODES = ("stacked", "per_layer")


def rule(platform: str, devices: int) -> str:
    """The decode program "auto" runs for a call placed on ``devices`` devices of ``platform``
    ("cpu", "gpu", "tpu"; the module docstring gives the evidence for each branch)."""
    if platform == "cpu":
        return "per_layer"
    if platform == "gpu" and devices == 1:
        return "per_layer"
    return "stacked"


def describe(mode: str, platform: str, devices: int) -> str:
    """The one line a run logs its decode program with."""
    return (f"decode_weights=auto: {mode} on {devices} {platform} device"
            f"{'s' if devices != 1 else ''} (a rule of platform and device count, "
            f"logra_jax/rl/decode_mode.py; `python -m launch.sampler_bench` times both here)")
