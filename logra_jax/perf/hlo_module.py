"""An optimized HLO module's text (``compiled.as_text()``) read into computations of instructions.

hlo_text.py holds the line patterns every reader of that text shares; this module goes one step
further for readers that need the whole graph (gpu_cost.py): each instruction's name, result
shape(s), opcode, operands and attributes, and each computation's instructions in the order the
text lists them (for a scheduled module, the order they run in), its parameters by number and its
root. Nothing here knows what a backend does with an instruction.
"""

from __future__ import annotations

import dataclasses
import math
import re

from logra_jax.perf import hlo_text

# Bytes per element of each XLA element type (sub-byte types round up per element: a bound).
ELEMENT_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
    "c128": 16, "token": 0,
}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](?:\{([^}]*)\})?")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_PARAMETER_NUMBER = re.compile(r"^\s*([0-9]+)\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")   # the printer's "/*index=5*/" marks in long operand lists


@dataclasses.dataclass(frozen=True)
class Array:
    """One array leaf of a result shape: its element type, dimensions and layout (minor to major,
    as printed; "" when the text prints none)."""

    dtype: str
    dims: tuple[int, ...]
    layout: str = ""

    @property
    def bytes(self) -> float:
        if self.dtype.startswith("f8") or self.dtype.startswith("f4") or self.dtype.startswith("f6"):
            size = 1   # the 8-, 6- and 4-bit float types: one byte an element at most
        else:
            size = ELEMENT_BYTES.get(self.dtype, 4)
        return math.prod(self.dims) * size


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    shape: tuple[Array, ...]   # the array leaves of the result (a tuple's, in order)
    operands: tuple[str, ...]  # operand instruction names (literals such as constant(0) left out)
    attributes: str            # everything after the operand list
    computation: str
    is_root: bool
    number: int | None = None  # N of parameter(N)

    @property
    def bytes(self) -> float:
        return sum(a.bytes for a in self.shape)

    @property
    def is_tuple(self) -> bool:
        return len(self.shape) != 1

    def called(self) -> list[tuple[str, str]]:
        """(kind, computation) of every computation this instruction runs: "calls", "body",
        "condition", "to_apply", "branch" (a conditional's), "called_computations"."""
        out = [(kind, callee) for kind, callee in hlo_text.CALLED.findall(self.attributes)]
        for branches in hlo_text.BRANCHES.findall(self.attributes):
            out += [("branch", b.strip().lstrip("%")) for b in branches.split(",") if b.strip()]
        for group in re.findall(r"called_computations=\{([^}]*)\}", self.attributes):
            out += [("called_computations", c.strip().lstrip("%")) for c in group.split(",") if c.strip()]
        return out


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]   # in the text's order
    parameters: dict[int, str]             # parameter number → instruction name
    root: str
    is_entry: bool

    def users(self) -> dict[str, list[str]]:
        """instruction → the instructions of this computation that read it (each once)."""
        out: dict[str, list[str]] = {name: [] for name in self.instructions}
        for instruction in self.instructions.values():
            for operand in dict.fromkeys(instruction.operands):
                if operand in out:
                    out[operand].append(instruction.name)
        return out


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str

    def instruction(self, computation: str, name: str) -> Instruction:
        return self.computations[computation].instructions[name]


def parse_shape(text: str) -> tuple[Array, ...]:
    """Every array leaf of a printed shape: ``bf16[2,8]{1,0}`` or a tuple of them."""
    text = _COMMENT.sub("", text)
    leaves = []
    for dtype, dims, layout in _ARRAY.findall(text):
        dims = [d.replace("<=", "").strip() for d in dims.split(",") if d.strip()]
        leaves.append(Array(dtype, tuple(int(d) for d in dims), layout.split(":")[0]))
    return tuple(leaves)


def _closing(text: str, start: int) -> int:
    """The index of the bracket that closes the one at ``start``."""
    depth = 0
    pairs = {"(": ")", "{": "}", "[": "]"}
    opening = text[start]
    for i in range(start, len(text)):
        c = text[i]
        if c == opening:
            depth += 1
        elif c == pairs[opening]:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {opening!r} in HLO text: {text[start:start + 200]}")


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside any bracket."""
    parts, depth, begin = [], 0, 0
    for i, c in enumerate(text):
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[begin:i])
            begin = i + 1
    parts.append(text[begin:])
    return [p.strip() for p in parts if p.strip()]


def parse_instruction(rest: str, name: str, computation: str, is_root: bool) -> Instruction:
    """One instruction from the text after ``%name = ``: ``<shape> <opcode>(<operands>), <attrs>``."""
    if rest.startswith("("):
        end = _closing(rest, 0) + 1
    else:
        end = rest.index(" ") if " " in rest else len(rest)
    shape_text = rest[:end]
    opcode = _OPCODE.match(rest, end)
    if opcode is None:
        raise ValueError(f"cannot read the opcode of %{name}: {rest[:200]}")
    open_at = opcode.end() - 1
    close_at = _closing(rest, open_at)
    operands, literal = [], None
    for part in _split_top(_COMMENT.sub(" ", rest[open_at + 1:close_at])):
        token = part.split()[-1]
        if token.startswith("%"):
            operands.append(token[1:])
        elif _PARAMETER_NUMBER.match(token):
            literal = int(token)
    return Instruction(name=name, opcode=opcode.group(1), shape=parse_shape(shape_text),
                       operands=tuple(operands), attributes=rest[close_at + 1:],
                       computation=computation, is_root=is_root,
                       number=literal if opcode.group(1) == "parameter" else None)


def parse(text: str) -> Module:
    """The module of an optimized HLO text; ValueError when it has no ENTRY computation."""
    computations: dict[str, Computation] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = hlo_text.COMPUTATION.match(line)
        if header is not None and line.rstrip().endswith("{"):
            is_entry = line.lstrip().startswith("ENTRY")
            current = Computation(header.group(1), {}, {}, "", is_entry)
            computations[current.name] = current
            if is_entry:
                entry = current.name
            continue
        if line.strip() == "}":
            current = None
            continue
        match = hlo_text.INSTRUCTION.match(line)
        if match is None or current is None:
            continue
        name, rest = match.groups()
        is_root = line.lstrip().startswith("ROOT")
        instruction = parse_instruction(rest, name, current.name, is_root)
        current.instructions[name] = instruction
        if is_root:
            current.root = name
        if instruction.number is not None:
            current.parameters[instruction.number] = name
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(computations, entry)
