"""One run's hold on its workdir, from the lock to `close`: what the loop (rl/trainer.py) keeps there.

A `RunDir` owns the workdir's life during a run (the folder and its checks are rl/workdir.py's):

- it creates the workdir, checks that every process of the run was given the same config and
  workdir (`distributed.agree`), and holds the lock (process 0);
- it refuses a history the run cannot continue, or moves it aside (``--fresh``);
- it keeps the checkpoints: each saved with the loop's meta and the config's fingerprint, the
  newest intact one restored and checked (finite numbers, the loop's meta, the config);
- it writes config.json and opens the metrics writer;
- it keeps the record of the sampler's decode program: ``rl.decode_weights="auto"`` resolves at a
  fresh run's first rollout, and config.json and every checkpoint's fingerprint record the
  program that ran, which a resumed process runs again (the two programs round differently);
- on `close`, a run that trained no step takes back what it created: the workdir is as it was.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, NamedTuple

import ml_collections
from absl import logging

from logra_jax import checkpoint as checkpoint_lib
from logra_jax import config as config_lib
from logra_jax import distributed
from logra_jax import metrics as metrics_lib
from logra_jax.rl import pipeline as pipeline_lib
from logra_jax.rl import stopping
from logra_jax.rl import workdir as workdir_lib
from logra_jax.tree_paths import nonfinite_leaves

# What a checkpoint's meta holds beside the arrays: the step, REINFORCE's running baseline, the
# data position; and the fingerprint of the config that trained it (`config.fingerprint`), which a
# resume is checked against (checkpoints written before it was added have none).
LOOP_META = ("step", "baseline", "data")
CONFIG_META = "config"


class Restored(NamedTuple):
    """The newest intact checkpoint: its arrays (the restore target's tree), the loop's meta and
    the whole meta."""
    state: tuple
    step: int
    baseline: float
    data_state: Any
    meta: dict


def loop_meta(meta: dict, where: pathlib.Path) -> tuple[int, float, Any]:
    """(step, baseline, data state) of a checkpoint's meta; ValueError naming the checkpoint when
    any is missing (a checkpoint this loop did not write, or one edited by hand)."""
    missing = [key for key in LOOP_META if key not in meta]
    if missing:
        raise ValueError(f"checkpoint {where} has no {', '.join(missing)} in its meta (written by "
                         f"something other than this trainer, or edited); move it out of "
                         f"{where.parent} to resume from an earlier one")
    return meta["step"], meta["baseline"], meta["data"]


def check_finite(params, opt_state, where: pathlib.Path) -> None:
    """A restored state holds finite numbers only: a NaN carried into a resumed run diverged it
    three steps later, blamed on the learning rate, and was saved into another checkpoint."""
    bad = [f"params/{p}" for p in nonfinite_leaves(params)] + [
        f"opt_state/{p}" for p in nonfinite_leaves(opt_state)]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ValueError(f"checkpoint {where} holds NaN or infinite values in {bad[0]}{more}; "
                         f"nothing was written: move it aside to resume from an earlier "
                         f"checkpoint, or pass --fresh to set this run aside and start over")


def shared_config(config: ml_collections.ConfigDict) -> dict:
    """The config every process of a run must share: all of it but the process's own id."""
    flat = config_lib.flatten(config_lib.as_json(config))
    flat.pop("distributed.process_id", None)
    return flat


class RunDir:
    """A run's workdir from its creation to `close`. Construction creates the workdir (refusing a
    path no run can use), checks that every process holds the same config and workdir, and takes
    the lock (process 0); a failure there takes back the folders it created.

    The run then calls, in order: `open_history` (before its parts are built), `set_aside` (with
    ``--fresh``, once everything is built), `ready` (what the workdir holds now is the earlier
    run's); `restore`, `save`, `metrics_writer`, the decode-mode record and `close` as it trains."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | pathlib.Path):
        self.config = config
        self.fingerprint = config_lib.fingerprint(config)   # recorded in every checkpoint
        self._lock = self.ckpt = None
        self._history: workdir_lib.History | None = None
        self._present: set[str] | None = None   # the history entries there before this run
        self.trained = False      # a step of this run reached metrics.jsonl
        self.restored = False     # the run continues a checkpoint
        self.decode_mode: str | None = None    # the sampler's resolved decode program
        self._config_recorded = False
        self._created_root = workdir_lib.missing_root(workdir)   # the outermost folder created
        self.path = workdir_lib.make_folder(workdir)
        try:
            # Every process the same config and workdir, before anything is written there.
            self.agree("the start of the run", config=shared_config(config),
                       workdir=str(self.path.resolve()),
                       checkpoints=workdir_lib.checkpoint_steps(self.path))
            if distributed.is_primary():   # one lock per run, not per process
                self._lock = workdir_lib.WorkdirLock(self.path)
                self._lock.acquire()
        except BaseException:
            self.close()
            raise

    def agree(self, what: str, **facts) -> None:
        """Every process of a multi-process run holds the same ``facts``, or each stops with one
        line naming the difference (`distributed.agree`)."""
        distributed.agree(what, facts, self.config.distributed.initialization_timeout)

    # -- the history an earlier run left ----------------------------------------------------------
    def open_history(self, fresh: bool) -> None:
        """Refuses a run that cannot continue the workdir's history; ``fresh`` checks instead that
        the history can be moved aside whole (the move itself waits until the run is built); the
        checkpointer of the checkpoints it holds, if any."""
        if fresh:
            if distributed.is_primary():
                workdir_lib.check_set_aside(self.path)
            self._history = None
            return
        self._history = workdir_lib.History(self.path)
        if (self.path / workdir_lib.CHECKPOINTS).exists():
            self.ckpt = self._checkpointer()
        self._history.check_continues(self.config, self._recorded_configs())

    def set_aside(self) -> None:
        """--fresh, once the run is built: the earlier run moves into ``previous-<time>/``."""
        if distributed.is_primary():
            aside = workdir_lib.set_aside(self.path)
            if aside is not None:
                logging.info("--fresh: the earlier run of %s is now in %s", self.path, aside)
        distributed.barrier("workdir history set aside")

    def ready(self) -> None:
        """The run is built: what the workdir holds now is not this run's to take back."""
        self._present = workdir_lib.present(self.path)
        if self.ckpt is None:
            self.ckpt = self._checkpointer()

    def _recorded_configs(self) -> dict[int, dict | None]:
        """{step: the config fingerprint checkpoint ``step`` records (None: none)} of every
        checkpoint whose meta can be read; a damaged one is `restore`'s to set aside."""
        recorded = {}
        for step in self.ckpt.all_steps() if self.ckpt else []:
            try:
                meta = self.ckpt.read_meta(step)
            except Exception:  # noqa: BLE001  orbax raises many kinds for a damaged folder
                continue
            recorded[step] = meta.get(CONFIG_META)
        return recorded

    def _checkpointer(self) -> checkpoint_lib.Checkpointer:
        """The checkpoints' folder is created by the first save: a run that ends before it leaves
        none."""
        return checkpoint_lib.Checkpointer(self.path / workdir_lib.CHECKPOINTS,
                                           keep=self.config.checkpoint.keep)

    # -- checkpoints ------------------------------------------------------------------------------
    def queue_meta(self) -> dict | None:
        """What the newest checkpoint whose meta reads records of its queued rollouts (their
        shapes are a resume's restore target; every checkpoint of a run has the same); None
        without a checkpoint. The fingerprint (checked before) holds ``rl.max_lag``: a checkpoint
        of a run with another lag was refused by name already."""
        for step in sorted(self.ckpt.all_steps() if self.ckpt else [], reverse=True):
            try:
                meta = self.ckpt.read_meta(step)
            except Exception:  # noqa: BLE001  a damaged one is restore_latest's to set aside
                continue
            if pipeline_lib.QUEUE_META not in meta:
                raise ValueError(f"checkpoint {self.ckpt.directory / str(step)} holds no queued "
                                 f"rollouts, which rl.max_lag={self.config.rl.max_lag} needs "
                                 f"(written by a run without a lag)")
            return meta[pipeline_lib.QUEUE_META]
        return None

    def restore(self, state: tuple) -> Restored | None:
        """The newest intact checkpoint restored into ``state``'s tree ((params, opt_state, …)),
        checked: finite numbers, the loop's meta, a config that continues it. None without one."""
        latest = self.ckpt.restore_latest(state)
        if latest is None:
            return None
        saved, state, meta = latest
        self.restored = True
        where = self.ckpt.directory / str(saved)
        check_finite(state[0], state[1], where)
        step, baseline, data_state = loop_meta(meta, where)
        # History checked every readable checkpoint; this is the one restored, read whole.
        workdir_lib.check_checkpoint_config(meta.get(CONFIG_META), where, self.config)
        return Restored(tuple(state), step, baseline, data_state, meta)

    def save(self, step: int, state: tuple, baseline: float, data_state, extra_meta: dict) -> None:
        """Checkpoint ``step``: ``state``'s arrays, the loop's meta, the config's fingerprint (with
        the decode program that ran) and ``extra_meta``."""
        meta = {**dict(zip(LOOP_META, (step, baseline, data_state))),
                CONFIG_META: self.fingerprint, **extra_meta}
        self.ckpt.save(step, state, meta)

    # -- config.json and the decode program it records --------------------------------------------
    def keep_decode_mode(self, meta: dict, sampler) -> None:
        """A resumed run samples with the decode program its first process picked (recorded by the
        restored checkpoint's ``meta``, else by config.json), without timing the two again, when
        ``rl.decode_weights`` is "auto"; a fixed mode that differs is the user's choice, said
        once."""
        recorded = (config_lib.recorded_decode_mode(meta.get(CONFIG_META))
                    or config_lib.recorded_decode_mode(self._history and self._history.config))
        if recorded is None:
            return
        asked = self.config.rl.decode_weights
        if asked == "auto":
            sampler.preset_decode_mode(recorded)
            self.decode_mode = recorded
            self.fingerprint[config_lib.DECODE_KEY] = recorded
        elif asked != recorded:
            logging.warning("rl.decode_weights=%s, but this run's earlier steps sampled with %s: "
                            "the two programs round differently, so the resumed steps will not be "
                            "the bits an uninterrupted run computes", asked, recorded)

    def note_decode_mode(self, sampler) -> None:
        """After a rollout: the decode program the sampler ran, recorded once (a fresh run's
        "auto" resolves at its first rollout)."""
        if self.decode_mode is not None:
            return
        self.decode_mode = getattr(sampler, "last_decode_mode", None)
        if self.decode_mode is not None:
            self.fingerprint[config_lib.DECODE_KEY] = self.decode_mode

    def resumed(self) -> None:
        """A resume keeps the config.json it started with (History checked that only keys a resume
        may change differ); one whose config.json was lost writes it again, from this config."""
        self._config_recorded = (self.path / workdir_lib.CONFIG).exists()
        self.record_config()

    def record_config(self) -> None:
        """Writes config.json (process 0) unless the workdir holds this run's already: the config,
        with ``rl.decode_weights`` as the sampler resolved it."""
        if self._config_recorded or not distributed.is_primary():
            return
        recorded = config_lib.as_json(self.config)
        if self.decode_mode is not None:
            recorded["rl"]["decode_weights"] = self.decode_mode
        workdir_lib.write_config(self.path, recorded)
        self._config_recorded = True

    # -- metrics ----------------------------------------------------------------------------------
    def metrics_writer(self, start_step: int, kl_measured: bool) -> metrics_lib.MetricsWriter:
        """The writer of metrics.jsonl (process 0), TensorBoard and the progress line, from
        ``start_step`` to ``max_steps``."""
        log = self.config.log
        return metrics_lib.MetricsWriter(self.path, total_steps=self.config.max_steps,
                                         start_step=start_step, tensorboard=log.tensorboard,
                                         progress=log.progress, files=distributed.is_primary(),
                                         kl_measured=kl_measured)

    def forget_steps_without_checkpoint(self) -> None:
        """After a failed step, when no checkpoint holds any of this run's steps (a fresh run
        that failed before its first save): its metrics rows describe weights that are gone, and
        rows without a checkpoint make the workdir refuse the same command. They are dropped, so
        `close` takes back what the run created (config.json, tensorboard/) and the workdir is as
        the run found it; the same command then starts again. With a checkpoint the workdir
        already resumes (a resume replaces the rows after it) and the rows stay, a diverged
        step's included, for the record."""
        if self.restored or not distributed.is_primary() or self.ckpt is None:
            return
        if self.ckpt.latest_step() is not None:
            return
        path = self.path / workdir_lib.METRICS
        if path.exists() and not path.is_symlink() and path.stat().st_size:
            with stopping.critical():
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text("", encoding="utf-8")
                os.replace(tmp, path)
        self.trained = False

    def close(self) -> None:
        """Closes the checkpointer and releases the workdir (idempotent). A run that trained no
        step takes back what it created there: the workdir is as it found it."""
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None
        unused = not self.trained and not self.restored
        if unused and distributed.is_primary() and self._present is not None:
            workdir_lib.remove_unused(self.path, self._present)
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        # Every process takes back the folders it created while they are empty (a process given
        # another --workdir created its own).
        if unused:
            workdir_lib.remove_created(self.path, self._created_root)
