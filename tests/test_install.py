"""Import only what a command uses: each entry point with the data sources' libraries made
unimportable, in a fresh process (sys.modules of this one already holds them)."""

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GSM8K, TASKS = "tensorflow_datasets", "reasoning_gym"

# Run in the child before anything else: a finder first on sys.meta_path that refuses the named
# top-level packages, as a machine without them installed would.
_REFUSE = textwrap.dedent("""
    import importlib.abc, sys
    REFUSED = set(sys.argv[1].split(","))
    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in REFUSED:
                raise ImportError(f"No module named {name!r} (refused by tests/test_install.py)")
    sys.meta_path.insert(0, Refuse())
    sys.argv[1:] = []
""")


# Imported by a command in the branch that reads that source alone; a run's test reads one.
DATA_SOURCES = ("logra_jax.data.gsm8k", "logra_jax.data.tasks")


def _entry_point_modules(name: str) -> list[str]:
    """The entry point and every project module its source imports, at any depth (its main
    imports most of them inside functions, after the flags are parsed), but `DATA_SOURCES`."""
    tree = ast.parse((ROOT / "launch" / f"{name}.py").read_text())
    found = [f"launch.{name}"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:   # a submodule, or the module
            names = [f"{node.module}.{alias.name}" if _is_module(f"{node.module}.{alias.name}")
                     else node.module for alias in node.names]
        else:
            names = []
        for module in names:
            if (module.partition(".")[0] in ("logra_jax", "launch", "configs")
                    and module not in found and module not in DATA_SOURCES):
                found.append(module)
    return found


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _run_refusing(refused: list[str], code: str):
    return subprocess.run([sys.executable, "-c", _REFUSE + code, ",".join(refused)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _importing(modules: list[str], keep_flags_of: str = "") -> str:
    """Code that imports ``modules`` in order. Each entry point defines its absl flags at import
    (--config in several): those are dropped after each, so the next can define its own, except
    ``keep_flags_of``'s."""
    return textwrap.dedent(f"""
        import importlib
        from absl import flags
        for module in {modules!r}:
            before = set(flags.FLAGS)
            importlib.import_module(module)
            if module.startswith("launch.") and module != {keep_flags_of!r}:
                for name in set(flags.FLAGS) - before:
                    delattr(flags.FLAGS, name)
        """)


_REPORT = """
import json
print(json.dumps(sorted(m for m in ("tensorflow_datasets", "reasoning_gym") if m in sys.modules)))
"""


def test_planner_benchmarks_and_export_import_no_data_source():
    """launch.memory, step_time, sampler_bench and export read no data: they must run where
    neither tensorflow_datasets nor reasoning_gym is installed (a GPU machine whose Python has no
    wheel of reasoning_gym's pycosat)."""
    modules = [m for name in ("memory", "step_time", "sampler_bench", "export")
               for m in _entry_point_modules(name)]
    done = _run_refusing([GSM8K, TASKS], _importing(modules) + _REPORT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize("source, refused, used", [("gsm8k", TASKS, GSM8K), ("task", GSM8K, TASKS)])
def test_a_run_imports_only_its_own_data_source(source, refused, used, tmp_path):
    """launch.train's and launch.evaluate's modules, then the prompt source the config names,
    built as a run builds it (`build.build_data`) and as launch.evaluate reads its questions:
    GSM8K without reasoning_gym, a task without tensorflow_datasets."""
    line = json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}) + "\n"
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(line)
    modules = _entry_point_modules("train") + _entry_point_modules("evaluate")
    code = _importing(modules, keep_flags_of="launch.evaluate") + textwrap.dedent(f"""
        from configs import tiny
        from logra_jax.rl import build
        config = tiny.get_config()
        config.data.source = {source!r}
        config.data.gsm8k_dir = {str(tmp_path)!r}
        config.data.gsm8k_cache_dir = {str(tmp_path / "cache")!r}
        config.data.size = 4
        batch = build.build_data(config.data, 0).next()
        assert batch and batch[0]["question"], batch
        from launch import evaluate
        flags.FLAGS(["evaluate", "--config=configs/tiny.py", "--data={source}", "--num_examples=1",
                     "--gsm8k_dir={tmp_path}"])
        name, examples, _ = evaluate.questions(config, {source!r})
        assert len(examples) == 1, name
        """)
    done = _run_refusing([refused], code + _REPORT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [used]   # the source it reads, alone
