"""Bad input, wherever it is found, is one `error: …` line and exit status 1, and loses nothing.

Every row runs `launch.train` — in this process through `launch.train.run` (what ``main`` calls, so
the same `error:` handling) on a copy of a real run's workdir, or as a real process for what is
checked before jax is imported (the command line itself). Each row asserts the single line, what
it names, and that the workdir holds exactly the files, bytes and times it held before.
"""

import hashlib
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from configs import tiny
from launch import train as train_cli
from tiny_config import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOOD_GSM8K = {"question": "Tom has 3 apples and buys 2 more. How many apples does he have?",
              "answer": "3 + 2 = 5\n#### 5"}


def _snapshot(workdir: pathlib.Path) -> dict[str, tuple[int, int, str]]:
    """{relative path: (size, mtime_ns, sha256)} of every file."""
    return {str(f.relative_to(workdir)): (f.stat().st_size, f.stat().st_mtime_ns,
                                          hashlib.sha256(f.read_bytes()).hexdigest())
            for f in sorted(workdir.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def trained(trained_tiny_run):
    """The workdir of a real 2-step tiny run (weights moved, checkpoint 2 written)."""
    return trained_tiny_run.workdir


def _gsm8k_dir(tmp_path: pathlib.Path, train_lines: list[str]) -> str:
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(line + "\n" for line in train_lines))
    (folder / "test.jsonl").write_text(json.dumps(GOOD_GSM8K) + "\n")
    return str(folder)


# (row id, overrides of configs/tiny.py — a callable gets tmp_path —, what the line must say)
ROWS = [
    ("max_steps", dict(max_steps=0), "max_steps must be positive, got 0"),
    ("temperature-zero", dict(rl=dict(temperature=0.0)), "rl.temperature must be > 0, got 0.0"),
    ("temperature-negative", dict(rl=dict(temperature=-1.0)), "rl.temperature must be > 0, got -1.0"),
    ("top-p", dict(rl=dict(top_p=1.5)), "rl.top_p must be in (0, 1]"),
    ("top-k", dict(rl=dict(top_k=-1)), "rl.top_k ≥ 0"),
    ("algorithm", dict(rl=dict(algorithm="ppo")), "rl.algorithm must be 'grpo' or 'reinforce'"),
    ("grpo-group-of-one", dict(rl=dict(algorithm="grpo", num_generations=1)), "num_generations=1"),
    ("micro-batch", dict(rl=dict(micro_batch_size=3)), "not a multiple of rl.micro_batch_size=3"),
    ("advantage-baseline", dict(rl=dict(advantage_baseline="median")), "rl.advantage_baseline"),
    ("completion-length", dict(rl=dict(max_completion_length=0)), "must be positive, got 64 and 0"),
    ("prompts-too-long", dict(rl=dict(max_prompt_length=8)),
     "longer than rl.max_prompt_length=8 tokens (the longest has 46): none is left"),
    ("prompts-too-long-no-skip", dict(rl=dict(max_prompt_length=8), data=dict(skip_long_prompts=False)),
     "raise rl.max_prompt_length to 46, or set data.skip_long_prompts=True"),
    ("optimizer-name", dict(optimizer=dict(name="sgd")), "optimizer.name must be one of ('logra', 'adamw', 'adafactor', 'galore', 'lora')"),
    ("lr-nan", dict(optimizer=dict(logra=dict(learning_rate=float("nan")))),
     "optimizer.logra.learning_rate must be a finite number ≥ 0, got nan"),
    ("adamw-lr-inf", dict(optimizer=dict(name="adamw", adamw=dict(learning_rate=float("inf")))),
     "optimizer.adamw.learning_rate must be a finite number ≥ 0, got inf"),
    ("others-lr-negative", dict(optimizer=dict(logra=dict(others_learning_rate=-1.0))),
     "optimizer.logra.others_learning_rate must be a finite number ≥ 0, got -1.0"),
    ("warmup", dict(optimizer=dict(warmup_steps=-2)), "optimizer.warmup_steps must be ≥ 0"),
    ("skips", dict(optimizer=dict(max_consecutive_skips=0)), "optimizer.max_consecutive_skips"),
    ("weight-growth", dict(optimizer=dict(max_weight_norm_growth=1.0)),
     "optimizer.max_weight_norm_growth must be > 1"),
    ("rank", dict(optimizer=dict(logra=dict(rank=0))), "rank must be a positive Python int"),
    ("variant", dict(optimizer=dict(logra=dict(variant="adam"))), "variant must be 'grpo' or 'kl'"),
    ("kl-budget", dict(optimizer=dict(logra=dict(kl_control=True, kl_budget=0.0))),
     "kl_budget must be positive"),
    ("targets", dict(optimizer=dict(logra=dict(targets="no_such_layer"))), "no_such_layer"),
    ("mesh-indivisible", dict(mesh=dict(fsdp=3)), "but there are 8 devices"),
    ("mesh-too-big", dict(mesh=dict(fsdp=4, tensor=4)), "but there are 8 devices"),
    ("sync-mode", dict(sync=dict(mode="bogus")), "sync.mode must be one of"),
    ("sync-devices-without-mode", dict(sync=dict(rollout_devices=4)), "needs a sync.mode"),
    ("factors-without-logra", dict(optimizer=dict(name="adamw"), sync=dict(mode="factors")),
     "has none (use full or sparse)"),
    ("factors-replayed-inexact", dict(sync=dict(mode="factors", rollout_devices=4),
                                      optimizer=dict(logra=dict(exact_merge=False))),
     "needs optimizer.logra.exact_merge=True"),
    ("data-source", dict(data=dict(source="csv")), "data.source must be 'task' or 'gsm8k'"),
    ("task", dict(data=dict(task="no_such_task")), "no_such_task"),
    ("gsm8k-no-dir", dict(data=dict(source="gsm8k")), "needs data.gsm8k_dir"),
    ("gsm8k-missing-dir", dict(data=dict(source="gsm8k", gsm8k_dir="/no/such/dir")),
     "GSM8K data directory /no/such/dir does not exist"),
    ("gsm8k-empty-file", lambda tmp: dict(data=dict(source="gsm8k", gsm8k_dir=_gsm8k_dir(tmp, []))),
     "train.jsonl holds no examples (it is empty)"),
    ("gsm8k-malformed-line",
     lambda tmp: dict(data=dict(source="gsm8k", gsm8k_dir=_gsm8k_dir(
         tmp, [json.dumps(GOOD_GSM8K), '{"question": "2+2?", "answer": "4'])),
         gsm8k_cache_dir=str(tmp / "cache")), "train.jsonl:2: not valid JSON"),
    ("model-missing-path", dict(model=dict(source="/no/such/model")),
     "model source '/no/such/model' does not exist"),
    ("model-unknown-name", dict(model=dict(source="gpt-17")), "unknown model source 'gpt-17'"),
    ("model-shape-only", dict(model=dict(source="shape:qwen2_5_7b")), "a model shape without weights"),
    ("resume-other-rank", dict(optimizer=dict(logra=dict(rank=4))),
     "holds a run with another config: optimizer.logra.rank changed"),
]


@pytest.mark.parametrize("overrides, message", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_config_is_one_line_and_loses_nothing(overrides, message, trained, tmp_path):
    workdir = tmp_path / "workdir"
    shutil.copytree(trained, workdir)
    before = _snapshot(workdir)
    config = tiny_config(dict(max_steps=4), overrides(tmp_path) if callable(overrides) else overrides)
    with pytest.raises(SystemExit) as exit_:
        train_cli.run(config, str(workdir))
    line = exit_.value.code
    assert isinstance(line, str), line            # SystemExit(str): printed, exit status 1
    assert line.startswith("error: ") and "\n" not in line, line
    assert message in line, line
    assert _snapshot(workdir) == before


def test_a_workdir_that_is_a_file_is_one_line(tmp_path):
    workdir = tmp_path / "notes.txt"
    workdir.write_text("keep me")
    with pytest.raises(SystemExit) as exit_:
        train_cli.run(tiny.get_config(), str(workdir))
    assert exit_.value.code == f"error: workdir {workdir} is a file, not a folder; pass a folder " \
                               "for metrics and checkpoints"
    assert workdir.read_text() == "keep me"


def test_a_workdir_that_cannot_be_created_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_:
        train_cli.run(tiny.get_config(), str(blocker / "run"))
    assert exit_.value.code.startswith(f"error: workdir {blocker / 'run'} cannot be created")


# The command line itself, checked before jax is imported: real processes, well under a second.
CLI_ROWS = [
    ("config-file-missing", ["--config", "configs/nope.py", "--workdir", "{w}"],
     "error: config file 'configs/nope.py' does not exist"),
    ("config-without-get-config", ["--config", "{bad_config}", "--workdir", "{w}"],
     "has no get_config() function"),
    ("unknown-key", ["--config", "configs/tiny.py", "--workdir", "{w}", "--config.optimizer.rnak=4"],
     "error: unknown config key 'optimizer.rnak'"),
    ("value-of-wrong-type", ["--config", "configs/tiny.py", "--workdir", "{w}", "--config.max_steps=abc"],
     "error: --config.max_steps=abc: expected an integer (its default is 3)"),
    ("bool-of-wrong-type", ["--config", "configs/tiny.py", "--workdir", "{w}", "--config.log.progress=maybe"],
     "expected true or false"),
    ("value-missing", ["--config", "configs/tiny.py", "--workdir", "{w}", "--config.rl.temperature"],
     "error: --config.rl.temperature needs a value"),
    ("workdir-missing", ["--config", "configs/tiny.py"], "error: --workdir is required"),
    ("config-missing", ["--workdir", "{w}"], "error: --config is required"),
]


@pytest.mark.parametrize("argv, message", [r[1:] for r in CLI_ROWS], ids=[r[0] for r in CLI_ROWS])
def test_bad_command_line_is_one_line(argv, message, trained, tmp_path):
    workdir = tmp_path / "workdir"
    shutil.copytree(trained, workdir)
    before = _snapshot(workdir)
    bad_config = tmp_path / "bad_config.py"
    bad_config.write_text("x = 1\n")
    argv = [a.format(w=workdir, bad_config=bad_config) for a in argv]
    done = subprocess.run([sys.executable, "-m", "launch.train", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert _snapshot(workdir) == before


def test_an_error_after_setup_reaches_the_shell_as_one_line(tmp_path):
    """The real process end to end for an error found once the model is built (prompt window)."""
    done = subprocess.run(
        [sys.executable, "-m", "launch.train", "--workdir", str(tmp_path), "--config",
         "configs/tiny.py", "--config.rl.max_prompt_length=8", "--config.data.skip_long_prompts=False"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "raise rl.max_prompt_length to 46" in last, last
    assert "Traceback" not in done.stderr
