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

from logra_jax.perf import hlo_text

_ARRAY = re.compile(r"^\(?[a-z0-9]+\[([0-9,]*)\]")   # an array type, or a tuple's first one
# The first operand of a dot or a library GEMM, printed with or without its type.
_OPERAND = r"\(\s*(?:[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?\s+)?%?([^\s,)]+)"
_DOT = re.compile(r"\bdot" + _OPERAND)
_GEMM = re.compile(r"\bcustom-call" + _OPERAND + r".*custom_call_target=\"__cublas\$(?:gemm|lt\$matmul)")
_LHS_CONTRACTING = re.compile(r'lhs_contracting_(?:dims=\{([0-9,]*)\}|dimensions":\[([0-9",\s]*)\])')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"([0-9]+)"\}')
_CONVOLUTION = re.compile(r"\bconvolution\(\s*(?:[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?\s+)?%?([^\s,)]+),"
                          r"\s*(?:[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?\s+)?%?([^\s,)]+)\)")
_DIM_LABELS = re.compile(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_GROUPS = re.compile(r"(feature|batch)_group_count=([0-9]+)")
_S32_CONSTANT = re.compile(r"^s32\[\]\S*\s+constant\((-?[0-9]+)\)")
_LESS_THAN = re.compile(r"\bcompare\(.*?%?([^\s,()]+)\)\s*,\s*direction=LT")


@dataclasses.dataclass(frozen=True)
class MatmulCount:
    flops: float        # multiply-adds × 2, loops counted as they run
    unknown_loops: int  # while loops without a known trip count (each counted once)


def _dims(shape_text: str) -> tuple[int, ...] | None:
    match = _ARRAY.match(shape_text)
    if match is None:
        return None
    return tuple(int(d) for d in match.group(1).split(",") if d)


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


def _convolution_flops(rest: str, result: tuple[int, ...], lhs: tuple[int, ...],
                       rhs: tuple[int, ...]) -> float:
    labels = _DIM_LABELS.search(rest)
    if labels is None:
        raise ValueError(f"a convolution without dim_labels: {rest[:200]}")
    lhs_labels, rhs_labels, out_labels = labels.groups()
    groups = {kind: int(n) for kind, n in _GROUPS.findall(rest)}
    window = {}
    match = _WINDOW.search(rest)
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


def count(text: str) -> MatmulCount:
    """The matmul operations of an optimized HLO module's text (``compiled.as_text()``)."""
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}   # computation → instruction → dims
    dots: dict[str, list[float]] = {}                     # computation → flops of each dot
    calls: dict[str, list[tuple[str, int | str]]] = {}    # computation → [(callee, times)]:
    # times is a number, or the name of the loop's condition, whose bound `bounds` will hold.
    constants: dict[str, dict[str, int]] = {}             # computation → s32 constants
    bounds: dict[str, int] = {}                           # condition → N of its "counter < N"
    entry, computation = None, None
    for line in text.splitlines():
        header = hlo_text.COMPUTATION.match(line)
        if header is not None and line.rstrip().endswith("{"):
            computation = header.group(1)
            if line.lstrip().startswith("ENTRY"):
                entry = computation
            shapes[computation], dots[computation], calls[computation] = {}, [], []
            constants[computation] = {}
            continue
        instruction = hlo_text.INSTRUCTION.match(line)
        if instruction is None or computation is None:
            continue
        name, rest = instruction.groups()
        dims = _dims(rest)
        if dims is not None:
            shapes[computation][name] = dims
        constant = _S32_CONSTANT.match(rest)
        if constant is not None:
            constants[computation][name] = int(constant.group(1))
        less = _LESS_THAN.search(rest) if line.lstrip().startswith("ROOT") else None
        if less is not None and less.group(1) in constants[computation]:
            bounds[computation] = constants[computation][less.group(1)]
        conv = _CONVOLUTION.search(rest)
        if conv is not None and dims is not None:
            lhs, rhs = (shapes[computation].get(operand) for operand in conv.groups())
            if lhs is None or rhs is None:
                raise ValueError(f"cannot size the convolution %{name}: its operands are not in "
                                 f"the HLO text")
            dots[computation].append(_convolution_flops(rest, dims, lhs, rhs))
        dot = _DOT.search(rest) or _GEMM.search(rest)
        if dot is not None and dims is not None:
            lhs = shapes[computation].get(dot.group(1))
            contracting = _LHS_CONTRACTING.search(rest)
            if lhs is None or contracting is None:
                raise ValueError(f"cannot size the product %{name}: operand %{dot.group(1)} or "
                                 f"its contracting dims are not in the HLO text")
            axes = (contracting.group(1) or contracting.group(2) or "").replace('"', "")
            depth = math.prod(lhs[int(d)] for d in axes.split(",") if d.strip())
            dots[computation].append(2.0 * math.prod(dims) * depth)
        trip = _TRIP_COUNT.search(rest)
        called = dict((kind, callee) for kind, callee in hlo_text.CALLED.findall(rest))
        for kind, callee in hlo_text.CALLED.findall(rest):
            times: int | str = 1
            if kind == "body":
                times = int(trip.group(1)) if trip else called.get("condition", "")
            calls[computation].append((callee, times))
        for branches in hlo_text.BRANCHES.findall(rest):
            calls[computation] += [(b.strip().lstrip("%"), 1) for b in branches.split(",") if b.strip()]
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")

    trips = lambda times: times if isinstance(times, int) else bounds.get(times, 1)
    unknown = sum(1 for callees in calls.values() for _, times in callees
                  if isinstance(times, str) and times not in bounds)
    memo: dict[str, float] = {}

    def total(name: str) -> float:
        if name not in memo:
            memo[name] = sum(dots.get(name, ())) + sum(
                trips(times) * total(callee) for callee, times in calls.get(name, ()))
        return memo[name]
    return MatmulCount(total(entry), unknown)


def of_compiled(compiled) -> MatmulCount:
    """``count`` of a ``jax.jit(...).lower(...).compile()`` result."""
    return count(compiled.as_text())
