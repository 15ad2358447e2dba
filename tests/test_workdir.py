"""A workdir is one run's: a second run is refused while the first holds it, and nothing an earlier
run left is overwritten before the new run is known to continue it (logra_jax/rl/workdir.py).

Everything here is refused before the model is built: `no_model` makes building one a failure, so
each test also checks that the refusal comes first (and stays fast)."""

import gc
import json
import os
import pathlib
import resource
import signal
import socket
import subprocess
import sys
import time

import pytest

from launch import train as train_cli
from logra_jax import metrics
from logra_jax.rl import build
from logra_jax.rl import trainer as trainer_lib
from logra_jax.rl import run_dir as run_dir_lib
from logra_jax.rl import workdir as workdir_lib
from tiny_config import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOLD_LOCK = ("import pathlib, sys\n"
             "from logra_jax.rl.workdir import WorkdirLock\n"
             "lock = WorkdirLock(pathlib.Path(sys.argv[1])).acquire()\n"
             "print('locked', flush=True)\n"
             "sys.stdin.read()\n")


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the refusal")
    monkeypatch.setattr(build, "build_model", refuse)


def _files(workdir: pathlib.Path) -> dict[str, bytes | None]:
    """{relative path: bytes, or None for a folder} of everything in ``workdir``."""
    return {str(f.relative_to(workdir)): f.read_bytes() if f.is_file() else None
            for f in sorted(workdir.rglob("*"))}


def _refusal(config, workdir, **kwargs) -> str:
    with pytest.raises(SystemExit) as exit_:
        train_cli.run(config, str(workdir), **kwargs)
    line = exit_.value.code
    assert isinstance(line, str) and line.startswith("error: ") and "\n" not in line, line
    return line


def test_a_second_run_is_refused_naming_the_first_and_a_dead_holder_frees_the_workdir(tmp_path):
    """Two real processes: one holds the lock, `launch.train` on the same workdir is one line
    naming its pid and host, in seconds, with the holder's history untouched; once the holder
    is gone (killed: no cleanup of its own), the workdir can be locked again."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _files(tmp_path)
        tic = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "launch.train", "--config", "configs/tiny.py",
                               "--workdir", str(tmp_path)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        seconds = time.perf_counter() - tic
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]   # no JAX start-up noise
        assert lines[0].startswith(f"error: workdir {tmp_path} is in use by another run (pid "
                                   f"{holder.pid} on host {socket.gethostname()}, since "), lines
        assert _files(tmp_path) == before
        assert seconds < 60, f"the refusal took {seconds:.0f} s: it should come before the model"
        with pytest.raises(ValueError, match=f"pid {holder.pid} on host"):
            workdir_lib.WorkdirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = workdir_lib.WorkdirLock(tmp_path).acquire()   # the kernel released the dead one's lock
    assert f"pid {os.getpid()} on host" in (tmp_path / workdir_lib.LOCK).read_text()
    lock.release()


def test_the_lock_is_held_for_the_runs_life_and_released_by_close(tmp_path, no_model):
    """In one process too (a second open of the lock file conflicts): a Run holds it from
    construction, and a refused one releases it."""
    lock = workdir_lib.WorkdirLock(tmp_path).acquire()
    assert "is in use by another run (pid" in _refusal(tiny_config(), tmp_path)
    lock.release()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')   # refused after taking the lock
    assert "no checkpoint to resume them from" in _refusal(tiny_config(), tmp_path)
    workdir_lib.WorkdirLock(tmp_path).acquire().release()      # ... and released it


def test_a_live_run_holds_the_lock_until_it_is_closed(tmp_path, shipped_tiny_parts, monkeypatch):
    """A built Run — after garbage collection, and again inside its loop — refuses a second
    acquire naming this process; after close() the lock is granted. The loop is stopped at its
    first rollout, before anything compiles."""
    class Stop(Exception):
        pass

    refusals = []

    def first_rollout(*args, **kwargs):
        with pytest.raises(ValueError, match=f"is in use by another run \\(pid {os.getpid()} on host") as e:
            workdir_lib.WorkdirLock(tmp_path).acquire()
        refusals.append(str(e.value))
        raise Stop

    monkeypatch.setattr(trainer_lib, "dispatch_rollouts", first_rollout)
    run = trainer_lib.Run(tiny_config(), tmp_path, parts=shipped_tiny_parts)
    try:
        gc.collect()   # a lock only the garbage holds would be released here
        with pytest.raises(ValueError, match=f"pid {os.getpid()} on host"):
            workdir_lib.WorkdirLock(tmp_path).acquire()
        with pytest.raises(Stop):
            run.loop()
        assert len(refusals) == 1
    finally:
        run.close()
    workdir_lib.WorkdirLock(tmp_path).acquire().release()


def test_an_empty_workdir_is_refused(tmp_path, no_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _refusal(tiny_config(), "") == ("error: --workdir is empty; pass the folder for this "
                                           "run's metrics and checkpoints (it is created if missing)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("entry, make", [
    ("checkpoints", lambda p: p.write_text("notes")),
    ("metrics.jsonl", lambda p: p.mkdir()),
    ("config.json", lambda p: p.mkdir()),
    # A device: a resume read /dev/full as metrics without end, until memory ran out.
    ("metrics.jsonl", lambda p: p.symlink_to("/dev/full")),
    ("config.json", lambda p: os.mkfifo(p)),
])
def test_an_entry_of_the_wrong_kind_is_refused(entry, make, tmp_path, no_model):
    make(tmp_path / entry)
    before = _files(tmp_path)
    line = _refusal(tiny_config(), tmp_path)
    assert f"{tmp_path / entry} is " in line and "move it out of the workdir" in line, line
    assert _files(tmp_path) == before


HISTORY = [{"step": 1, "reward": 0.0}, {"step": 2, "reward": 0.5}, {"step": 3, "reward": 0.25}]


def _history(workdir: pathlib.Path, config) -> None:
    """What a run leaves when its checkpoints/ is gone: its config and 3 metrics rows."""
    workdir_lib.write_config(workdir, config)
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in HISTORY))


@pytest.mark.parametrize("optimizer", ["logra", "adamw"])
def test_a_history_without_a_checkpoint_is_refused_not_restarted(optimizer, tmp_path, no_model):
    _history(tmp_path, tiny_config())
    before = _files(tmp_path)
    line = _refusal(tiny_config(dict(optimizer=dict(name=optimizer))), tmp_path)
    assert "holds metrics of steps 1–3 but no checkpoint to resume them from" in line, line
    assert "pass --fresh" in line
    assert _files(tmp_path) == before


def test_another_config_without_a_checkpoint_or_metrics_is_refused(tmp_path, no_model):
    workdir_lib.write_config(tmp_path, tiny_config())
    before = _files(tmp_path)
    line = _refusal(tiny_config(dict(seed=5)), tmp_path)
    assert "holds the config.json of a run with another config (seed changed)" in line, line
    assert _files(tmp_path) == before


def test_fresh_moves_the_history_aside_and_starts_over(tmp_path, shipped_tiny_parts):
    """--fresh: nothing is deleted; once the new run is built, the earlier run's files move to
    previous-<time>/ whole (a run that fails to build moves nothing: test_bad_input.py)."""
    _history(tmp_path, tiny_config(dict(seed=5)))
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    before = _files(tmp_path)
    run = trainer_lib.Run(tiny_config(), tmp_path, parts=shipped_tiny_parts, fresh=True)
    run.close()
    [aside] = tmp_path.glob("previous-*")
    assert {f"{aside.name}/{k}": v for k, v in before.items()} == {
        k: v for k, v in _files(tmp_path).items() if k.startswith(f"{aside.name}/")}
    assert (aside / "checkpoints" / "3").is_dir() and not (tmp_path / "metrics.jsonl").exists()


def test_a_checkpoints_link_to_nothing_is_named_and_fresh_moves_it_whole(tmp_path, no_model,
                                                                        shipped_tiny_parts):
    """A ``checkpoints`` link that loops is no checkpoints folder: the refusal names it (not
    "checkpoints/ was removed"), and --fresh moves it with the rest, as a link."""
    _history(tmp_path, tiny_config())
    (tmp_path / "checkpoints").symlink_to("checkpoints")
    before = _files(tmp_path)
    line = _refusal(tiny_config(), tmp_path)
    assert (f"{tmp_path / 'checkpoints'} is a symbolic link that loops (checkpoints → checkpoints)"
            in line and "--fresh" in line), line
    assert _files(tmp_path) == before
    run = trainer_lib.Run(tiny_config(), tmp_path, parts=shipped_tiny_parts, fresh=True)
    run.close()
    [aside] = tmp_path.glob("previous-*")
    assert (aside / "checkpoints").is_symlink() and os.readlink(aside / "checkpoints") == "checkpoints"
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "config.json", "metrics.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name]


def test_fresh_moves_everything_or_nothing(tmp_path, monkeypatch):
    """A move that fails halfway (here: the third entry) puts back the ones already moved."""
    _history(tmp_path, tiny_config())
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    before = _files(tmp_path)
    rename, moved = pathlib.Path.rename, []

    def fail_third(self, target):
        moved.append(self.name)
        if len(moved) == 3:
            raise PermissionError(13, "Permission denied", str(self))
        return rename(self, target)
    monkeypatch.setattr(pathlib.Path, "rename", fail_third)
    with pytest.raises(ValueError, match=r"^--fresh could not move .*metrics.jsonl into .*previous-"
                                         r".*: Permission denied; nothing was moved$"):
        workdir_lib.set_aside(tmp_path)
    monkeypatch.undo()
    assert _files(tmp_path) == before and not list(tmp_path.glob("previous-*"))


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "holds a JSON list, not the object of a run's config"),
    ('{"seed": ', "is not a JSON config"),
    (b"\xff\xfe{}", "is not a JSON config"),
])
def test_a_config_json_that_cannot_be_read_is_named(text, message, tmp_path, no_model):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    line = _refusal(tiny_config(), tmp_path)
    assert line.startswith(f"error: {path} ") and message in line, line
    assert path.read_bytes() == (text if isinstance(text, bytes) else text.encode())


def test_metrics_that_are_not_utf8_are_named(tmp_path, no_model):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\n')
    assert _refusal(tiny_config(), tmp_path).startswith(
        f"error: {tmp_path / 'metrics.jsonl'}: not a UTF-8 metrics file")


def test_verbose_keeps_the_traceback(tmp_path, no_model):
    with pytest.raises(ValueError, match="--workdir is empty"):
        train_cli.run(tiny_config(), "", verbose=True)


def test_a_resume_from_an_earlier_step_replaces_the_rows_it_repeats(tmp_path):
    """metrics.jsonl holds each step once: rows after the resumed step are dropped (duplicates
    from before, too: the last row of a step is kept), atomically, and the file is then appended."""
    rows = [{"step": s, "run": i} for i, s in enumerate([1, 2, 1, 2, 3, 4])]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "rew')
    writer = metrics.MetricsWriter(tmp_path, total_steps=4, start_step=2, tensorboard=False,
                                   progress=False)
    writer.write(3, {"run": 9})
    writer.close()
    assert metrics.read_jsonl(path) == [{"step": 1, "run": 2}, {"step": 2, "run": 3},
                                        {"step": 3, "run": 9}]
    assert not list(tmp_path.glob(".*.tmp"))
    untouched = path.read_bytes()
    metrics.MetricsWriter(tmp_path, total_steps=4, start_step=3, tensorboard=False,
                          progress=False).close()
    assert path.read_bytes() == untouched           # nothing to drop: the file is not rewritten


def test_a_checkpoint_without_the_loops_meta_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint .*/checkpoints/2 has no step, baseline, data"):
        run_dir_lib.loop_meta({}, tmp_path / "checkpoints" / "2")
    assert run_dir_lib.loop_meta({"step": 2, "baseline": 0.5, "data": {"i": 1}},
                                  tmp_path) == (2, 0.5, {"i": 1})


def test_a_checkpoint_that_cannot_be_written_names_its_folder(tmp_path, caplog):
    """A file size limit at save time: orbax's writer threads fail, each logging its traceback;
    the run sees one OSError naming the folder and the reason (launch.train prints it as its one
    line), and nothing is logged."""
    import jax
    from logra_jax import checkpoint
    folder = tmp_path / "checkpoints"
    saver = checkpoint.Checkpointer(folder)
    weights = jax.random.normal(jax.random.PRNGKey(0), (512, 512))   # 1 MiB, incompressible
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.getsignal(signal.SIGXFSZ)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limit[1]))
    try:
        with pytest.raises(OSError, match=f"checkpoint 1 could not be written to {folder}: "
                                          f".*File too large"):
            saver.save(1, {"w": weights}, {"step": 1})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert [r.getMessage()[:200] for r in caplog.records] == []
    assert saver.all_steps() == []


def test_a_workdir_path_too_long_for_the_filesystem_is_one_line(tmp_path, no_model):
    line = _refusal(tiny_config(), tmp_path / ("x" * 300))
    assert line.startswith(f"error: workdir {tmp_path / ('x' * 300)} cannot be created: "), line
    assert "File name too long" in line


def test_metrics_rows_follow_the_path_when_the_file_is_moved_or_replaced(tmp_path, capsys):
    """metrics.jsonl moved during a run: the rows it holds stay there, the rest go to a new file at
    the path, said once (they went to the moved file); the path made a folder: an OSError naming
    it (the closing line named a folder)."""
    from logra_jax import metrics as metrics_lib
    writer = metrics_lib.MetricsWriter(tmp_path, total_steps=4, tensorboard=False, progress=False)
    writer.write(1, {"reward": 0.5})
    path = tmp_path / "metrics.jsonl"
    path.rename(tmp_path / "moved.jsonl")
    writer.write(2, {"reward": 0.25})
    writer.write(3, {"reward": 0.75})
    assert [r["step"] for r in metrics_lib.read_jsonl(tmp_path / "moved.jsonl")] == [1]
    assert [r["step"] for r in metrics_lib.read_jsonl(path)] == [2, 3]
    warnings = [l for l in capsys.readouterr().err.splitlines() if "moved or deleted" in l]
    assert warnings == [f"warning: {path} was moved or deleted during the run; the rows of steps "
                        f"2 on go to a new {path}"]
    path.unlink()
    path.mkdir()
    with pytest.raises(OSError, match=f"{path} is no longer a regular file: step 4's metrics"):
        writer.write(4, {"reward": 1.0})
    writer.close()
