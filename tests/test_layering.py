"""The package is a stack: every import points down it, and no import closes a cycle.

Read from the source (every ``import`` statement, also those inside functions), so a new
upward import fails here before a reader trips over it.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Layer of each part of logra_jax, lowest first. A module may import its own part and any lower
# layer. Top-level modules not listed sit with the loop (rl).
LAYERS = [
    {"tree_paths", "projections", "config", "metrics", "distributed", "host_arrays", "checkpoint",
     "extras"},
    {"sharding"},
    {"optim", "models", "data"},
    {"model_shapes", "nnx_sketch"},
    {"rl"},
    {"perf"},
]
# Parts of one layer that must not import each other.
INDEPENDENT = {("models", "optim"), ("optim", "models"), ("data", "optim"), ("data", "models"),
               ("models", "data"), ("optim", "data")}


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else ""


def _layer(part: str) -> int:
    for i, parts in enumerate(LAYERS):
        if part in parts:
            return i
    return len(LAYERS)


def _imports(path: pathlib.Path, modules=frozenset()) -> set[str]:
    """Modules ``path`` imports; ``from package import submodule`` names the submodule only."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                names.add(sub if sub in modules else node.module)
    return names


def _module_graph(top: str) -> dict[str, set[str]]:
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / top).rglob("*.py")}
    return {module: {name for name in _imports(path, frozenset(files))
                     if name in files and name != module}
            for module, path in files.items()}


def test_imports_only_point_down_the_stack():
    wrong = []
    for module, imported in _module_graph("logra_jax").items():
        here = _part(module)
        for name in imported:
            there = _part(name)
            if there == here:
                continue
            if _layer(there) > _layer(here) or (here, there) in INDEPENDENT:
                wrong.append(f"{module} imports {name}")
    assert not wrong, "upward imports:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = _module_graph("logra_jax")
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError("import cycle: " + " → ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        path.append(module)
        for name in sorted(graph[module]):
            visit(name)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_configs_import_nothing_from_the_library():
    for path in (ROOT / "configs").glob("*.py"):
        assert not {n for n in _imports(path) if n.startswith("logra_jax")}, path.name
