"""logra_jax/perf/hlo_module.py: the one reader of XLA's optimized HLO text in perf/.

The programs of profiling, matmul_count and gpu_cost's tests are read through it; here, the shapes
of text those readers met one by one, in one module written as XLA prints them.
"""

import ast
from pathlib import Path

from logra_jax.perf import hlo_module, profiling

# A TopK custom call with a comparator (called_computations), a conditional, a loop with a known
# trip count, operands printed with their types and after the printer's /*index=N*/ marks, a
# negative constant, and an op_name whose quotes the printer escaped.
HLO = r"""HloModule jit_g, is_scheduled=true, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%compare-greater-than (a: f32[], b: f32[]) -> pred[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %gt = pred[] compare(%a, %b), direction=GT
}

%body (s: (s32[], f32[8])) -> (s32[], f32[8]) {
  %s = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[8]{0} get-tuple-element(%s), index=1
  %copy.1 = f32[8]{0} copy(%v)
  ROOT %next = (s32[], f32[8]{0}) tuple(%i, %copy.1)
}

%cond (s.1: (s32[], f32[8])) -> pred[] {
  %s.1 = (s32[], f32[8]{0}) parameter(0)
  ROOT %go = pred[] constant(true)
}

%left (x.1: f32[8]) -> f32[8] {
  ROOT %x.1 = f32[8]{0} parameter(0)
}

%right (x.2: f32[8]) -> f32[8] {
  %x.2 = f32[8]{0} parameter(0)
  ROOT %neg = f32[8]{0} negate(%x.2), metadata={op_name="jit(g)/cond/branch_1_fun/neg"}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0), metadata={op_name="params[\'mlp\'][\"kernel\"]"}
  %minus = s32[] constant(-3)
  %init = (s32[], f32[8]{0}) tuple(%minus, %x)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}, metadata={op_name="jit(g)/while"}
  %out = f32[8]{0} get-tuple-element(%loop), index=1
  %topk = (f32[8,2]{1,0}, s32[8,2]{1,0}) custom-call(f32[8]{0} %out, /*index=1*/f32[8]{0} %x), custom_call_target="__gpu$TopK", called_computations={%compare-greater-than}
  %which = s32[] constant(1)
  ROOT %branch = f32[8]{0} conditional(%which, %out, %x), branch_computations={%left, %right}
}
"""


def test_an_instruction_is_read_once_with_what_its_readers_need():
    module = hlo_module.parse(HLO)
    assert (module.name, module.entry) == ("jit_g", "main")
    entry = module.computations["main"]
    assert (entry.root, entry.parameters) == ("branch", {0: "x"})
    topk = entry.instructions["topk"]
    assert topk.operands == ("out", "x")                 # typed, and after an /*index=N*/ mark
    assert [(a.dtype, a.dims) for a in topk.shape] == [("f32", (8, 2)), ("s32", (8, 2))]
    assert topk.target == "__gpu$TopK" and topk.trip_count is None
    assert entry.instructions["minus"].literal == -3 and entry.instructions["minus"].number is None
    assert entry.instructions["loop"].trip_count == 5
    # The op_name as printed, escaped quotes and all (hlo_dump unescapes the single ones).
    assert entry.instructions["x"].op_name == r"""params[\'mlp\'][\"kernel\"]"""
    assert entry.instructions["init"].op_name == ""


def test_every_computation_an_instruction_runs_has_it_as_caller():
    module = hlo_module.parse(HLO)
    entry = module.computations["main"]
    assert entry.instructions["loop"].called() == [("condition", "cond"), ("body", "body")]
    assert entry.instructions["branch"].called() == [("branch", "left"), ("branch", "right")]
    callers = {computation: [i.name for i in found] for computation, found in module.callers().items()}
    assert callers == {"cond": ["loop"], "body": ["loop"], "left": ["branch"], "right": ["branch"],
                       "compare-greater-than": ["topk"]}
    # profiling reads the same callers: the copy XLA put in the loop body runs under the loop.
    assert profiling.op_names(module)["copy.1"] == "jit(g)/while"


# What only a reader of HLO text's lines has reason to match: the computation and module headers,
# the ROOT mark, and the attributes every reader shares.
_LINE_SHAPES = ("ROOT", "ENTRY", "HloModule", "known_trip_count", "op_name", "custom_call_target",
                "branch_computations")


def _regex_literals(path: Path):
    """The string literals passed to the re module's functions in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and node.args):
            for leaf in ast.walk(node.args[0]):
                if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
                    yield leaf.value


def test_only_hlo_module_reads_the_lines_of_hlo_text():
    package = Path(hlo_module.__file__).parents[1]
    readers = {str(path.relative_to(package.parent))
               for path in package.rglob("*.py")
               for literal in _regex_literals(path)
               if any(shape in literal for shape in _LINE_SHAPES)}
    assert readers == {"logra_jax/perf/hlo_module.py"}
