"""What an XLA:GPU program costs as it runs: kernels launched, host syncs and bytes moved.

``compiled.cost_analysis()`` returns nothing for a program compiled deviceless for a GPU, and where
it does return something it counts a loop body once. This reader walks the optimized HLO text
(``compiled.as_text()``, hlo_module.py) the way XLA:GPU's thunk emitter turns it into work on the
device (openxla/xla: ``ThunkEmitter::EmitHloInstruction``, ``GetFusionEmitter``,
``WhileThunk::ExecuteOnStream``), and counts every loop as it runs.

**Kernels.** The instructions of the entry computation, of loop bodies and conditions, of
conditional branches and of command-buffer calls each become what the emitter makes of them:

- ``fusion``: one kernel, named by its emitter — loop, input (reductions, transposes), Triton
  (GEMMs among them), cuDNN, a custom fusion (e.g. ``dynamic_slice_fusion``), an in-place
  dynamic-update-slice (below) — except a fusion whose every root is a ``copy`` of a parameter
  with the same layout, which is one device-to-device memcpy per root (``MemcpyFusion``);
- ``copy``: one device-to-device memcpy (a copy that changes the layout is a fusion by then);
- ``custom-call``: one library call (cuBLAS GEMM, cuDNN, TopK, ...) or one Pallas kernel;
- ``sort`` (alone or as the root of a sort fusion): XLA's bitonic sort, one kernel per group of
  stages (``EmitBitonicSortLLVMIR``: the stages whose compare distance fits a shared-memory tile
  run in one kernel, each longer one in its own), after a memcpy of each operand that cannot be
  sorted in its own buffer (XLA decides by buffer assignment; here: unless the sort is the only
  reader of a value computed in the same computation);
- collectives (``all-reduce-start``, ``all-gather``, ``all-to-all-start``, ...): one each;
- ``parameter``, ``constant``, ``tuple``, ``get-tuple-element``, ``bitcast``, ``after-all``,
  ``add-dependency``, ``opt-barrier`` and every async ``-done`` (a wait): nothing;
- ``while``: the body's kernels once per trip. With a known trip count (``known_trip_count`` in its
  ``backend_config``, which XLA writes for JAX's scans and fori_loops) the condition never runs;
  without one, every trip runs the condition's kernels, copies the predicate to the host and waits
  for it (``BlockHostUntilDone``): **one host sync per trip**, and one more, with the condition,
  when the loop ends. A whole program counts such a loop as one trip (``Cost.dynamic_loops``);
- ``conditional``: one host sync (the branch index is copied to the host) and its most costly
  branch;
- ``call`` (a command buffer, a CUDA graph at run time): the kernels of its computation.

**Bytes.** Each kernel moves what it reads plus what it writes, at the bytes of the arrays' element
types:

- a fusion reads each operand whole, except one read only through slicing ops (``dynamic-slice``,
  ``slice``, ``gather``, through bitcasts, also inside nested fusions): it reads the slices, at
  most the operand; it writes its outputs whole;
- an in-place dynamic-update-slice fusion (every root a ``dynamic-update-slice`` of a fusion
  parameter, the case XLA emits in place: ``CanEmitFusedDynamicUpdateSliceInPlaceForGpu``; copy
  insertion gives such an update its operand's buffer) reads its updates and writes only them, not
  the buffer they land in: a KV-cache write moves the slot;
- a GEMV or GEMM reads its weight once, whichever kernel runs it (a Triton GEMM, cuBLAS, a
  reduction fusion for a batch of one); a re-read of tiles from cache is not counted;
- a memcpy reads and writes its bytes; a sort's kernels each read and write all its operands; a
  collective reads its operands and writes its results; a library call reads its operands and
  writes its first result (a GEMM's second, when there is one, is its workspace); a Pallas
  kernel reads its operands and writes its results, except those it updates in an operand's
  buffer (``output_to_operand_aliasing``), of which it writes only a part the program does not
  show: counted as nothing (the decode attention's cache, of which it writes one slot).

This is a model of traffic to device memory, not a simulation of caches: L2 reuse between kernels
is not subtracted, and a kernel that reads an operand twice counts it once.

The kernel rule is checked against the thunk sequence XLA:GPU dumps for the same program, and the
in-place updates against its buffer assignment (tests/test_gpu_cost.py). XLA:GPU later groups runs
of kernels into command buffers (CUDA graphs); a kernel counts as one launch either way.

**Per decode step** (`decode_step`): every token reads the output projection (the vocabulary ×
width head, an entry parameter, or this device's part of it) whole, once; a kernel's operand is
traced back to the entry parameter it holds through loop carries, tuples, bitcasts and copies.
The token loop is the outermost loop with a dynamic trip count whose trips read the head — the loop
that draws tokens until every row has ended — or, in a program without one, the innermost loop
whose trips read it. A trip of it may draw several tokens (an inner loop over a chunk of tokens):
its tokens are its head reads, and every figure per token is the trip's over them.
"""

from __future__ import annotations

import dataclasses
import math
import re

from logra_jax.perf import hlo_module, machines, matmul_count

# XLA:GPU's sort tiles use this much shared memory and threads per block on every GPU of
# perf/gpu_specs/ (a100_sxm_80, h100_sxm, h200, b200: shared_memory_per_block 49152,
# threads_per_block_limit 1024).
SHARED_MEMORY_PER_BLOCK = 49152
THREADS_PER_BLOCK = 1024
_SORT_UNROLL = 4   # EmitBitonicSortLLVMIR's kUnrollFactor

_NO_KERNEL = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "add-dependency",
    "opt-barrier", "domain"})
_COLLECTIVES = frozenset({
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
    "collective-permute", "collective-broadcast", "send", "recv"})
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
_FUSION_KIND = re.compile(r"\bkind=(k[A-Za-z]+)")
_BACKEND_KIND = re.compile(r'"fusion_backend_config":\{"kind":"([^"]+)"')
_CUSTOM_FUSION = re.compile(r'"custom_fusion_config":\{"name":"([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel (or memcpy, or library call) as the program launches it."""

    kind: str
    read: float                     # bytes
    written: float                  # bytes
    computation: str                # where the launching instruction sits
    whole_reads: tuple[str, ...]    # the operands (instructions of `computation`) it reads whole

    @property
    def bytes(self) -> float:
        return self.read + self.written


@dataclasses.dataclass
class Cost:
    """Launches of a program part, loops counted as they run.

    ``launches`` maps each launching instruction ("computation/instruction") to what one launch
    does and how many times it runs. ``dynamic_loops``: loops without a known trip count met,
    each counted as one trip.
    """

    launches: dict[str, tuple[Launch, float]] = dataclasses.field(default_factory=dict)
    host_syncs: float = 0.0
    dynamic_loops: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        launches = dict(self.launches)
        for key, (launch, times) in other.launches.items():
            launches[key] = (launch, launches[key][1] + times if key in launches else times)
        return Cost(launches, self.host_syncs + other.host_syncs,
                    self.dynamic_loops + other.dynamic_loops)

    def scaled(self, factor: float) -> "Cost":
        return Cost({key: (launch, times * factor) for key, (launch, times) in self.launches.items()},
                    self.host_syncs * factor, self.dynamic_loops)

    @property
    def kernels(self) -> float:
        return sum(times for _, times in self.launches.values())

    @property
    def bytes(self) -> float:
        return sum(launch.bytes * times for launch, times in self.launches.values())

    def kernels_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for launch, times in self.launches.values():
            out[launch.kind] = out.get(launch.kind, 0.0) + times
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def bytes_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for launch, times in self.launches.values():
            out[launch.kind] = out.get(launch.kind, 0.0) + times * launch.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def largest(self, n: int = 10) -> list[tuple[str, Launch, float]]:
        """The ``n`` launching instructions that move the most bytes: (name, launch, times)."""
        ranked = sorted(self.launches.items(), key=lambda kv: -kv[1][0].bytes * kv[1][1])
        return [(key, launch, times) for key, (launch, times) in ranked[:n]]

    def reads_whole(self, reads) -> float:
        """How many launches read whole an operand for which ``reads(computation, operand)``."""
        return sum(times for launch, times in self.launches.values()
                   if any(reads(launch.computation, name) for name in launch.whole_reads))


@dataclasses.dataclass(frozen=True)
class Loop:
    """A while loop of the program: where it sits, what it runs, and the loops around it."""

    name: str                  # the while instruction
    computation: str           # the computation it sits in
    body: str
    condition: str
    trip_count: int | None     # None: known only at run time
    parents: tuple[str, ...]   # the enclosing loops, outermost first


class Program:
    """An XLA:GPU program's optimized HLO, ready to be costed (see the module docstring)."""

    def __init__(self, text: str):
        self.text = text
        self.module = hlo_module.parse(text)
        # computation → the while loops that run it (as body or condition)
        self._loops_running = {computation: [i for i in callers if i.opcode == "while"]
                               for computation, callers in self.module.callers().items()}
        self._costs: dict[str, Cost] = {}
        self._reads: dict[tuple[str, str], float] = {}

    # -- control flow ------------------------------------------------------------------------
    def cost(self, computation: str | None = None) -> Cost:
        """What running ``computation`` (default: the entry) once launches."""
        name = computation or self.module.entry
        if name not in self._costs:
            total = Cost()
            for instruction in self.module.computations[name].instructions.values():
                total = total + self._instruction(instruction)
            self._costs[name] = total
        return self._costs[name]

    def loops(self) -> list[Loop]:
        """Every while loop the entry computation runs, outer loops before the loops inside them."""
        found: list[Loop] = []

        def visit(computation: str, parents: tuple[str, ...], seen: frozenset):
            if computation in seen:
                return
            seen = seen | {computation}
            for instruction in self.module.computations[computation].instructions.values():
                called = dict((kind, callee) for kind, callee in instruction.called())
                if instruction.opcode == "while":
                    loop = Loop(instruction.name, computation, called["body"], called["condition"],
                                instruction.trip_count, parents)
                    found.append(loop)
                    visit(loop.condition, parents + (loop.name,), seen)
                    visit(loop.body, parents + (loop.name,), seen)
                elif instruction.opcode in ("conditional", "call", "async-start"):
                    for _, callee in instruction.called():
                        visit(callee, parents, seen)
        visit(self.module.entry, (), frozenset())
        return found

    def control_computations(self) -> list[str]:
        """The computations whose instructions run as thunks: the entry, loop bodies and
        conditions, conditional branches, command-buffer and async calls (not fused computations
        or reducers)."""
        found: list[str] = []

        def visit(computation: str):
            if computation in found:
                return
            found.append(computation)
            for instruction in self.module.computations[computation].instructions.values():
                if instruction.opcode in ("while", "conditional", "call", "async-start"):
                    for kind, callee in instruction.called():
                        if kind != "to_apply" or instruction.opcode == "call":
                            visit(callee)
        visit(self.module.entry)
        return found

    def launch_sites(self) -> int:
        """Launches of every control computation counted once each (a loop body once, whatever
        its trips): what XLA's thunk sequence lists."""
        return sum(len(self._instruction(instruction).launches)
                   for computation in self.control_computations()
                   for instruction in self.module.computations[computation].instructions.values()
                   if instruction.opcode not in ("while", "conditional", "call", "async-start"))

    def in_place_updates(self) -> list[tuple[str, str, int, str]]:
        """(computation, fusion, output number, operand) of every dynamic-update-slice counted in
        place: the fusion's output ``number`` is written into the buffer of its ``operand``."""
        out = []
        for computation in self.control_computations():
            for fusion in self.module.computations[computation].instructions.values():
                if fusion.opcode != "fusion":
                    continue
                body = self.module.computations[dict(fusion.called())["calls"]]
                roots = _roots(body)
                if body.instructions[body.root].opcode == "sort" or _in_place_updates(body, roots) is None:
                    continue
                for number, root in enumerate(roots):
                    target = _through_bitcasts(body, _through_bitcasts(body, root.name).operands[0])
                    out.append((computation, fusion.name, number, fusion.operands[target.number]))
        return out

    def origin(self, computation: str, name: str) -> str | None:
        """The entry parameter whose buffer ``name`` (an instruction of ``computation``) holds, if
        any: followed through bitcasts, copies, tuples, get-tuple-elements and the values loops
        carry into their bodies and out of them."""
        seen = set()
        index: list[int] = []   # tuple indices still to take, innermost last
        while (computation, name, tuple(index)) not in seen:
            seen.add((computation, name, tuple(index)))
            instruction = self.module.instruction(computation, name)
            op = instruction.opcode
            if op in ("bitcast", "copy") and not index:
                name = instruction.operands[0]
            elif op == "get-tuple-element":
                index.append(int(re.search(r"index=([0-9]+)", instruction.attributes).group(1)))
                name = instruction.operands[0]
            elif op == "tuple" and index:
                name = instruction.operands[index.pop()]
            elif op == "while" and index:   # what the loop returns of a value it carries
                name = instruction.operands[0]
            elif op == "parameter":
                if self.module.computations[computation].is_entry:
                    return name if not index else None
                callers = self._loops_running.get(computation, [])
                if len(callers) != 1:
                    return None
                computation, name = callers[0].computation, callers[0].operands[0]
            else:
                return None
        return None

    def trip(self, loop: Loop) -> Cost:
        """One trip of ``loop``: its body, and for a dynamic trip count its condition and the
        host sync that reads the predicate."""
        body = self.cost(loop.body)
        if loop.trip_count is not None:
            return body
        return body + self.cost(loop.condition) + Cost(host_syncs=1.0)

    def _instruction(self, instruction: hlo_module.Instruction) -> Cost:
        op = instruction.opcode
        if op in _NO_KERNEL or op.endswith("-done") or op.endswith("-update"):
            return Cost()   # bookkeeping, or the wait that ends an async op
        key = f"{instruction.computation}/{instruction.name}"
        if op == "while":
            called = dict(instruction.called())
            trips = instruction.trip_count
            if trips is not None:
                return self.cost(called["body"]).scaled(trips)
            check = self.cost(called["condition"]) + Cost(host_syncs=1.0)
            once = self.cost(called["body"]) + check + check   # one trip, then the exit check
            return Cost(once.launches, once.host_syncs, once.dynamic_loops + 1)
        if op == "conditional":
            branches = [self.cost(callee) for _, callee in instruction.called()]
            costly = max(branches, key=lambda c: (c.kernels, c.bytes), default=Cost())
            return costly + Cost(host_syncs=1.0)
        collective = op in _COLLECTIVES or (op.endswith("-start") and op[:-len("-start")] in _COLLECTIVES)
        if not collective and (op in ("call", "async-start") or op.endswith("-start")):
            total = Cost()   # a command buffer, or work started on another stream: its kernels
            for _, callee in instruction.called():
                total = total + self.cost(callee)
            if not instruction.called():   # an async op with nothing to call: one kernel
                total = Cost({key: (Launch(op[:-len("-start")], 0.0, instruction.bytes,
                                           instruction.computation, ()), 1.0)})
            return total
        if op == "fusion":
            return Cost({f"{key}#{i}": (launch, 1.0) for i, launch in enumerate(self._fusion(instruction))})
        if op == "sort":
            return Cost({f"{key}#{i}": (launch, 1.0) for i, launch in enumerate(self._sort(instruction))})
        operands = [self._operand(instruction, name) for name in instruction.operands]
        read = sum(o.bytes for o in operands)
        where, whole = instruction.computation, tuple(o.name for o in operands)
        if op == "copy":
            return Cost({key: (Launch("memcpy", read, instruction.bytes, where, whole), 1.0)})
        if op == "custom-call":
            kind, written = _library_call(instruction.target or "?", instruction)
            return Cost({key: (Launch(kind, read, written, where, whole), 1.0)})
        if collective:   # an async start's result holds its operands too (and small contexts)
            written = max(instruction.bytes - read, 0.0) if instruction.is_tuple else instruction.bytes
            return Cost({key: (Launch("collective", read, written, where, whole), 1.0)})
        # Anything else XLA:GPU still emits unfused (an iota, an rng state update): one kernel.
        return Cost({key: (Launch(op, read, instruction.bytes, where, whole), 1.0)})

    def _operand(self, instruction, name) -> hlo_module.Instruction:
        return self.module.instruction(instruction.computation, name)

    # -- kernels -------------------------------------------------------------------------------
    def _fusion(self, fusion: hlo_module.Instruction) -> list[Launch]:
        callee = dict(fusion.called())["calls"]
        body = self.module.computations[callee]
        if body.instructions[body.root].opcode == "sort":   # SortFusion
            return self._sort(body.instructions[body.root], fusion, body)
        roots = _roots(body)
        operands = [self._operand(fusion, name) for name in fusion.operands]
        if all(r.opcode == "copy" and body.instructions[r.operands[0]].opcode == "parameter"
               and body.instructions[r.operands[0]].shape[0].layout == r.shape[0].layout
               for r in roots):   # MemcpyFusion: a memcpy per root
            sources = [fusion.operands[body.instructions[r.operands[0]].number] for r in roots]
            return [Launch("memcpy", r.bytes, r.bytes, fusion.computation, (source,))
                    for r, source in zip(roots, sources)]
        updated = _in_place_updates(body, roots)   # parameter → its update's bytes
        kind = _fusion_kind(fusion) if updated is None else "in-place dynamic-update-slice"
        read, whole = 0.0, []
        for number, operand in enumerate(operands):
            parameter = body.parameters.get(number)
            if parameter is None:
                continue
            if updated is not None and parameter in updated:
                sliced = self._reads_through(body, parameter, skip_updates=True)
            else:
                sliced = self._reads_through(body, parameter)
            read += min(sliced, operand.bytes)
            if sliced >= operand.bytes:
                whole.append(operand.name)
        written = sum(updated.values()) if updated is not None else fusion.bytes
        return [Launch(kind, read, written, fusion.computation, tuple(whole))]

    def _reads_through(self, body: hlo_module.Computation, parameter: str,
                       skip_updates: bool = False) -> float:
        """Bytes a fused computation reads of its ``parameter``: the slices it takes when it only
        slices it (through bitcasts and nested fusions), else the whole parameter. With
        ``skip_updates``, the dynamic-update-slices it is the target of read nothing of it."""
        cache_key = (body.name, parameter + ("!" if skip_updates else ""))
        if cache_key in self._reads:
            return self._reads[cache_key]
        whole = body.instructions[parameter].bytes
        users = body.users()
        total, frontier, seen = 0.0, [parameter], set()
        while frontier:
            name = frontier.pop()
            for user_name in users[name]:
                if user_name in seen:
                    continue
                user = body.instructions[user_name]
                if user.opcode == "bitcast" or (user.opcode == "tuple" and user.is_root):
                    if user.opcode == "bitcast":
                        seen.add(user_name)
                        frontier.append(user_name)
                    continue
                if user.opcode in _SLICING and user.operands[0] == name:
                    total += user.bytes
                elif skip_updates and user.opcode == "dynamic-update-slice" and user.operands[0] == name:
                    continue
                elif user.opcode == "fusion":   # a nested fusion: what it reads of each use
                    nested = self.module.computations[dict(user.called())["calls"]]
                    for number, operand in enumerate(user.operands):
                        if operand == name and number in nested.parameters:
                            total += self._reads_through(nested, nested.parameters[number])
                else:
                    total = whole
                    break
                seen.add(user_name)
            if total >= whole:
                break
        self._reads[cache_key] = min(total, whole)
        return self._reads[cache_key]

    def _sort(self, sort: hlo_module.Instruction, fusion: hlo_module.Instruction | None = None,
              body: hlo_module.Computation | None = None) -> list[Launch]:
        """A sort (``fusion``: the sort fusion that holds it, its fused computation ``body``):
        a memcpy of each operand XLA cannot sort in place (`_sorts_in_place`; an iota operand
        of a sort fusion is generated, not copied), then the bitonic kernels."""
        outer = fusion or sort
        inputs = []   # (operand instruction, its bytes) of each operand read from memory
        for name in sort.operands:
            if body is not None:
                inner = body.instructions[name]
                if inner.opcode != "parameter":
                    continue
                name = outer.operands[inner.number]
            inputs.append(self._operand(outer, name))
        keys = sort.shape[0]
        dimension = int(re.search(r"dimensions=\{([0-9]+)\}", sort.attributes).group(1))
        kernels = _bitonic_kernels(keys.dims[dimension],
                                   sum(hlo_module.ELEMENT_BYTES.get(a.dtype, 4) for a in sort.shape))
        every = sum(a.bytes for a in sort.shape)
        where = outer.computation
        copies = [Launch("memcpy", o.bytes, o.bytes, where, (o.name,)) for o in inputs
                  if not self._sorts_in_place(outer, o)]
        whole = tuple(o.name for o in inputs)
        return copies + [Launch("sort (bitonic)", every, every, where, whole)] * kernels

    def _sorts_in_place(self, sort: hlo_module.Instruction, operand: hlo_module.Instruction) -> bool:
        """Whether XLA sorts ``operand`` in its own buffer: the sort is the only reader of a value
        computed here (a parameter or a loop's carried value lives on elsewhere). XLA decides by
        its buffer assignment; this is that decision's usual outcome."""
        computation = self.module.computations[sort.computation]
        source = _through_bitcasts(computation, operand.name)
        if source.opcode in ("parameter", "get-tuple-element"):
            return False
        users = computation.users()
        readers, frontier = set(), [source.name]
        while frontier:
            for user in users[frontier.pop()]:
                if computation.instructions[user].opcode == "bitcast":
                    frontier.append(user)
                else:
                    readers.add(user)
        return readers == {sort.name}


def _roots(body: hlo_module.Computation) -> list[hlo_module.Instruction]:
    root = body.instructions[body.root]
    if root.opcode == "tuple":
        return [body.instructions[name] for name in root.operands]
    return [root]


def _through_bitcasts(body: hlo_module.Computation, name: str) -> hlo_module.Instruction:
    instruction = body.instructions[name]
    while instruction.opcode == "bitcast":
        instruction = body.instructions[instruction.operands[0]]
    return instruction


def _in_place_updates(body: hlo_module.Computation, roots) -> dict[str, float] | None:
    """{parameter: bytes of its update} when every root of a fusion is a dynamic-update-slice of a
    fusion parameter (through bitcasts) whose updates share one shape: XLA's in-place DUS
    fusion. None otherwise."""
    updates: dict[str, float] = {}
    shapes = set()
    for root in roots:
        dus = _through_bitcasts(body, root.name)
        if dus.opcode != "dynamic-update-slice":
            return None
        target = _through_bitcasts(body, dus.operands[0])
        if target.opcode != "parameter":
            return None
        update = body.instructions[dus.operands[1]]
        shapes.add(update.shape[0].dims)
        updates[target.name] = updates.get(target.name, 0.0) + update.bytes
    return updates if len(shapes) == 1 else None


def _fusion_kind(fusion: hlo_module.Instruction) -> str:
    backend = _BACKEND_KIND.search(fusion.attributes)
    kind = backend.group(1) if backend else ""
    if kind.startswith("__triton") and "gemm" in kind:
        return "Triton GEMM"
    if kind.startswith("__triton"):
        return "Triton"
    if kind.startswith("__cudnn"):
        return "cuDNN fusion"
    if kind == "__custom_fusion":
        name = _CUSTOM_FUSION.search(fusion.attributes)
        return f"custom fusion ({name.group(1) if name else '?'})"
    if kind == "__dynamic_memcpy":
        return "memcpy"
    emitter = _FUSION_KIND.search(fusion.attributes)
    return {"kLoop": "loop fusion", "kInput": "input fusion (reduction, transpose)",
            "kOutput": "output fusion", "kCustom": "custom fusion"}.get(
                emitter.group(1) if emitter else "", "fusion")


# An entry of a custom call's output_to_operand_aliasing={{1}: (6, {}), ...}: output 1 is operand 6.
_ALIASED_OUTPUT = re.compile(r"\{(\d+)\}: \(\d+, \{")


def _library_call(target: str, call: hlo_module.Instruction) -> tuple[str, float]:
    """(kind, bytes written) of a custom-call."""
    if target == "__gpu$xla.gpu.triton":   # a Pallas kernel (models/decode_kernels.py)
        updated = {int(i) for i in _ALIASED_OUTPUT.findall(call.attributes)}
        return "Pallas kernel", sum(a.bytes for i, a in enumerate(call.shape) if i not in updated)
    if target.startswith("__cublas"):
        return "cuBLAS GEMM", call.shape[0].bytes
    if target.startswith("__cudnn"):
        return "cuDNN", call.shape[0].bytes
    if "topk" in target.lower():
        return "TopK", call.bytes
    return f"custom-call {target}", call.bytes


def _bitonic_kernels(length: int, element_bytes: float) -> int:
    """Kernels of XLA:GPU's bitonic sort of ``length`` elements of ``element_bytes`` (keys and
    values together), as ``EmitBitonicSortLLVMIR`` groups its stages."""
    stages = max(1, math.ceil(math.log2(length))) if length > 1 else 0
    if stages == 0:
        return 0
    tile = min(THREADS_PER_BLOCK * _SORT_UNROLL, int(SHARED_MEMORY_PER_BLOCK // element_bytes),
               1 << stages)
    tile = 1 << int(math.floor(math.log2(tile)))
    kernels, pending = 0, False
    for stage in range(stages):
        for mask in range(stage, -1, -1):
            xor_mask = (1 << (stage + 1)) - 1 if mask == stage else 1 << mask
            if xor_mask >= tile:
                kernels += 1 + int(pending)
                pending = False
            else:
                pending = True
    return kernels + int(pending)


# ----------------------------------------------------------------------------------------------
# Whole programs and decode steps
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """A whole program run once (loops as they run; a dynamic loop as one trip)."""

    kernels: float
    kernels_by_kind: dict[str, float]
    bytes: float
    host_syncs: float
    matmul_flops: float
    dynamic_loops: int


def count(text: str) -> ProgramCost:
    """Kernels, bytes, host syncs and matmul FLOPs of an XLA:GPU program's optimized HLO text."""
    program = Program(text)
    cost = program.cost()
    return ProgramCost(kernels=cost.kernels, kernels_by_kind=cost.kernels_by_kind(), bytes=cost.bytes,
                       host_syncs=cost.host_syncs,
                       matmul_flops=matmul_count.count_module(program.module).flops,
                       dynamic_loops=cost.dynamic_loops)


def of_compiled(compiled) -> ProgramCost:
    """``count`` of a ``jax.jit(...).lower(...).compile()`` result."""
    return count(compiled.as_text())


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One decode step (one token for every row), read off the program's token loop."""

    loop: str                    # the while instruction read as the token loop
    dynamic: bool                # its trip count is known only at run time
    tokens_per_trip: float       # head reads per trip of it
    trip: Cost                   # one trip, all its tokens

    @property
    def kernels(self) -> float:
        return self.trip.kernels / self.tokens_per_trip

    @property
    def bytes(self) -> float:
        return self.trip.bytes / self.tokens_per_trip

    @property
    def host_syncs(self) -> float:
        return self.trip.host_syncs / self.tokens_per_trip

    def kernels_by_kind(self) -> dict[str, float]:
        return {k: v / self.tokens_per_trip for k, v in self.trip.kernels_by_kind().items()}

    def bytes_by_kind(self) -> dict[str, float]:
        return {k: v / self.tokens_per_trip for k, v in self.trip.bytes_by_kind().items()}


def head_parameters(program: Program, vocab_size: int, hidden_size: int, shards: int = 1) -> set[str]:
    """The entry parameters that can be the output projection: a vocab × width matrix (either
    way round, size-1 dims aside), or this device's part of one split ``a × b`` ways with
    ``a · b`` dividing ``shards`` (the devices of the mesh)."""
    entry = program.module.computations[program.module.entry]
    found = set()
    for parameter in entry.parameters.values():
        leaves = entry.instructions[parameter].shape
        dims = [d for d in leaves[0].dims if d != 1] if len(leaves) == 1 else []
        if len(dims) != 2:
            continue
        for rows, cols in (dims, dims[::-1]):
            if vocab_size % rows or hidden_size % cols:
                continue
            split = (vocab_size // rows) * (hidden_size // cols)
            if shards % split == 0:
                found.add(parameter)
    return found


def decode_step(program: Program | str, *, vocab_size: int, hidden_size: int,
                shards: int = 1) -> StepCost:
    """The decode step of a sampler's compiled ``generate`` (see the module docstring): the token
    loop found by its whole reads of the vocab × width head (an entry parameter, or its part on
    this device of a mesh of ``shards`` devices). ValueError when no loop reads it."""
    program = program if isinstance(program, Program) else Program(program)
    heads = head_parameters(program, vocab_size, hidden_size, shards)

    def is_head(computation: str, name: str) -> bool:
        return program.origin(computation, name) in heads

    reading = [(loop, program.trip(loop)) for loop in program.loops()]
    reading = [(loop, trip, trip.reads_whole(is_head)) for loop, trip in reading]
    reading = [r for r in reading if r[2] >= 1]
    if not reading:
        raise ValueError(f"no loop of the program reads a {vocab_size} × {hidden_size} head: "
                         f"not a decode loop")
    dynamic = [r for r in reading if r[0].trip_count is None]
    if dynamic:
        loop, trip, reads = min(dynamic, key=lambda r: len(r[0].parents))
    else:
        loop, trip, reads = max(reading, key=lambda r: len(r[0].parents))
    return StepCost(loop.name, loop.trip_count is None, reads, trip)


# ----------------------------------------------------------------------------------------------
# Speed from the counts
# ----------------------------------------------------------------------------------------------
# What one kernel costs where a decode step is launch-bound: the one measurement there is, on one
# H200, is data beside the machine table with its evidence (machines.KERNEL_CALIBRATIONS); the
# seconds per kernel are the mean over the two programs that ran of 1 / (tokens/s × kernels/token).
CALIBRATION = machines.KERNEL_CALIBRATIONS["H200"]
SECONDS_PER_KERNEL = sum(1 / (CALIBRATION["measured_tokens_per_s"][mode] * kernels)
                         for mode, kernels in CALIBRATION["kernels_per_token"].items()) / 2


def predicted_tokens_per_s(batch: int, bytes_per_token: float, kernels_per_token: float, *,
                           bandwidth: float, seconds_per_kernel: float) -> float:
    """batch ÷ max(bytes ÷ bandwidth, kernels × seconds per kernel): a decode step takes as long
    as its memory traffic at the device's bandwidth or its launches one after the other,
    whichever is longer."""
    seconds = max(bytes_per_token / bandwidth, kernels_per_token * seconds_per_kernel)
    return batch / seconds if seconds > 0 else math.inf
