"""How many matrix-multiply operations a compiled program performs, each loop counted as it runs.

XLA's own count (``compiled.cost_analysis()["flops"]``) adds up every instruction of the program
once: the body of a while loop counts once however many times it runs. A LoGRA or AdamW update is
loops inside loops (micro-steps, the layer scan, the merge's per-layer loop), so that count is
neither the update's operations nor a fair ratio between two updates whose loops hold different
shares of the work. Here every ``dot`` of the optimized HLO contributes

    2 · (elements of its result) · (product of the lhs contracting dims)

times the trip counts of the while loops it sits in (XLA:CPU and GPU record a loop's count in its
``backend_config`` as ``known_trip_count``; the TPU compiler does not, and there the count is read
from the loop's condition, ``counter < N`` with N a constant: JAX's scans count from 0 by 1. A
loop with neither counts once, and ``MatmulCount.unknown_loops`` says how many there were). Dots
inside fusions count through the fusion's call (so do GPU Triton GEMM fusions); a GPU backend's
library GEMMs (``custom-call``s to cuBLAS, ``__cublas$gemm`` and ``__cublas$lt$matmul``) count
like dots, sized from their ``dot_dimension_numbers``. The TPU compiler writes products as
``convolution``s: each counts 2 · (output batch × output features) · (input features / feature
groups) · the window positions that meet the input (padding and dilation excluded), so a product
written as a convolution counts as the dot it is. The branches of a conditional count once each.
Elementwise work is not counted: this is the arithmetic of the products, which is what LoGRA
removes (the dense weight gradients).
"""

from __future__ import annotations

import dataclasses
import math
import re

from logra_jax.perf import hlo_module

_LHS_CONTRACTING = re.compile(r'lhs_contracting_(?:dims=\{([0-9,]*)\}|dimensions":\[([0-9",\s]*)\])')
_DIM_LABELS = re.compile(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_GROUPS = re.compile(r"(feature|batch)_group_count=([0-9]+)")
_DIRECTION_LT = re.compile(r"\bdirection=LT\b")
# A GPU backend's library GEMMs, by their custom call's target.
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")


@dataclasses.dataclass(frozen=True)
class MatmulCount:
    flops: float        # multiply-adds × 2, loops counted as they run
    unknown_loops: int  # while loops without a known trip count (each counted once)


def _window_positions(out: int, size: int, inp: int, stride: int = 1, pad_low: int = 0,
                      lhs_dilate: int = 1, rhs_dilate: int = 1) -> int:
    """(output position, window position) pairs of one spatial dim whose input point exists: the
    point o·stride + k·rhs_dilate − pad_low of the lhs-dilated input, inside it and not a hole."""
    last = (inp - 1) * lhs_dilate
    pairs = 0
    for k in range(size):
        offset = k * rhs_dilate - pad_low
        if lhs_dilate == 1:   # the o with 0 ≤ o·stride + offset ≤ last, counted in closed form
            lo = max(0, -(offset // stride))
            hi = min(out - 1, (last - offset) // stride)
            pairs += max(0, hi - lo + 1)
        else:
            pairs += sum(1 for o in range(out) if 0 <= o * stride + offset <= last
                         and (o * stride + offset) % lhs_dilate == 0)
    return pairs


def _convolution_flops(attributes: str, result: tuple[int, ...], lhs: tuple[int, ...],
                       rhs: tuple[int, ...]) -> float:
    labels = _DIM_LABELS.search(attributes)
    if labels is None:
        raise ValueError(f"a convolution without dim_labels: {attributes[:200]}")
    lhs_labels, rhs_labels, out_labels = labels.groups()
    groups = {kind: int(n) for kind, n in _GROUPS.findall(attributes)}
    window = {}
    match = _WINDOW.search(attributes)
    for item in (match.group(1).split() if match else []):
        key, _, value = item.partition("=")
        window[key] = value.split("x")
    macs = (result[out_labels.index("b")] * result[out_labels.index("f")]
            * lhs[lhs_labels.index("f")] // groups.get("feature", 1))
    for n, dim in enumerate(sorted(c for c in out_labels if c.isdigit())):
        field = lambda key, default: int(window[key][n]) if key in window else default
        pad_low = int(window["pad"][n].split("_")[0]) if "pad" in window else 0
        macs *= _window_positions(result[out_labels.index(dim)], rhs[rhs_labels.index(dim)],
                                  lhs[lhs_labels.index(dim)], field("stride", 1), pad_low,
                                  field("lhs_dilate", 1), field("rhs_dilate", 1))
    return 2.0 * macs


def _product_flops(instruction: hlo_module.Instruction,
                   computation: hlo_module.Computation) -> float | None:
    """2 × the multiply-adds of a dot, a library GEMM or a convolution; None for anything else."""
    if not instruction.shape:
        return None
    result = instruction.shape[0].dims   # a GEMM's tuple result: the product, then its workspace

    def dims(operand: str) -> tuple[int, ...] | None:
        found = computation.instructions.get(operand)
        return found.shape[0].dims if found is not None and found.shape else None
    if instruction.opcode == "convolution":
        lhs, rhs = (dims(operand) for operand in instruction.operands[:2])
        if lhs is None or rhs is None:
            raise ValueError(f"cannot size the convolution %{instruction.name}: its operands are "
                             f"not in the HLO text")
        return _convolution_flops(instruction.attributes, result, lhs, rhs)
    if instruction.opcode == "dot" or (instruction.opcode == "custom-call"
                                       and (instruction.target or "").startswith(_GEMM_TARGETS)):
        operand = instruction.operands[0]
        lhs = dims(operand)
        contracting = _LHS_CONTRACTING.search(instruction.attributes)
        if lhs is None or contracting is None:
            raise ValueError(f"cannot size the product %{instruction.name}: operand %{operand} or "
                             f"its contracting dims are not in the HLO text")
        axes = (contracting.group(1) or contracting.group(2) or "").replace('"', "")
        depth = math.prod(lhs[int(d)] for d in axes.split(",") if d.strip())
        return 2.0 * math.prod(result) * depth
    return None


def _loop_bound(condition: hlo_module.Computation) -> int | None:
    """N of a loop condition whose root is ``counter < N``, N an s32 constant of the condition
    (how the TPU compiler leaves a scan's count); None for any other condition."""
    root = condition.instructions.get(condition.root)
    if root is None or root.opcode != "compare" or not _DIRECTION_LT.search(root.attributes):
        return None
    bound = condition.instructions.get(root.operands[-1])
    if (bound is not None and bound.opcode == "constant" and bound.literal is not None
            and [(a.dtype, a.dims) for a in bound.shape] == [("s32", ())]):
        return bound.literal
    return None


def count(text: str) -> MatmulCount:
    """The matmul operations of an optimized HLO module's text (``compiled.as_text()``)."""
    return count_module(hlo_module.parse(text))


def count_module(module: hlo_module.Module) -> MatmulCount:
    """`count` of a module hlo_module.parse has read."""
    dots: dict[str, list[float]] = {}                     # computation → flops of each product
    calls: dict[str, list[tuple[str, int | str]]] = {}    # computation → [(callee, times)]:
    # times is a number, or the name of the loop's condition, whose bound `bounds` will hold.
    bounds: dict[str, int] = {}                           # condition → N of its "counter < N"
    for name, computation in module.computations.items():
        dots[name], calls[name] = [], []
        bound = _loop_bound(computation)
        if bound is not None:
            bounds[name] = bound
        for instruction in computation.instructions.values():
            flops = _product_flops(instruction, computation)
            if flops is not None:
                dots[name].append(flops)
            called = instruction.called()
            condition = dict(called).get("condition", "")
            for kind, callee in called:
                times: int | str = 1
                if kind == "body":
                    trips = instruction.trip_count
                    times = trips if trips is not None else condition
                calls[name].append((callee, times))

    trips = lambda times: times if isinstance(times, int) else bounds.get(times, 1)
    unknown = sum(1 for callees in calls.values() for _, times in callees
                  if isinstance(times, str) and times not in bounds)
    memo: dict[str, float] = {}

    def total(name: str) -> float:
        if name not in memo:
            memo[name] = sum(dots.get(name, ())) + sum(
                trips(times) * total(callee) for callee, times in calls.get(name, ()))
        return memo[name]
    return MatmulCount(total(module.entry), unknown)


def of_compiled(compiled) -> MatmulCount:
    """``count`` of a ``jax.jit(...).lower(...).compile()`` result."""
    return count(compiled.as_text())
