"""SIGTERM / SIGINT stop a training process after its step in progress, with a checkpoint, one
line and the signal's exit status; the same command then resumes. A real process, a real signal."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from logra_jax import metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The KL variant on the tiny config: REINFORCE's failure reward moves the weights every step.
ARGS = ["--config", "configs/tiny.py", "--config.optimizer.logra.variant=kl",
        "--config.rl.algorithm=reinforce", "--config.checkpoint.every=1000",
        "--config.log.progress=False", "--config.log.tensorboard=False"]


# Without the suite's NPROC: the command sizes XLA:CPU's thread pool itself, and the KL variant
# with micro-batches of 8 rows on 8 devices is the run whose collectives starved a pool of one
# thread per device (launch/__init__.py: size_cpu_thread_pool). Without that, its first step aborts.
ENV = {name: value for name, value in os.environ.items() if name != "NPROC"}


def _train(workdir, max_steps, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "launch.train", "--workdir", str(workdir),
                             *ARGS, f"--config.max_steps={max_steps}"], cwd=ROOT, text=True,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def _rows(workdir):
    path = workdir / "metrics.jsonl"
    return metrics.read_jsonl(path) if path.exists() else []


def _stop_after_a_new_step(workdir, signum) -> tuple[int, str]:
    """Runs the command to max_steps=1000, sends ``signum`` once a new step is logged, and checks
    the stop: the signal's exit status, one ``stopped:`` line, a checkpoint of that step although
    checkpoint.every=1000. Returns the step and the run's stderr."""
    before = len(_rows(workdir))
    proc = _train(workdir, 1000)
    deadline = time.time() + 300
    while len(_rows(workdir)) <= before and proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, proc.stderr.read()[-2000:]
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, stderr[-2000:]
    stopped = [line for line in stderr.splitlines() if line.startswith("stopped:")]
    assert len(stopped) == 1, stderr[-2000:]
    step = _rows(workdir)[-1]["step"]
    assert step > before and f"after step {step};" in stopped[0]
    assert (workdir / "checkpoints" / str(step)).is_dir()
    return step, stderr


def test_sigterm_and_sigint_save_the_step_and_the_same_command_resumes(tmp_path):
    """SIGTERM stops the first run; the same command resumes from its checkpoint, and SIGINT
    (Ctrl-C) stops it again later: every step logged once, in order. (That a resumed run goes on
    to finish is tests/test_trainer.py's resume tests; a third process here cost ~45 s.)"""
    first, _ = _stop_after_a_new_step(tmp_path, signal.SIGTERM)
    assert json.loads((tmp_path / "config.json").read_text())["max_steps"] == 1000
    second, stderr = _stop_after_a_new_step(tmp_path, signal.SIGINT)
    assert f"resumed from {tmp_path / 'checkpoints'} at step {first}" in stderr
    assert second > first
    assert [r["step"] for r in _rows(tmp_path)] == list(range(1, second + 1))


def test_a_cut_last_metrics_line_is_dropped_and_a_bad_one_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    assert metrics.read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON metrics row"):
        metrics.read_jsonl(path)
