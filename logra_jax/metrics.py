"""Per-step metrics: one JSON object per line in ``metrics.jsonl``, TensorBoard events, a progress bar.

Names follow TRL/Tunix where the concept exists (reward, kl, grad_norm, completions/mean_length …);
LoGRA's own live under ``logra/*``, timings under ``time/*``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import stat
import sys
from typing import Mapping

import numpy as np

from logra_jax.extras import require


def to_python(metrics: Mapping[str, object]) -> dict[str, float | int | str]:
    """Scalars (numpy/jax) to plain Python numbers; non-finite floats stay as they are (JSON NaN)."""
    out = {}
    for name, value in metrics.items():
        if isinstance(value, str):
            out[name] = value
            continue
        value = np.asarray(value)
        if value.size != 1:
            raise ValueError(f"metric {name!r} is not a scalar (shape {value.shape})")
        value = value.item()
        out[name] = value if isinstance(value, (int, bool)) else float(value)
    return out


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
    """The rows of a metrics file. A last line cut short (the run was killed mid-write) is
    dropped; a malformed line before it, or bytes that are not UTF-8, is an error naming the file."""
    return read_jsonl_and_cut(path)[0]


def read_jsonl_and_cut(path: str | pathlib.Path) -> tuple[list[dict], tuple[int, str] | None]:
    """(`read_jsonl`'s rows, (line number, text) of the cut last line it dropped, or None)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a UTF-8 metrics file (byte {e.start}: {e.reason})") from None
    rows = []
    for n, (i, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) - 1 and not line.endswith("\n"):
                return rows, (i, line)
            raise ValueError(f"{path}:{i}: not a JSON metrics row ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: not a JSON metrics row (a {type(row).__name__}, not an "
                             f"object)")
        rows.append(row)
    return rows, None


def rows_before(rows: list[dict], step: int) -> list[dict]:
    """The rows of steps 1..``step``, each step once (the last row written for it: a run that
    resumed from an earlier checkpoint wrote it again), in step order."""
    by_step = {row["step"]: row for row in rows if isinstance(row.get("step"), int)
               and row["step"] <= step}
    return [by_step[s] for s in sorted(by_step)]


# What the progress bar (or, without it, each step's line) shows: (row key, label).
PROGRESS_FIELDS = (("reward", "reward"), ("kl", "kl"), ("logra/predicted_kl", "predicted_kl"),
                   ("time/step", "s/step"))


class MetricsWriter:
    """Appends metrics to ``workdir/metrics.jsonl`` and TensorBoard; shows a progress bar.

    Appending (not truncating) keeps the history of a resumed run in one file. A run that resumes
    from an earlier step than the file has reached writes those steps again: the file is first
    replaced (atomically: a new file renamed over it) by its rows up to the resumed step, so every
    step appears once.
    """

    def __init__(self, workdir: str | pathlib.Path, *, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, progress: bool = True, files: bool = True,
                 kl_measured: bool = True):
        """``files=False``: rows are only formatted and returned (every process but the first of
        a multi-process run: one metrics.jsonl, one event file, one progress bar or step lines).
        ``progress=False``: one line per step on stdout instead of the bar. ``kl_measured``: the
        run computes ``kl`` (GRPO with a reference); otherwise its 0 is not shown."""
        self.workdir = pathlib.Path(workdir)
        self.path = self.workdir / "metrics.jsonl"
        self.total_steps, self.start_step = total_steps, start_step
        self._shown = tuple((key, label) for key, label in PROGRESS_FIELDS
                            if kl_measured or key != "kl")
        self._file = self._tb = self._bar = None
        self._lines = False
        self.rows: list[dict] = []   # this run's rows, for its closing summary
        if not files:
            return
        if tensorboard:   # before the file is touched: a missing writer changes nothing
            writer = require("tensorboardX", "tensorboardX", "log.tensorboard=True").SummaryWriter
        self._lines = not progress
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            rows, cut = read_jsonl_and_cut(self.path)
            if cut is not None:
                print(f"warning: {self.path}:{cut[0]}: dropped a last line cut short (a run "
                      f"stopped mid-write): {cut[1][:60]!r}", file=sys.stderr)
            kept = "".join(json.dumps(row) + "\n" for row in rows_before(rows, start_step))
            if kept.encode() != self.path.read_bytes():   # rows to drop, or a line cut short
                tmp = self.path.with_name(f".{self.path.name}.tmp")
                tmp.write_text(kept, encoding="utf-8")
                os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            self._tb = writer(str(self.workdir / "tensorboard"))
        if progress:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def write(self, step: int, metrics: Mapping[str, object]) -> dict:
        row = {"step": int(step), **to_python(metrics)}
        if self._file is not None:
            self._follow_the_path(step)
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._tb is not None:
            for name, value in row.items():
                if name != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(name, value, step)
        shown = {label: f"{row[key]:.3g}" for key, label in self._shown
                 if isinstance(row.get(key), (int, float))}
        if self._bar is not None:
            self._bar.set_postfix(shown)
            self._bar.update(1)
        if self._lines:
            print(f"step {step}/{self.total_steps}: "
                  + ", ".join(f"{v} {label}" if label == "s/step" else f"{label} {v}"
                              for label, v in shown.items()), flush=True)
        self.rows.append(row)
        return row

    def _follow_the_path(self, step: int) -> None:
        """Rows go to ``self.path``, not to whatever the open file became: one moved or deleted
        during the run is left with the rows it holds, and a new file at the path takes the rest,
        said once; a path that became a folder (or a device) is an OSError naming it."""
        try:
            here = os.stat(self.path)
        except FileNotFoundError:
            here = None
        if here is not None and not stat.S_ISREG(here.st_mode):
            raise OSError(f"{self.path} is no longer a regular file: step {step}'s metrics cannot "
                          f"be written; move it out of the way (the checkpoint before this step "
                          f"resumes the run)")
        held = os.fstat(self._file.fileno())
        if here is not None and (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino):
            return
        self._file.close()
        self._file = open(self.path, "a", encoding="utf-8")
        print(f"warning: {self.path} was moved or deleted during the run; the rows of steps "
              f"{step} on go to a new {self.path}", file=sys.stderr)

    def summary(self) -> str | None:
        """One line saying what this run trained: steps, reward, seconds per step, where the
        metrics are; None when it trained nothing."""
        if not self.rows:
            return None
        first, last = self.rows[0]["step"], self.rows[-1]["step"]
        rewards = [r["reward"] for r in self.rows if isinstance(r.get("reward"), (int, float))]
        seconds = sum(r.get("time/step", 0.0) for r in self.rows)
        reward = (f", mean reward {sum(rewards) / len(rewards):.3g} (last {rewards[-1]:.3g})"
                  if rewards else "")
        where = f"; metrics in {self.path}" if self._file is not None else ""
        return (f"trained steps {first}–{last} of {self.total_steps} in {seconds:.0f} s "
                f"({seconds / len(self.rows):.3g} s/step){reward}{where}")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
