"""A run's workdir: one run at a time, and nothing in it overwritten before the run is known to be valid.

A workdir holds ``checkpoints/`` (orbax), ``config.json`` (the config the run started with),
``metrics.jsonl`` and ``tensorboard/``. Before anything is built:

- `check_path` refuses an empty path and one that starts with ``~`` (the shell expands it only at
  the start of a word), before anything is imported or created; `make_folder` then makes the
  folder, refusing a file, a folder that cannot be created or written, and entries of the wrong
  kind (a ``checkpoints`` that is a file, a ``metrics.jsonl`` that is a folder);
- `WorkdirLock` takes an exclusive lock on ``.lock`` for the run's life (one per run: process 0
  takes it), so a second run on the same workdir is refused naming the first's pid and host;
- `History` reads what an earlier run left and refuses what cannot continue it: a resume with a
  config that changes the saved state, or a history (metrics rows, another config) without a
  checkpoint to resume from, or an entry that is a symbolic link to nothing — unless the run is
  started ``fresh``, which moves that history aside into ``previous-<UTC time>/`` (nothing is
  deleted; `set_aside` moves every entry or none);
- `remove_unused` takes back what a run created and left empty (a run stopped or refused before its
  first step leaves the workdir as it found it).

A run's use of these, from the lock to its close, is rl/run_dir.py's `RunDir`.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import pathlib
import shutil
import socket

import ml_collections

from logra_jax import config as config_lib
from logra_jax import metrics as metrics_lib
from logra_jax.rl import stopping

LOCK = ".lock"
CHECKPOINTS = "checkpoints"
CONFIG = "config.json"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
# What each entry must be when it exists; a run writes into each.
_KINDS = {CHECKPOINTS: "folder", TENSORBOARD: "folder", CONFIG: "file", METRICS: "file", LOCK: "file"}
# The entries that make up a run's history (what --fresh moves aside).
HISTORY = (CHECKPOINTS, CONFIG, METRICS, TENSORBOARD)


def check_path(workdir: str | os.PathLike) -> None:
    """Refuses what no run can use as a workdir path, from the text alone (nothing is touched):
    an empty one, and one that starts with ``~``. The shell expands ``~`` only at the start of a
    word, so ``--workdir=~/runs/x`` reaches the run as it is typed, and would create a folder
    literally named ``~`` in the current one (one ``rm -rf ~`` away from the home folder)."""
    text = str(workdir)
    if not text.strip():
        raise ValueError("--workdir is empty; pass the folder for this run's metrics and "
                         "checkpoints (it is created if missing)")
    if text.startswith("~"):
        expanded = os.path.expanduser(text)
        raise ValueError(f"--workdir {text} starts with '~', which the shell did not expand (it "
                         f"does so only at the start of a word, not after '='): pass "
                         f"--workdir {expanded} instead" if expanded != text else
                         f"--workdir {text} starts with '~' and names no user's home folder: "
                         f"pass the path without '~'")


def missing_root(workdir: str | os.PathLike) -> pathlib.Path | None:
    """The outermost folder of ``workdir``'s path that does not exist yet (what `make_folder` would
    create, for a failed run to take back), or None when the workdir exists."""
    path = pathlib.Path(workdir)
    missing = None
    for folder in (path, *path.parents):
        try:
            if folder.exists() or folder.is_symlink():
                break
        except OSError:   # a name too long for the filesystem: `make_folder` names it
            return None
        missing = folder
    return missing


def remove_created(workdir: pathlib.Path, root: pathlib.Path | None) -> None:
    """Removes the folders from ``workdir`` up to ``root`` (`missing_root`'s answer before the run
    created them) while they are empty: a run refused or stopped before writing anything leaves no
    empty new workdir behind."""
    if root is None:
        return
    for folder in (workdir, *workdir.parents):
        try:
            folder.rmdir()
        except OSError:   # not empty (or gone): what is left is someone's
            return
        if folder == root:
            return


def make_folder(workdir: str | os.PathLike) -> pathlib.Path:
    """The workdir as a folder this process can write (made if missing), its entries of the
    kind a run writes; ValueError naming the path otherwise."""
    check_path(workdir)
    path = pathlib.Path(workdir)
    try:   # exists() too raises OSError, for a name too long for the filesystem
        for link in (path, *path.parents):   # mkdir would say "File exists" of a dangling link
            if link.is_symlink() and not link.exists():
                raise ValueError(f"workdir {path}: {link} is a symbolic link to "
                                 f"{os.readlink(link)}, which does not exist; create its target "
                                 f"or pass another --workdir")
        if path.exists() and not path.is_dir():
            raise ValueError(f"workdir {path} is a file, not a folder; pass a folder for metrics "
                             f"and checkpoints")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"workdir {path} cannot be created: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"workdir {path} is not writable; pass a folder you can write to")
    for name, kind in _KINDS.items():
        entry = path / name
        if entry.is_symlink() and not entry.exists():
            continue   # a link to nothing: History names it (--fresh moves it aside)
        if entry.exists() and entry.is_dir() != (kind == "folder"):
            raise ValueError(f"{entry} is a {'folder' if entry.is_dir() else 'file'}, but a run "
                             f"keeps its {name} there as a {kind}; move it out of the workdir")
        if kind == "file" and entry.exists() and not entry.is_file():
            # A device, a pipe or a socket (or a link to one): reading /dev/zero or /dev/full as
            # metrics never ends, and writing to one keeps nothing.
            target = f" (a link to {os.readlink(entry)})" if entry.is_symlink() else ""
            raise ValueError(f"{entry} is not a regular file{target}, but a run keeps its {name} "
                             f"there as one; move it out of the workdir")
    return path


class WorkdirLock:
    """An exclusive `flock` on ``workdir/.lock`` until `release` (or the process ends: the kernel
    drops a dead process's lock, so a crashed run never leaves a stale one). The file holds the
    holder's pid, host and start time, for the refusal's message, and exists only while a run
    holds it. Local filesystems and NFS (Linux emulates flock there with a byte-range lock)
    enforce it across hosts sharing the workdir."""

    def __init__(self, workdir: pathlib.Path):
        self.path = pathlib.Path(workdir) / LOCK
        self._file = None

    def acquire(self) -> "WorkdirLock":
        """Takes the lock (ValueError naming the holder when another run has it). Signals wait
        until the file names this process; one arriving then finds the lock taken, and `release`d
        as the stop unwinds: no lock file naming a process that is gone."""
        try:
            with stopping.critical():
                self._acquire()
        except BaseException:
            self.release()
            raise
        return self

    def _acquire(self) -> None:
        while True:
            file = open(self.path, "a+")   # not "w": the holder's line stays until the lock is ours
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.seek(0)
                holder = file.read().strip() or "a process that has not written its pid yet"
                file.close()
                raise ValueError(f"workdir {self.path.parent} is in use by another run ({holder}); "
                                 f"wait for it to end or stop it, or pass another --workdir") from None
            # A holder that released meanwhile removed the file we opened: lock the new one.
            if self.path.exists() and os.stat(self.path).st_ino == os.fstat(file.fileno()).st_ino:
                break
            file.close()
        file.seek(0)
        file.truncate()
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        file.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {started}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        """Removes the file while still holding its lock (see `acquire`), then unlocks."""
        if self._file is not None:
            self.path.unlink(missing_ok=True)
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
    """The steps of the checkpoint folders in ``workdir`` (their names), finished or not."""
    folder = workdir / CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted(int(entry.name) for entry in folder.iterdir() if entry.name.isdigit())


class History:
    """What earlier runs left in a workdir: the config they started with (None when absent) and
    the steps recorded in metrics.jsonl. Reading it changes nothing; a file it cannot read is a
    ValueError naming the file."""

    def __init__(self, workdir: pathlib.Path):
        self.workdir = workdir
        config_path = workdir / CONFIG
        self.config: dict | None = None
        if config_path.exists():
            try:
                self.config = json.loads(config_path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{config_path} is not a JSON config ({e}); it records the config "
                                 f"this workdir's run started with: restore it, or start over with "
                                 f"--fresh") from None
            if not isinstance(self.config, dict):
                raise ValueError(f"{config_path} holds a JSON {type(self.config).__name__}, not the "
                                 f"object of a run's config: restore it, or start over with --fresh")
        for name in HISTORY + (LOCK,):
            broken = broken_link(workdir / name)
            if broken:
                raise ValueError(f"{workdir / name} is {broken}; remove the link (or make it point "
                                 f"at a folder), or pass --fresh to move it with the earlier run "
                                 f"into {workdir}/previous-<time>/")
        metrics_path = workdir / METRICS
        rows = metrics_lib.read_jsonl(metrics_path) if metrics_path.exists() else []
        self.steps = sorted({row["step"] for row in rows if isinstance(row.get("step"), int)})

    def changes(self, config: ml_collections.ConfigDict) -> list[str]:
        """Keys that ``config`` changes from the recorded one, except those a resume may change."""
        if self.config is None:
            return []
        return config_lib.state_changes(self.config, config_lib.as_json(config))

    def check_continues(self, config: ml_collections.ConfigDict,
                        checkpoints: dict[int, dict | None]) -> None:
        """Refuses a run that would not continue this history: a config that changes the saved
        state, or recorded steps (or another config) with no checkpoint to resume them from.

        ``checkpoints``: {step: the config fingerprint its meta records, or None when it records
        none (written before checkpoints carried one)} of every checkpoint whose meta can be read
        (a damaged one is left to the restore, which sets it aside)."""
        changed = self.changes(config)
        path = self.workdir / CONFIG
        if checkpoints and changed:
            raise ValueError(f"{self.workdir} holds a run with another config: "
                             f"{', '.join(changed)} changed (see {path}); resume with the "
                             f"original values, start a new workdir, or pass --fresh to set "
                             f"this run aside and start over")
        if checkpoints:   # config.json matches, or is gone: the checkpoints' own record decides
            for step in sorted(checkpoints, reverse=True):
                check_checkpoint_config(checkpoints[step], self.workdir / CHECKPOINTS / str(step),
                                        config)
            if all(fp is None for fp in checkpoints.values()) and self.config is None:
                newest = max(checkpoints)
                raise ValueError(f"checkpoint {newest} in {self.workdir / CHECKPOINTS} records no "
                                 f"config (it was written by an earlier version) and {path} is "
                                 f"gone, so nothing tells whether this config continues it; put "
                                 f"back the config.json it was trained with, or pass --fresh to "
                                 f"set this run aside and start over")
            return
        if self.steps:
            unfinished = sorted((self.workdir / CHECKPOINTS).glob("*.orbax-checkpoint-tmp*"))
            left = (f"; {', '.join(p.name for p in unfinished)} in {CHECKPOINTS}/ "
                    f"{'is a write' if len(unfinished) == 1 else 'are writes'} that did not "
                    f"finish and cannot be resumed" if unfinished else "")
            raise ValueError(f"{self.workdir} holds metrics of steps {self.steps[0]}–{self.steps[-1]} "
                             f"but no checkpoint to resume them from (the run stopped before its "
                             f"first one, or {CHECKPOINTS}/ was removed){left}; pass --fresh to "
                             f"move that history into {self.workdir}/previous-<time>/ and start "
                             f"over, or use another --workdir")
        if changed:
            raise ValueError(f"{self.workdir} holds the config.json of a run with another config "
                             f"({', '.join(changed)} changed) and no checkpoint; pass --fresh to "
                             f"move it into {self.workdir}/previous-<time>/ and start over, or use "
                             f"another --workdir")


def check_checkpoint_config(recorded: dict | None, where: pathlib.Path,
                            config: ml_collections.ConfigDict) -> None:
    """Refuses to resume checkpoint ``where`` with ``config`` when the config fingerprint its meta
    records (``recorded``; None: none recorded) differs in a key that changes training, naming
    each key with its recorded and its new value."""
    if recorded is None:
        return
    current = config_lib.as_json(config)
    changed = config_lib.state_changes(recorded, current)
    if changed:
        raise ValueError(f"checkpoint {where.name} in {where.parent} was trained with another "
                         f"config: {config_lib.describe_changes(recorded, current, changed)}; "
                         f"resume with the values it was trained with, use another --workdir, or "
                         f"pass --fresh to set this run aside and start over")


def broken_link(entry: pathlib.Path) -> str | None:
    """What is wrong with ``entry`` when it is a symbolic link to nothing ("a symbolic link that
    loops (checkpoints → checkpoints)", "a symbolic link to /gone, which does not exist"), or
    None."""
    if not entry.is_symlink():
        return None
    try:
        entry.stat()
        return None
    except OSError as e:
        target = os.readlink(entry)
        if e.errno == errno.ELOOP:
            return f"a symbolic link that loops ({entry.name} → {target})"
        return f"a symbolic link to {target}, which does not exist"


def history_entries(workdir: pathlib.Path) -> list[pathlib.Path]:
    """The entries of an earlier run in ``workdir`` (links too, even broken ones)."""
    return [workdir / name for name in HISTORY
            if (workdir / name).exists() or (workdir / name).is_symlink()]


def check_set_aside(workdir: pathlib.Path) -> list[pathlib.Path]:
    """The entries `set_aside` would move; ValueError naming the first it could not (--fresh checks
    that it can finish before it moves anything): a workdir whose folder listing cannot be
    changed, or a folder that cannot change parent (renaming one needs write permission on it)."""
    entries = history_entries(workdir)
    if entries and not os.access(workdir, os.W_OK | os.X_OK):
        raise ValueError(f"--fresh cannot move the earlier run aside: {workdir} is not writable")
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink() and not os.access(entry, os.W_OK | os.X_OK):
            raise ValueError(f"--fresh cannot move {entry} into {workdir}/previous-<time>/: the "
                             f"folder is not writable (moving a folder rewrites its '..'); nothing "
                             f"was moved")
    return entries


def set_aside(workdir: pathlib.Path) -> pathlib.Path | None:
    """Moves every entry a run writes (checkpoints, config, metrics, events; links as links) into
    ``workdir/previous-<UTC time>/``; returns that folder, or None when there was nothing. All or
    nothing: checked first (`check_set_aside`), moved with signals held back, and moved back if a
    move fails (ValueError naming it)."""
    entries = check_set_aside(workdir)
    if not entries:
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    aside = workdir / f"previous-{stamp}"
    with stopping.critical():
        aside.mkdir()
        moved = []
        try:
            for entry in entries:
                entry.rename(aside / entry.name)
                moved.append(entry)
        except OSError as e:
            for entry in reversed(moved):
                (aside / entry.name).rename(entry)
            aside.rmdir()
            raise ValueError(f"--fresh could not move {e.filename} into {aside}: {e.strerror}; "
                             f"nothing was moved") from None
    return aside


def remove_unused(workdir: pathlib.Path, present_before: set[str]) -> None:
    """Removes the entries a run created that hold nothing of a step (it stopped or failed before
    its first): an empty ``checkpoints/``, an empty ``metrics.jsonl``, the ``tensorboard/`` folder
    of no step, the config.json it wrote. What existed before the run is not touched."""
    for name in HISTORY:
        entry = workdir / name
        if name in present_before or not entry.exists() or entry.is_symlink():
            continue
        if name == CHECKPOINTS and not any(entry.iterdir()):
            entry.rmdir()
        elif name == METRICS and entry.stat().st_size == 0:
            entry.unlink()
        elif name == TENSORBOARD:
            shutil.rmtree(entry, ignore_errors=True)
        elif name == CONFIG:
            entry.unlink()


def present(workdir: pathlib.Path) -> set[str]:
    """The names of the history entries ``workdir`` holds now."""
    return {entry.name for entry in history_entries(workdir)}


def write_config(workdir: pathlib.Path, config: ml_collections.ConfigDict | dict) -> None:
    """config.json (a ConfigDict, or its JSON as `config.as_json` gives it), replaced atomically: a
    kill mid-write leaves the old one whole."""
    path = workdir / CONFIG
    tmp = path.with_name(f".{CONFIG}.tmp")
    recorded = config if isinstance(config, dict) else config_lib.as_json(config)
    with stopping.critical():
        tmp.write_text(json.dumps(recorded, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
