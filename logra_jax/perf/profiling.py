"""Where a compiled program's wall time goes, from a ``jax.profiler`` trace.

XLA's CPU runtime records one trace event per operation it runs (``args.hlo_op`` names the HLO
instruction), and so does the GPU's. The events of one call are joined to the compiled program's
HLO text (instruction → opcode, ``op_name`` metadata, whether a fusion multiplies matrices) and
each operation is put in a category: the first of ``SCOPES`` whose ``jax.named_scope`` appears in
its ``op_name``, else "matmuls" (dots, and fusions around one) or "other" (elementwise work,
reductions, copies, random bits outside a scope).

Time is attributed by wall clock, not by summing event durations: XLA runs independent operations
side by side (two 1.5 ms dots on two threads take 1.5 ms of the call, not 3), so at every instant
the elapsed time is split evenly among the operations running then, and instants when none runs
(the runtime's own dispatch, loop control) are "between operations". The categories add up to the
call's wall time.

Container instructions (while, conditional, call) are left out: the operations of their bodies
have events of their own. Some operations run asynchronously (XLA:CPU's library dots: their event
covers only the launch); the runtime marks every operation's completion with an event named
"end: <instruction>", and an operation is taken to run from its start to that mark.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax

from logra_jax.perf import hlo_text

# (named scope, category): the code marks what is LoGRA's own work with these scopes. Checked in
# order: a merge inside the optimizer's scope counts as the merge.
SCOPES: tuple[tuple[str, str], ...] = (
    ("predicted_kl", "predicted KL (JVP, candidate KL)"),
    ("logra_projection", "A regenerated (random bits)"),
    ("logra_sketch", "sketch products x·Aᵀ, Hᵀ(x·Aᵀ)"),
    ("logra_merge", "merge W += U·A"),
    ("optimizer", "optimizer (moments, dense updates)"),
)
MATMULS, OTHER, IDLE = "matmuls (model)", "other ops (model)", "between operations"
_CONTAINERS = frozenset({"while", "conditional", "call"})

_OPCODE = re.compile(r"\b([a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%([^\s,}]+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    opcode: str
    op_name: str
    multiplies: bool  # a dot or convolution, or a fusion around one


def parse_hlo(text: str) -> dict[str, Instruction]:
    """Every instruction of an HLO module's text (``compiled.as_text()``), by name.

    An instruction without ``op_name`` (a copy XLA inserted, e.g. of a loop's carried state)
    takes the ``op_name`` of the instruction that runs its computation (the loop), so the copies
    inside a named scope's loop count for that scope."""
    raw: dict[str, tuple[str, str, str | None, str | None]] = {}
    has_dot: dict[str, bool] = collections.defaultdict(bool)
    caller: dict[str, str] = {}   # computation → the instruction that calls it
    computation = None
    for line in text.splitlines():
        instruction = hlo_text.INSTRUCTION.match(line)
        if instruction is None:
            header = hlo_text.COMPUTATION.match(line)
            if header is not None and line.rstrip().endswith("{"):
                computation = header.group(1)
            continue
        name, rest = instruction.groups()
        opcode = _OPCODE.search(rest)
        opcode = opcode.group(1) if opcode else "?"
        op_name = _OP_NAME.search(rest)
        calls = _CALLS.search(rest)
        called = [callee for _, callee in hlo_text.CALLED.findall(rest)]
        for branches in hlo_text.BRANCHES.findall(rest):
            called += [b.strip().lstrip("%") for b in branches.split(",")]
        for computation_name in called:
            caller.setdefault(computation_name, name)
        raw[name] = (opcode, op_name.group(1) if op_name else "", calls.group(1) if calls else None,
                     computation)
        if computation is not None and opcode in ("dot", "convolution"):
            has_dot[computation] = True

    def inherited_op_name(name: str) -> str:
        seen = set()
        while name in raw and not raw[name][1] and name not in seen:
            seen.add(name)
            name = caller.get(raw[name][3], "")
        return raw[name][1] if name in raw else ""

    return {name: Instruction(opcode, op_name or inherited_op_name(name),
                              opcode in ("dot", "convolution")
                              or (opcode == "fusion" and calls is not None and has_dot[calls]))
            for name, (opcode, op_name, calls, _) in raw.items()}


def category(instruction: Instruction | None) -> str | None:
    """The category of one operation; None for a container, whose body's events count instead."""
    if instruction is None:
        return OTHER
    if instruction.opcode in _CONTAINERS:
        return None
    for scope, name in SCOPES:
        if re.search(rf"(^|/){re.escape(scope)}(/|$)", instruction.op_name):
            return name
    return MATMULS if instruction.multiplies else OTHER


def attribute(events: list[dict], instructions: dict[str, Instruction],
              by_instruction: bool = False) -> dict[str, float]:
    """Milliseconds of wall time per category over the span of ``events`` (see module docstring).

    ``events``: the trace's complete events (``ph == "X"``) of one program's operations, each
    with ``ts`` and ``dur`` in microseconds and ``args.hlo_op``. ``by_instruction``: per HLO
    instruction instead of per category (containers still left out).
    """
    edges = []
    for op, start, end in _spans(events):
        name = category(instructions.get(op))
        if by_instruction and name is not None:
            name = op
        if name is not None and end > start:
            edges += [(start, 1, name), (end, -1, name)]
    if not edges:
        return {}
    edges.sort(key=lambda edge: (edge[0], edge[1]))
    totals: dict[str, float] = collections.defaultdict(float)
    running: collections.Counter = collections.Counter()
    now = edges[0][0]
    for t, step, name in edges:
        span = t - now
        if span > 0:
            active = sum(running.values())
            if active == 0:
                totals[IDLE] += span
            else:
                for running_name, count in running.items():
                    if count:
                        totals[running_name] += span * count / active
        running[name] += step
        now = t
    return {name: us / 1e3 for name, us in totals.items()}


def _spans(events: list[dict]) -> list[tuple[str, float, float]]:
    """(instruction, start, end) of every operation event, its end at its "end: …" mark if later.

    The i-th run of an instruction ends at the i-th mark after it: one instruction's runs are
    sequential (a loop body's next iteration starts after this one)."""
    pending: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    spans = []
    for e in sorted(events, key=lambda e: e["ts"]):
        name = e.get("name", "")
        if name.startswith("end: "):
            queue = pending.get(name[5:])
            if queue:
                i = queue.popleft()
                spans[i] = (spans[i][0], spans[i][1], max(spans[i][2], e["ts"]))
        elif e.get("args", {}).get("hlo_op"):
            pending[e["args"]["hlo_op"]].append(len(spans))
            spans.append((e["args"]["hlo_op"], e["ts"], e["ts"] + e["dur"]))
    return spans


@dataclasses.dataclass(frozen=True)
class Profile:
    wall_ms: float                  # the call, as the host clock saw it (dispatch to ready)
    categories: dict[str, float]    # ms per category; they sum to the traced span (≤ wall_ms)


def profile_call(compiled, args, *, log_dir: str | None = None,
                 by_instruction: bool = False) -> tuple[Profile, object]:
    """Runs ``compiled(*args)`` once under the profiler; (its Profile, its outputs).

    ``compiled``: a ``jax.stages.Compiled`` (``jit(f).lower(*args).compile()``), whose HLO text
    names the operations. Run it once before, so the traced call is not a first call.
    """
    instructions = parse_hlo(compiled.as_text())
    module = compiled.as_text().split("\n", 1)[0].split()[1].rstrip(",")
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = log_dir or tmp
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            tic = time.perf_counter()
            out = jax.block_until_ready(compiled(*args))
            wall_ms = 1e3 * (time.perf_counter() - tic)
        files = glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
        if not files:
            raise RuntimeError(f"jax.profiler wrote no trace under {log_dir}")
        with gzip.open(max(files, key=os.path.getmtime)) as f:
            events = json.load(f)["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and (
        e.get("name", "").startswith("end: ")
        or e.get("args", {}).get("hlo_op") and e["args"].get("hlo_module", module) == module)]
    return Profile(wall_ms=wall_ms, categories=attribute(ops, instructions, by_instruction)), out
