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

from logra_jax.perf import hlo_module

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
_MULTIPLY = frozenset({"dot", "convolution"})


def op_names(module: hlo_module.Module) -> dict[str, str]:
    """instruction → the ``op_name`` it runs under, for every instruction of ``module``.

    An instruction without ``op_name`` (a copy XLA inserted, e.g. of a loop's carried state)
    takes the ``op_name`` of the instruction that runs its computation (the loop; the first in
    the text when several do), so the copies inside a named scope's loop count for that scope."""
    instructions = module.instructions()
    caller = {computation: callers[0] for computation, callers in module.callers().items()}

    def inherited(instruction: hlo_module.Instruction) -> str:
        seen = set()
        while not instruction.op_name and instruction.name not in seen:
            seen.add(instruction.name)
            if instruction.computation not in caller:
                return ""
            instruction = caller[instruction.computation]
        return instruction.op_name
    return {name: inherited(instruction) for name, instruction in instructions.items()}


def multiplies(module: hlo_module.Module, instruction: hlo_module.Instruction) -> bool:
    """A dot or convolution, or a fusion whose computation holds one."""
    if instruction.opcode in _MULTIPLY:
        return True
    if instruction.opcode != "fusion":
        return False
    fused = next((module.computations.get(callee) for kind, callee in instruction.called()
                  if kind == "calls"), None)
    return fused is not None and any(i.opcode in _MULTIPLY for i in fused.instructions.values())


def category(opcode: str, op_name: str, multiplies: bool) -> str | None:
    """The category of one operation; None for a container, whose body's events count instead."""
    if opcode in _CONTAINERS:
        return None
    for scope, name in SCOPES:
        if re.search(rf"(^|/){re.escape(scope)}(/|$)", op_name):
            return name
    return MATMULS if multiplies else OTHER


def categories(module: hlo_module.Module) -> dict[str, str | None]:
    """instruction → its `category`, for every instruction of ``module``."""
    names = op_names(module)
    return {name: category(instruction.opcode, names[name], multiplies(module, instruction))
            for name, instruction in module.instructions().items()}


def attribute(events: list[dict], categories: dict[str, str | None],
              by_instruction: bool = False) -> dict[str, float]:
    """Milliseconds of wall time per category over the span of ``events`` (see module docstring).

    ``events``: the trace's complete events (``ph == "X"``) of one program's operations, each
    with ``ts`` and ``dur`` in microseconds and ``args.hlo_op``; ``categories``: each HLO
    instruction's (`categories`), an operation the program text does not name counting as
    "other". ``by_instruction``: per HLO instruction instead of per category (containers still
    left out).
    """
    edges = []
    for op, start, end in _spans(events):
        name = categories.get(op, OTHER)
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
    module = hlo_module.parse(compiled.as_text())
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
        or e.get("args", {}).get("hlo_op") and e["args"].get("hlo_module", module.name) == module.name)]
    return Profile(wall_ms=wall_ms, categories=attribute(ops, categories(module), by_instruction)), out
