"""SIGTERM / SIGINT stop a training process after its step in progress, with a checkpoint, one
line and the signal's exit status; the same command then resumes. A real process, a real signal."""

import json
import os
import pathlib
import re
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
# thread per device (launch/process.py: size_cpu_thread_pool). Without that, its first step aborts.
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


# absl's log format ("I1205 12:22:13.293900 140440 sampler.py:294] ..."): under --verbose only.
ABSL_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)


def test_sigterm_and_sigint_save_the_step_and_the_same_command_resumes(tmp_path):
    """SIGTERM stops the first run; the same command resumes from its checkpoint, and SIGINT
    (Ctrl-C) stops it again later: every step logged once, in order. (That a resumed run goes on
    to finish is tests/test_trainer.py's resume tests; a third process here cost ~45 s.) What
    each process says is plain lines, not absl's log format."""
    first, stderr = _stop_after_a_new_step(tmp_path, signal.SIGTERM)
    assert json.loads((tmp_path / "config.json").read_text())["max_steps"] == 1000
    assert not ABSL_LINE.search(stderr), stderr[-2000:]
    second, stderr = _stop_after_a_new_step(tmp_path, signal.SIGINT)
    assert f"\nresumed from {tmp_path / 'checkpoints'} at step {first}\n" in f"\n{stderr}", stderr
    assert not ABSL_LINE.search(stderr), stderr[-2000:]
    assert second > first
    assert [r["step"] for r in _rows(tmp_path)] == list(range(1, second + 1))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_before_the_first_step_leaves_the_workdir_as_it_was(tmp_path, signum):
    """A signal while the run is being set up (here: as soon as it holds the workdir's lock):
    one ``stopped:`` line and the signal's exit status, and the workdir as it was — no lock
    naming a process that is gone, no empty checkpoints/ or metrics.jsonl; a workdir the run
    created is removed (SIGTERM's case), one that existed keeps only what it held (SIGINT's)."""
    workdir = tmp_path / "runs" / "w"
    if signum == signal.SIGINT:
        workdir.mkdir(parents=True)
        (workdir / "notes.txt").write_text("mine")
    proc = _train(workdir, 3)
    try:
        deadline = time.monotonic() + 120
        while not (workdir / ".lock").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)
            time.sleep(0.05)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == 128 + signum, stderr[-3000:]
    assert stderr.strip().splitlines() == [f"stopped: {signal.Signals(signum).name} before the "
                                           f"first step; nothing was trained"], stderr[-3000:]
    if signum == signal.SIGINT:
        assert sorted(p.name for p in workdir.iterdir()) == ["notes.txt"]
    else:
        assert not (tmp_path / "runs").exists(), list((tmp_path / "runs").rglob("*"))


def test_a_cut_last_metrics_line_is_dropped_and_a_bad_one_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    assert metrics.read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON metrics row"):
        metrics.read_jsonl(path)


def test_a_signal_after_the_loop_does_not_say_nothing_was_trained():
    """Before a loop, a signal raises `Interrupted` ("nothing was trained"); once a loop has run,
    a signal while the run saves its checkpoint and closes is a stop request, not an interruption
    (the run did train). In this process, with its own handlers, restored at the end."""
    from logra_jax.rl import stopping
    before = stopping.StopRequest().install()
    try:
        with pytest.raises(stopping.Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)   # the handler runs between bytecodes; this gives it the time
    finally:
        before.uninstall()
    stop = stopping.StopRequest().install()
    try:
        with stop.deferred():
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert stop.signum == signal.SIGTERM
    finally:
        stop.uninstall()


def test_a_signal_whose_interruption_was_lost_stops_the_run_at_the_loop():
    """A signal before the loop whose `Interrupted` Python dropped (raised while a gc callback or
    a finalizer ran: "Exception ignored in ...") still stops the run before its first step, as
    the loop starts, instead of letting it train."""
    from logra_jax.rl import stopping
    stop = stopping.StopRequest()
    try:
        stop._handle(signal.SIGTERM, None)   # as the handler runs inside a gc callback
    except stopping.Interrupted:
        pass                                 # what Python does there: report and go on
    with pytest.raises(stopping.Interrupted, match="SIGTERM before the first step"):
        with stop.deferred():
            pytest.fail("the loop started")
    stop.uninstall()


def test_a_dropped_interruption_prints_no_traceback(monkeypatch):
    """What Python reports of an exception it drops (`sys.unraisablehook`): nothing for an
    `Interrupted` (the loop raises it again), the usual report for anything else."""
    from logra_jax.rl import stopping
    reported = []
    monkeypatch.setattr(sys, "unraisablehook",
                        stopping._quiet_about_interruptions(lambda info: reported.append(info)))

    class Raises:
        def __init__(self, error):
            self.error = error

        def __del__(self):
            raise self.error

    Raises(stopping.Interrupted(signal.SIGTERM))
    Raises(RuntimeError("kept"))
    assert [str(info.exc_value) for info in reported] == ["kept"]
