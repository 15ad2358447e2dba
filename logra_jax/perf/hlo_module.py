"""The one reader of XLA's optimized HLO text (``compiled.as_text()``) in perf/.

Every module here that reads a compiled program reads it through `parse`: profiling.py (where wall
time goes), matmul_count.py (how many product operations run), gpu_cost.py (what XLA:GPU launches
and moves) and hlo_dump.py (which JAX op made each buffer). The text is computations of
instructions, and an instruction runs other computations (a fusion's body, a loop's body and
condition, a reduction's combiner, a conditional's branches). `parse` gives each instruction's
name, result shape(s), opcode, operands and attributes, and each computation's instructions in
the order the text lists them (for a scheduled module, the order they run in), its parameters by
number and its root; what the attributes say that several readers need (the ``op_name`` of the JAX
op, a loop's known trip count, a custom call's target, the computations it runs) is read here
once. Nothing here knows what a backend does with an instruction.
"""

from __future__ import annotations

import dataclasses
import math
import re

# Bytes per element of each XLA element type (sub-byte types round up per element: a bound).
ELEMENT_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
    "c128": 16, "token": 0,
}
# The line shapes of the text. "%name = <type> opcode(...), attributes": group 1 the name, group 2
# the rest.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
# A computation's header, "[ENTRY ]%name (params) -> type {": group 1 the name. A header line
# ends with "{" (checked: an instruction's attributes may start the same way).
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%([^\s(]+)\s*\(")
_MODULE = re.compile(r"^\s*HloModule\s+([^\s,]+)")
# Within "%name = ": a result shape leaf, the opcode after the shape, an integer literal operand
# (parameter(N), constant(N)), and the printer's "/*index=5*/" marks in long operand lists.
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](?:\{([^}]*)\})?")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_INTEGER = re.compile(r"^\s*(-?[0-9]+)\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")
# Within the attributes: the computations an instruction runs (a fusion's or call's body, a loop's
# body and condition, a reduction's combiner: group 1 the kind, group 2 the computation; a
# conditional's branches; a custom call's), the JAX op it came from (the printer escapes quotes in
# it), the trip count XLA:CPU and GPU record for a loop, and a custom call's target.
_CALLED = re.compile(r"\b(calls|body|condition|to_apply)=%([^\s,}]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CALLED_COMPUTATIONS = re.compile(r"called_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'\bop_name="((?:[^"\\]|\\.)*)"')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"([0-9]+)"\}')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


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
    literal: int | None = None  # an integer between the parentheses: parameter(N)'s N, constant(N)'s

    @property
    def number(self) -> int | None:
        """N of parameter(N); None for any other instruction."""
        return self.literal if self.opcode == "parameter" else None

    @property
    def bytes(self) -> float:
        return sum(a.bytes for a in self.shape)

    @property
    def is_tuple(self) -> bool:
        return len(self.shape) != 1

    @property
    def op_name(self) -> str:
        """The ``op_name`` of its metadata, as printed (quotes escaped): the JAX op and the
        ``jax.named_scope``s it ran in, or a parameter's pytree path; "" when it has none (a copy
        XLA inserted)."""
        match = _OP_NAME.search(self.attributes)
        return match.group(1) if match else ""

    @property
    def trip_count(self) -> int | None:
        """A while loop's ``known_trip_count`` (XLA:CPU and GPU write it for JAX's scans and
        fori_loops; the TPU compiler does not); None when the text has none."""
        match = _TRIP_COUNT.search(self.attributes)
        return int(match.group(1)) if match else None

    @property
    def target(self) -> str | None:
        """A custom call's ``custom_call_target`` ("__cublas$gemm", "__gpu$TopK", ...)."""
        match = _TARGET.search(self.attributes)
        return match.group(1) if match else None

    def called(self) -> list[tuple[str, str]]:
        """(kind, computation) of every computation this instruction runs: "calls", "body",
        "condition", "to_apply", "branch" (a conditional's), "called_computations"."""
        out = [(kind, callee) for kind, callee in _CALLED.findall(self.attributes)]
        for kind, pattern in (("branch", _BRANCHES), ("called_computations", _CALLED_COMPUTATIONS)):
            for group in pattern.findall(self.attributes):
                out += [(kind, c.strip().lstrip("%")) for c in group.split(",") if c.strip()]
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
    name: str                              # the HloModule's: "jit_f", "jit__step_impl"
    computations: dict[str, Computation]   # in the text's order
    entry: str

    def instruction(self, computation: str, name: str) -> Instruction:
        return self.computations[computation].instructions[name]

    def instructions(self) -> dict[str, Instruction]:
        """Every instruction of every computation, by name (XLA names each once per module)."""
        return {name: instruction for computation in self.computations.values()
                for name, instruction in computation.instructions.items()}

    def callers(self) -> dict[str, list[Instruction]]:
        """computation → the instructions that run it (`Instruction.called`), in the text's order."""
        out: dict[str, list[Instruction]] = {}
        for computation in self.computations.values():
            for instruction in computation.instructions.values():
                for _, callee in instruction.called():
                    out.setdefault(callee, []).append(instruction)
        return out


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
        elif _INTEGER.match(token):
            literal = int(token)
    return Instruction(name=name, opcode=opcode.group(1), shape=parse_shape(shape_text),
                       operands=tuple(operands), attributes=rest[close_at + 1:],
                       computation=computation, is_root=is_root, literal=literal)


def parse(text: str) -> Module:
    """The module of an optimized HLO text; ValueError when it has no ENTRY computation."""
    computations: dict[str, Computation] = {}
    entry, current, module_name = None, None, ""
    for line in text.splitlines():
        if not module_name and (module := _MODULE.match(line)) is not None:
            module_name = module.group(1)
            continue
        header = _COMPUTATION.match(line)
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
        match = _INSTRUCTION.match(line)
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
    return Module(module_name, computations, entry)
