"""How many matrix-multiply operations a compiled program performs, each loop counted as it runs.

XLA's own count (``compiled.cost_analysis()["flops"]``) adds up every instruction of the program
once: the body of a while loop counts once however many times it runs. A LoGRA or AdamW update is
loops inside loops (micro-steps, the layer scan, the merge's per-layer loop), so that count is
neither the update's operations nor a fair ratio between two updates whose loops hold different
shares of the work. Here every ``dot`` of the optimized HLO contributes

    2 · (elements of its result) · (product of the lhs contracting dims)

times the trip counts of the while loops it sits in (XLA records a loop's count in its
``backend_config`` as ``known_trip_count``; a loop without one counts once, and
``MatmulCount.unknown_loops`` says how many there were). Dots inside fusions count through the
fusion's call (so do GPU Triton GEMM fusions); a GPU backend's library GEMMs (``custom-call``s to
cuBLAS, ``__cublas$gemm`` and ``__cublas$lt$matmul``) count like dots, sized from their
``dot_dimension_numbers``; the branches of a conditional count once each. Elementwise work is not counted:
this is the arithmetic of the products, which is what LoGRA removes (the dense weight gradients).
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


@dataclasses.dataclass(frozen=True)
class MatmulCount:
    flops: float        # multiply-adds × 2, loops counted as they run
    unknown_loops: int  # while loops without a known trip count (each counted once)


def _dims(shape_text: str) -> tuple[int, ...] | None:
    match = _ARRAY.match(shape_text)
    if match is None:
        return None
    return tuple(int(d) for d in match.group(1).split(",") if d)


def count(text: str) -> MatmulCount:
    """The matmul operations of an optimized HLO module's text (``compiled.as_text()``)."""
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}   # computation → instruction → dims
    dots: dict[str, list[float]] = {}                     # computation → flops of each dot
    calls: dict[str, list[tuple[str, int]]] = {}          # computation → [(callee, times)]
    entry, computation, unknown = None, None, 0
    for line in text.splitlines():
        header = hlo_text.COMPUTATION.match(line)
        if header is not None and line.rstrip().endswith("{"):
            computation = header.group(1)
            if line.lstrip().startswith("ENTRY"):
                entry = computation
            shapes[computation], dots[computation], calls[computation] = {}, [], []
            continue
        instruction = hlo_text.INSTRUCTION.match(line)
        if instruction is None or computation is None:
            continue
        name, rest = instruction.groups()
        dims = _dims(rest)
        if dims is not None:
            shapes[computation][name] = dims
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
        for kind, callee in hlo_text.CALLED.findall(rest):
            times = 1
            if kind == "body":
                times = int(trip.group(1)) if trip else 1
                unknown += trip is None
            calls[computation].append((callee, times))
        for branches in hlo_text.BRANCHES.findall(rest):
            calls[computation] += [(b.strip().lstrip("%"), 1) for b in branches.split(",") if b.strip()]
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")

    memo: dict[str, float] = {}

    def total(name: str) -> float:
        if name not in memo:
            memo[name] = sum(dots.get(name, ())) + sum(
                times * total(callee) for callee, times in calls.get(name, ()))
        return memo[name]
    return MatmulCount(total(entry), unknown)


def of_compiled(compiled) -> MatmulCount:
    """``count`` of a ``jax.jit(...).lower(...).compile()`` result."""
    return count(compiled.as_text())
