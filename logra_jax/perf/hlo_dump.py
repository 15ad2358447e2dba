"""Reading XLA's HLO dump of a compiled program: where its bytes go.

A dump (``xla_dump_to``, as `memory.update_step_memory(..., dump_dir=...)` makes one) holds, per
module, the optimized program (``<stem>.txt``) and its buffer assignment (XLA's allocations and
which bytes of which allocation each value occupies). `peak_breakdown` joins the two: the program
is read by hlo_module.py, the one reader of HLO text; the buffer assignment's lines are read here.
"""

from __future__ import annotations

import pathlib
import re

from logra_jax.perf import hlo_module

_ALLOCATION_LINE = re.compile(r"^allocation \d+: size (?P<size>\d+), (?P<kind>.*)$")
_VALUE_LINE = re.compile(r"^\s*value: <\d+ (?P<name>[^\s{]+)(?P<index>\{[\d,]*\})?(?: \(\w+\))? @\d+> "
                         r"\(size=(?P<size>\d+),offset=(?P<offset>\d+)\): (?P<shape>\S+)")
UNASSIGNED = "unassigned (between values of different lifetimes)"


def _allocations(buffer_assignment: str) -> list[tuple[int, list[tuple[str, int, int, str]]]]:
    """(size, [(value name, offset, size, shape)]) of each allocation XLA's memory analysis
    counts: in the default memory space (HBM, or host memory on CPU; a TPU's other memory spaces
    are printed with a ``color``), not a thread's scalars, not the program's constants."""
    out, values = [], None
    for line in buffer_assignment.splitlines():
        if line.startswith("allocation "):
            match = _ALLOCATION_LINE.match(line)
            kind = match["kind"] if match else ""
            counted = match and ", color " not in line and not kind.startswith(("thread-local",
                                                                                 "constant"))
            values = [] if counted else None
            if counted:
                out.append((int(match["size"]), values))
            continue
        match = _VALUE_LINE.match(line)
        if match and values is not None:
            values.append((match["name"], int(match["offset"]), int(match["size"]), match["shape"]))
    return out


def _op_label(op_name: str) -> str:
    """A JAX op's name scope as it is; a parameter's pytree path ``params['mlp']['kernel']`` as
    ``params/mlp/kernel``."""
    op_name = op_name.replace("\\'", "'")
    return re.sub(r"\['([^']*)'\]", r"/\1", op_name)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges [begin, end) merged into disjoint ones."""
    out: list[tuple[int, int]] = []
    for begin, end in sorted(spans):
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def peak_breakdown(dump_dir: str | pathlib.Path, module: str = "_step_impl") -> tuple[int, list[tuple[str, int]]]:
    """(bytes at the peak, [(buffer label, bytes)] largest first), the bytes those of XLA's own
    memory analysis: arguments + outputs − aliased outputs + temporaries.

    Read from an HLO dump (``memory.update_step_memory(..., dump_dir=...)`` or
    ``memory.rollout_step_memory(..., dump_dir=...)``): the buffer assignment lists XLA's
    allocations and the values placed in each, at an offset, over the program's run; every byte
    of an allocation is labelled once, by the largest value placed on it (a value with a JAX name
    first), so the labels add up to the allocations' sizes, which are what the memory analysis
    sums. The optimized program's metadata names the JAX op (or the parameter's path, e.g.
    ``params/layers/mlp/up_proj/kernel``) that made each value; the label is that name and the
    value's shape, else the HLO instruction's name. Bytes no value was placed on (the heap's
    gaps between values of different lifetimes) are "unassigned". XLA's list of the values live
    at its peak (the ``live-range`` file) is not this: it left out a loop's carried KV cache
    where another copy of it filled an allocation too (Gemma-3-27B's `generate`: 24.0 of its
    40.1 GiB), and a TPU compiler's list repeats a loop's carried values beside the buffers they
    share.
    """
    dump_dir = pathlib.Path(dump_dir)
    found = sorted(dump_dir.glob(f"*{module}*buffer-assignment.txt"))
    if not found:
        raise FileNotFoundError(f"no XLA buffer assignment for {module!r} in {dump_dir} (compile "
                                f"with memory.update_step_memory(..., dump_dir=...))")
    stem = found[-1].name.removesuffix("-buffer-assignment.txt")
    program = hlo_module.parse((dump_dir / f"{stem}.txt").read_text())
    ops = {name: _op_label(instruction.op_name)
           for name, instruction in program.instructions().items() if instruction.op_name}
    sizes: dict[str, int] = {}
    total = 0
    for size, values in _allocations(found[-1].read_text()):
        total += size
        claimed: list[tuple[int, int]] = []        # disjoint byte ranges already labelled
        # The largest values claim the bytes they share with smaller ones; named ones first.
        for name, offset, length, shape in sorted(values, key=lambda v: (-v[2], v[0] not in ops)):
            new = length - sum(max(0, min(offset + length, end) - max(offset, begin))
                               for begin, end in claimed)
            claimed = _merged(claimed + [(offset, offset + length)])
            if new > 0:
                label = f"{ops.get(name, name)} {shape.split('{')[0]}"   # the shape, no layout
                sizes[label] = sizes.get(label, 0) + new
        gaps = size - sum(end - begin for begin, end in claimed)
        if gaps > 0:
            sizes[UNASSIGNED] = sizes.get(UNASSIGNED, 0) + gaps
    return total, sorted(sizes.items(), key=lambda e: -e[1])
