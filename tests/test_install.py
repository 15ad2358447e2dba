"""The project installs as declared on the machines users have.

Pins that cannot contradict each other: every jax pyproject.toml admits has an admitted flax known
to import with it (logra_jax/versions.py holds the evidence), the extras' pinned pairs are known
good and inside the ranges, and the installed pair is one of them.

Import only what a command uses: each entry point with the data sources' libraries made
unimportable, in a fresh process (sys.modules of this one already holds them).
"""

import ast
import importlib.metadata
import json
import pathlib
import subprocess
import sys
import textwrap
import tomllib

import pytest
from packaging.requirements import Requirement

from logra_jax import versions

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


def _requirements(names=("jax", "flax")) -> dict[str, dict[str, Requirement]]:
    """{"dependencies" or an extra's name: {package: its Requirement}} for ``names``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    return {group: {r.name: r for r in map(Requirement, lines) if r.name in names}
            for group, lines in groups.items()}


def test_every_admitted_jax_has_an_admitted_flax_known_to_work():
    deps = _requirements()["dependencies"]
    assert versions.contradictions(str(deps["jax"].specifier), str(deps["flax"].specifier)) == []


def test_the_check_sees_flax_0_12_8_pinned_beside_a_jax_range_that_reaches_0_11():
    """The pins this project shipped: jax>=0.10.2,<0.12 with flax==0.12.8. flax 0.12.8's own
    metadata admits jax 0.11.2, so pip installs that pair; the check must refuse the pins."""
    (problem,) = versions.contradictions(">=0.10.2,<0.12", "==0.12.8")
    assert problem.startswith("jax 0.11 is admitted") and "older than 0.12.10" in problem
    assert "jax 0.12" in " ".join(versions.contradictions(">=0.10.2", ">=0.12.8"))  # no evidence
    assert versions.broken_pair("0.11.2", "0.12.8") and not versions.broken_pair("0.11.2", "0.12.10")
    if importlib.metadata.version("flax") == "0.12.8":   # what pip reads: no bound above
        (jax_req,) = [r for r in map(Requirement, importlib.metadata.requires("flax"))
                      if r.name == "jax" and not r.marker]
        assert jax_req.specifier.contains("0.11.2")


def test_the_extras_pin_known_good_pairs_inside_the_ranges():
    groups = _requirements()
    ranges = groups.pop("dependencies")
    assert groups["cuda"]["jax"].extras == {"cuda12"}
    for group, pinned in groups.items():
        exact = {name: next(iter(r.specifier)).version for name, r in pinned.items()
                 if len(r.specifier) == 1 and next(iter(r.specifier)).operator == "=="}
        for name, version in exact.items():
            assert ranges[name].specifier.contains(version), (group, name, version)
        if len(exact) == 2:
            assert versions.broken_pair(exact["jax"], exact["flax"]) is None, group
            assert versions._minor(exact["jax"]) in versions.FIRST_FLAX, group


def test_make_installs_the_tested_pair_the_cuda_extra_pins():
    """pyproject admits ranges; `make` (a newcomer's install, and CI's) must still get the pair the
    suite ran on, not the newest in range: the Makefile's TESTED_JAX_FLAX is the cuda extra's pins."""
    line = next(line for line in (ROOT / "Makefile").read_text().splitlines()
                if line.startswith("TESTED_JAX_FLAX"))
    pins = {r.name: r for r in map(Requirement, line.split(":=", 1)[1].split())}
    cuda = _requirements()["cuda"]
    assert {name: str(r.specifier) for name, r in pins.items()} == {
        name: str(r.specifier) for name, r in cuda.items()}
    assert versions.broken_pair(*(next(iter(pins[n].specifier)).version for n in ("jax", "flax"))) is None


def test_the_installed_pair_is_admitted_and_known_good():
    ranges = _requirements()["dependencies"]
    installed = {name: importlib.metadata.version(name) for name in ("jax", "flax")}
    for name, version in installed.items():
        assert ranges[name].specifier.contains(version), (name, version)
    flax_wants = [r for r in map(Requirement, importlib.metadata.requires("flax"))
                  if r.name == "jax" and not r.marker]
    assert all(r.specifier.contains(installed["jax"]) for r in flax_wants), flax_wants
    assert versions.broken_pair(installed["jax"], installed["flax"]) is None


@pytest.mark.parametrize("flax, refused", [("0.12.8", True), ("0.12.10", False)])
def test_importing_logra_jax_refuses_a_known_broken_pair(flax, refused):
    """With jax 0.11.2 and flax 0.12.8 installed (as their metadata says: faked here), `import
    logra_jax` stops with one error line naming the pair and the install that fixes it, before
    flax's AttributeError; flax 0.12.10 imports."""
    code = textwrap.dedent(f"""
        import importlib.metadata as metadata
        fake = {{"jax": "0.11.2", "flax": {flax!r}}}
        real = metadata.version
        metadata.version = lambda name: fake.get(name) or real(name)
        import logra_jax
        """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode != 0) == refused, done.stderr[-2000:]
    if refused:
        assert done.stderr.splitlines()[-1] == (
            "ImportError: error: flax 0.12.8 does not work with jax 0.11.2: jax 0.11 needs flax "
            f">= 0.12.10 ({versions.FIRST_FLAX[(0, 11)].evidence}). Install a flax that does, "
            "keeping this jax: pip install 'flax>=0.12.10,<0.13' (docs/gpu.md)")


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


# The RL loop's own packages (the rl extra): distribution name → the module a command imports.
RL_EXTRA = {"reasoning-gym": "reasoning_gym", "tensorboardx": "tensorboardX", "matplotlib": "matplotlib"}
_REPORT_RL = f"""
import json
print(json.dumps(sorted(m for m in {sorted(RL_EXTRA.values())!r} if m in sys.modules)))
"""


def test_the_base_install_holds_none_of_the_rl_loops_packages():
    """`pip install .` (an optax user's install) brings no reasoning-gym (whose pycosat has no
    wheel for every Python), matplotlib or tensorboardX; the rl extra does, and `make train` and
    `make test` (CI's command) install it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {Requirement(line).name.lower() for line in project["dependencies"]}
    assert not base & set(RL_EXTRA), base & set(RL_EXTRA)
    rl = {Requirement(line).name.lower() for line in project["optional-dependencies"]["rl"]}
    assert rl == set(RL_EXTRA)
    makefile = (ROOT / "Makefile").read_text()
    train_install = makefile.split("$(VENV)/.installed:")[1].split("\n\n")[0]
    test_install = makefile.split("$(VENV)/.installed-test:")[1].split("\n\n")[0]
    assert "pip install -q -e '.[rl]'" in train_install
    assert "pip install -q -e '.[rl,test]'" in test_install


def test_the_optax_api_the_sketch_the_models_and_the_planner_import_without_the_rl_extra():
    """With the rl extra's packages unimportable, the optax transforms, the NNX sketch, the models
    and the memory planner import, and none of those packages is loaded."""
    code = textwrap.dedent("""
        import logra_jax.optim, logra_jax.nnx_sketch, logra_jax.models, logra_jax.perf.memory
        from logra_jax.optim import logra
        from logra_jax.nnx_sketch import prepare
        """)
    done = _run_refusing(list(RL_EXTRA.values()), code + _REPORT_RL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def _last_line(done) -> str:
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else ""


def test_a_task_run_without_reasoning_gym_is_one_error_line_naming_the_extra(tmp_path):
    """launch.train of configs/tiny.py (reasoning-gym's chain_sum prompts) where reasoning_gym does
    not import: one `error:` line naming the extra, before the model is built."""
    code = textwrap.dedent(f"""
        import runpy
        sys.argv = ["train", "--config", "configs/tiny.py", "--workdir", {str(tmp_path / "run")!r}]
        runpy.run_module("launch.train", run_name="__main__", alter_sys=True)
        """)
    done = _run_refusing([TASKS], code)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = _last_line(done)
    assert last.startswith("error: data.source='task' (reasoning-gym's tasks) needs reasoning-gym"), last
    assert last.endswith("it comes with the rl extra: pip install -e '.[rl]'"), last


def test_launch_report_without_matplotlib_is_one_error_line_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    out = tmp_path / "plots"
    code = textwrap.dedent(f"""
        import runpy
        sys.argv = ["report", "--out", {str(out)!r}, "--run", "a={run}"]
        runpy.run_module("launch.report", run_name="__main__", alter_sys=True)
        """)
    done = _run_refusing(["matplotlib"], code)
    assert done.returncode == 1, done.stderr[-3000:]
    last = _last_line(done)
    assert last.startswith("error: launch.report needs matplotlib, which does not import here"), last
    assert last.endswith("it comes with the rl extra: pip install -e '.[rl]'"), last
    assert not out.exists()


def test_the_tensorboard_writer_without_tensorboardx_names_the_extra_and_keeps_the_metrics(tmp_path):
    """MetricsWriter with log.tensorboard=True where tensorboardX does not import: a ValueError
    naming the extra (launch.train's one error line), raised before metrics.jsonl is touched (a
    resumed run's rows past its step stay); without TensorBoard the writer works."""
    rows = "".join(json.dumps({"step": s, "reward": 0.1 * s}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(rows)
    code = textwrap.dedent(f"""
        from logra_jax.metrics import MetricsWriter
        try:
            MetricsWriter({str(tmp_path)!r}, total_steps=3, start_step=1, tensorboard=True,
                          progress=False)
        except ValueError as e:
            print("refused:", e)
        writer = MetricsWriter({str(tmp_path)!r}, total_steps=3, start_step=3, tensorboard=False,
                               progress=False)
        writer.close()
        """)
    done = _run_refusing(["tensorboardX"], code + _REPORT_RL)
    assert done.returncode == 0, done.stderr[-3000:]
    refused = next(line for line in done.stdout.splitlines() if line.startswith("refused:"))
    assert refused.startswith("refused: log.tensorboard=True needs tensorboardX"), refused
    assert refused.endswith("it comes with the rl extra: pip install -e '.[rl]'"), refused
    assert (tmp_path / "metrics.jsonl").read_text() == rows
    assert json.loads(done.stdout.splitlines()[-1]) == []
