"""Orbax checkpoints of a training run: array state (params, optimizer, PRNG) plus JSON metadata.

A checkpoint is two items: ``state``, any pytree of arrays restored onto the shardings of an
abstract target, and ``meta``, a JSON dict (step, data-iterator position, scalars of the RL loop).
With several processes every one of them calls save and restore: orbax writes each shard from the
process that holds it and the JSON from process 0, so the workdir must be on a shared filesystem.
Orbax writes to a temporary folder and renames on completion, so `latest_step` only ever sees
complete checkpoints; the last ``keep`` are kept. A checkpoint damaged afterwards (a truncated or
deleted file) is set aside by `restore_latest`, which resumes from the newest one that restores.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from logra_jax import distributed


@contextlib.contextmanager
def _quiet(most_verbose: int = logging.WARNING):
    """Orbax logs a dozen INFO lines per save through absl; keep a training log readable.

    Afterwards both levels absl's verbosity may have moved come back, since either can be the one
    in effect: under ``app.run`` the root logger's (absl's own logger left unset), elsewhere absl's
    logger's. Restoring only one would leave the other pinned: an explicit level on absl's logger
    where it had none hides every later INFO line of the process, and a root left at WARNING under
    ``app.run`` hides the run's own INFO lines ("resumed from ...")."""
    absl_logger = logging.get_absl_logger()
    own_level, verbosity = absl_logger.level, logging.get_verbosity()
    logging.set_verbosity(min(verbosity, most_verbose))  # absl: larger = more verbose
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        absl_logger.setLevel(own_level)


class Checkpointer:
    """Saves and restores (state pytree, meta dict) under ``directory/<step>``. The folder is
    created by the first save: a run that ends before it leaves none."""

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 3):
        if keep < 1:
            raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
        self.directory = pathlib.Path(directory).absolute()
        self._keep = keep
        self._opened = None
        if self.directory.exists():
            self._manager   # noqa: B018  reads the checkpoints there now, as orbax does

    @property
    def _manager(self) -> ocp.CheckpointManager:
        """Orbax's manager of the folder (creating it)."""
        if self._opened is None:
            # Synchronous saves: a step is only reported done once it is on disk, which is what
            # resume and the tests rely on; a save costs well under the step time of any real run.
            with _quiet():
                self._opened = ocp.CheckpointManager(
                    self.directory,
                    options=ocp.CheckpointManagerOptions(max_to_keep=self._keep, create=True,
                                                         enable_async_checkpointing=False),
                    item_names=("state", "meta"),
                )
        return self._opened

    def latest_step(self) -> int | None:
        if self._opened is None:
            return None
        with _quiet():
            return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return [] if self._opened is None else list(self._manager.all_steps())

    def read_meta(self, step: int) -> dict:
        """The JSON meta of checkpoint ``step`` alone (no arrays read: a resume checks it before
        the model is built); raises whatever orbax raises for a folder it cannot read."""
        with _quiet(logging.FATAL):
            restored = self._manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Writes checkpoint ``step``; a failed write (a full disk, a file size limit, a folder
        made unwritable) is an OSError naming the folder, whatever orbax raised."""
        try:
            # A failed write is logged by each of orbax's writer threads with its traceback (23
            # of them for one file size limit); the OSError below carries the reason once.
            with _quiet(logging.FATAL):
                self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                                 meta=ocp.args.JsonSave(meta)))
                self._manager.wait_until_finished()
        except Exception as e:  # orbax wraps the OSError of its writer threads in several kinds
            raise OSError(f"checkpoint {step} could not be written to {self.directory}: "
                          f"{failure_reason(e)}") from e

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores onto the shapes, dtypes and shardings of ``abstract_state``.

        ``abstract_state`` may hold real arrays or `jax.ShapeDtypeStruct`s with shardings.
        """
        target = jax.tree.map(_abstract, abstract_state)
        with _quiet():
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        return restored["state"], dict(restored["meta"])

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """(step, state, meta) of the newest checkpoint that restores; None when there is none.

        A newer one that fails while an older one restores is damaged, not of another run: it is
        renamed ``<step>.damaged`` (kept for inspection, out of orbax's way) with a warning naming
        it. When every checkpoint fails — a config that changed the state's structure, say —
        nothing is renamed and ValueError names the newest and why it failed.
        """
        failures = []
        for step in sorted(self.all_steps(), reverse=True):
            torn = self._torn_metadata(step)
            if torn is not None:   # orbax is not asked: see _torn_metadata
                failures.append((step, torn))
                continue
            try:
                # Orbax logs the failure of a damaged folder itself; the warning or error below
                # says the same, naming the checkpoint.
                _drop_abandoned_reads()
                with _quiet(logging.FATAL):
                    state, meta = self.restore(step, abstract_state)
            except Exception as e:  # orbax raises many kinds of error for a damaged folder
                failures.append((step, self._damage(step, e)))
                continue
            for bad, reason in failures:
                aside = self.directory / f"{bad}.damaged"
                if jax.process_index() == 0:  # one process renames; the others wait for it
                    (self.directory / str(bad)).rename(aside)
                logging.warning("checkpoint %d cannot be restored (%s); moved to %s, resuming from "
                                "checkpoint %d", bad, reason, aside, step)
            if failures:
                distributed.barrier("checkpoint damaged set aside")
                with _quiet():
                    self._manager.reload()
            return step, state, meta
        if failures:
            step, reason = failures[0]
            which = ("it is the only one" if len(failures) == 1 else
                     f"checkpoints {', '.join(str(s) for s, _ in failures[1:])} fail too")
            raise ValueError(f"no checkpoint in {self.directory} can be restored (newest: step "
                             f"{step}: {reason}; {which}): where a file is damaged, pass --fresh "
                             f"to set this run aside and start over; where the config changed "
                             f"since they were written, resume with the original config")
        return None

    def _torn_metadata(self, step: int) -> str | None:
        """"<file> is not valid JSON: <why>" for the first metadata file of checkpoint ``step``
        that a restore needs and cannot parse (a write cut short), else None. Checked before orbax
        restores: its restore of such a folder fails after starting every array's read, and the
        reads it drops then print "Event loop is closed" tracebacks whenever they are collected."""
        folder = self.directory / str(step)
        for path in sorted(folder.rglob("*")):
            if path.is_file() and _needed_json(path):
                try:
                    json.loads(path.read_bytes())
                except ValueError as e:
                    return f"{path} is not valid JSON: {e}"
        return None

    def _damage(self, step: int, error: BaseException) -> str:
        """Why checkpoint ``step`` does not restore, naming the file where the error does not: a
        JSON metadata file cut short fails with a bare "Expecting value: line 1 column 144"."""
        reason = failure_reason(error)
        for path in sorted((self.directory / str(step)).rglob("*")):
            if (path.name in _JSON_FILES or _needed_json(path)) and path.is_file() \
                    and str(path) not in reason:
                try:
                    json.loads(path.read_bytes())
                except ValueError:
                    reason = f"{path} is not valid JSON: {reason}"
        return reason

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """The params of a saved ``(params, opt_state)``, whatever optimizer state was saved with
        them (evaluating runs of several optimizers with one model), laid out like
        ``abstract_params``. The saved tree is read as saved, optimizer state included; one saved
        on other devices (another mesh, or the processes of a multi-host run) is read into host
        memory first (the CPU device), then placed."""
        host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        with _quiet():
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(fallback_sharding=host)))
        state = restored["state"]
        if not isinstance(state, (list, tuple)) or len(state) != 2:
            raise ValueError(f"{self.directory} step {step} does not hold (params, opt_state)")
        params = state[0]
        want, got = jax.tree.structure(abstract_params), jax.tree.structure(params)
        if want != got:
            raise ValueError(f"{self.directory} step {step}: the saved params do not match this "
                             f"model's ({got.num_leaves} vs {want.num_leaves} leaves)")
        for x, ref in zip(jax.tree.leaves(params), jax.tree.leaves(abstract_params)):
            if x.shape != ref.shape or x.dtype != ref.dtype:
                raise ValueError(f"{self.directory} step {step}: a saved param is {x.dtype}{x.shape}, "
                                 f"this model's is {ref.dtype}{ref.shape}")
        return jax.device_put(params, jax.tree.map(lambda x: x.sharding, abstract_params))

    def close(self) -> None:
        if self._opened is not None:
            with _quiet():
                self._opened.close()
            self._opened = None


# The JSON files orbax writes into a checkpoint folder (its own metadata and our meta item).
_JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "metadata", "_sharding")


def _needed_json(path: pathlib.Path) -> bool:
    """A JSON file a restore cannot do without: the arrays' ``_METADATA`` and per-process
    ``array_metadatas/``, and our ``meta`` item (orbax restores without ``_CHECKPOINT_METADATA``
    and ``_sharding``)."""
    return path.name in ("_METADATA", "metadata") or path.parent.name == "array_metadatas"


def _abandoned_read(unraisable) -> bool:
    """An "exception ignored" that a failed restore leaves behind: orbax reads every array in
    coroutines on an event loop of its own; when one read fails it closes the loop, and each read
    still in flight is reported when it finishes ("Event loop is closed") or when its coroutine is
    collected — seconds later, anywhere in the process, dozens of tracebacks."""
    error, source = unraisable.exc_value, unraisable.object
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    code = getattr(source, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def _drop_abandoned_reads() -> None:
    """From a restore on, the process drops `_abandoned_read` reports (one can come while the
    restore is still failing, from orbax's reader thread): the failure itself is said once, by the
    warning or the error that names the checkpoint. Every other report goes to the hook that was
    in place."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_abandoned_reads", False):
        return

    def hook(unraisable):
        if not _abandoned_read(unraisable):
            previous(unraisable)
    hook.drops_abandoned_reads = True
    sys.unraisablehook = hook


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and what caused it, outermost first."""
    chain = [error]
    while len(chain) < 32 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    return chain


# Tensorstore's bracketed appendices to a message: the spec of the store it opened (hundreds of
# characters of JSON, twice) and the C++ source locations. The reason comes before them.
_APPENDIX = re.compile(r"\s*\[(?:tensorstore_spec(?:\[\d+\])?|source locations)='.*?'\]", re.DOTALL)


def _shorten(text: str, most: int = 400) -> str:
    """``text`` for one line: without tensorstore's appendices, then, if still longer than
    ``most``, its start (the status) and its end kept: tensorstore nests "Error opening …: Error
    reading …:" contexts, each naming a path, before the reason, which comes last."""
    text = " ".join(_APPENDIX.sub("", text).split())
    head = most // 4
    return text if len(text) <= most else f"{text[:head]} … {text[-(most - head):]}"


def failure_reason(error: BaseException) -> str:
    """What went wrong, for one line: the OS's reason first when there is one ("File too large",
    from an OSError in the chain or tensorstore's ``os_error_code``), then the innermost error's
    message — tensorstore's names the file or database and what it found — shortened in the
    middle (its outer wrappers add a page of TensorStore spec and nothing else)."""
    chain = _chain(error)
    os_reason = next((f"{x.strerror}" for x in chain if isinstance(x, OSError) and x.strerror),
                     None)
    if os_reason is None:
        code = next((m for x in chain for m in re.findall(r"os_error_code='?(\d+)", str(x))), None)
        os_reason = os.strerror(int(code)) if code else None
    # The innermost error that says something (not a bare index or key raised in passing).
    root = next((x for x in reversed(chain) if len(str(x).split()) > 2), error)
    detail = _shorten(str(root)) or type(root).__name__
    return f"{os_reason} ({detail})" if os_reason and os_reason not in detail[:80] else detail


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
