"""Reading XLA's HLO dump of a compiled program: where the bytes live at its memory peak.

A dump (``xla_dump_to``, as `memory.update_step_memory(..., dump_dir=...)` makes one) holds, per
module, the optimized program (``<stem>.txt``), its buffer assignment (which bytes of which
allocation each value occupies) and its ``live-range`` file (the values live at each point of
the schedule, the peak among them). `peak_breakdown` joins the three. hlo_text.py holds the line
shapes of the program text that the profilers share; these are the dump's other files.
"""

from __future__ import annotations

import pathlib
import re

_LIVE_LINE = re.compile(r"^\s+(?P<name>[^\s{]+)(?P<index>\{[\d,]*\}): (?P<bytes>\d+) bytes")
_VALUE_LINE = re.compile(r"^\s*value: <\d+ (?P<name>[^\s{]+)(?P<index>\{[\d,]*\})?(?: \(\w+\))? @\d+> "
                         r"\(size=(?P<size>\d+),offset=(?P<offset>\d+)\): (?P<shape>\S+)")
_OP_NAME = re.compile(r'^\s*(?:ROOT )?%(?P<name>\S+) = .*?metadata=\{op_name="(?P<op>(?:[^"\\]|\\.)*)"', re.M)


def _value_places(buffer_assignment: str) -> dict[str, tuple[int, int, int, str]]:
    """Each value's (allocation, offset, size, shape), by its name and tuple index, for the
    allocations in the default memory space (HBM, or host memory on CPU); a TPU's other memory
    spaces are printed with a ``color`` and hold no HBM bytes."""
    places, allocation = {}, None
    for line in buffer_assignment.splitlines():
        if line.startswith("allocation "):
            allocation = None if ", color " in line else int(line.split()[1].rstrip(":"))
            continue
        match = _VALUE_LINE.match(line)
        if match and allocation is not None:
            key = match["name"] + (match["index"] or "{}")
            places.setdefault(key, (allocation, int(match["offset"]), int(match["size"]), match["shape"]))
    return places


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
    """(bytes live at the peak, [(buffer label, bytes)] largest first).

    Read from an HLO dump made with ``memory.update_step_memory(..., dump_dir=...)``: XLA's
    ``*-live-range.txt`` lists the values live at the peak, the buffer assignment says which bytes
    of which allocation each one occupies, and the optimized program's metadata names the JAX op
    (or the parameter's path, e.g. ``params/layers/mlp/up_proj/kernel``) that made it; the label
    is that name and the buffer's shape, else the HLO instruction's name. Bytes are counted once:
    a loop's carried values share the buffers of the values outside the loop, and the TPU
    compiler lists both (its own "stack trace breakdown" adds them up: 8.2 GiB at a 4.9 GiB peak).
    """
    dump_dir = pathlib.Path(dump_dir)
    ranges = sorted(dump_dir.glob(f"*{module}*live-range.txt"))
    if not ranges:
        raise FileNotFoundError(f"no XLA live-range file for {module!r} in {dump_dir} (compile with "
                                f"memory.update_step_memory(..., dump_dir=...))")
    stem = ranges[-1].name.removesuffix("-live-range.txt")
    places = _value_places((dump_dir / f"{stem}-buffer-assignment.txt").read_text())
    ops = {m["name"]: _op_label(m["op"]) for m in _OP_NAME.finditer((dump_dir / f"{stem}.txt").read_text())}
    lines = ranges[-1].read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().endswith("(peak):")), None)
    if start is None:
        raise ValueError(f"{ranges[-1]} has no 'Live ranges at ... (peak)' section")
    live = [m for m in map(_LIVE_LINE.match, lines[start + 1:]) if m]   # the section's lines
    live = [(m["name"], places[m["name"] + m["index"]]) for m in live if m["name"] + m["index"] in places]
    live.sort(key=lambda v: v[0] not in ops)     # values with a JAX name claim shared bytes first
    covered: dict[int, list[tuple[int, int]]] = {}
    sizes: dict[str, int] = {}
    for name, (allocation, offset, size, shape) in live:
        spans = covered.setdefault(allocation, [])   # disjoint byte ranges already counted
        new = size - sum(max(0, min(offset + size, end) - max(offset, begin)) for begin, end in spans)
        covered[allocation] = _merged(spans + [(offset, offset + size)])
        if new > 0:
            label = f"{ops.get(name, name)} {shape.split('{')[0]}"   # the shape without its layout
            sizes[label] = sizes.get(label, 0) + new
    entries = sorted(sizes.items(), key=lambda e: -e[1])
    return sum(sizes.values()), entries
