"""Orbax checkpoints of a training run: array state (params, optimizer, PRNG) plus JSON metadata.

A checkpoint is two items: ``state``, any pytree of arrays restored onto the shardings of an
abstract target, and ``meta``, a JSON dict (step, data-iterator position, scalars of the RL loop).
Orbax writes to a temporary folder and renames on completion, so `latest_step` only ever sees
complete checkpoints; the last ``keep`` are kept.
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging


@contextlib.contextmanager
def _quiet():
    """Orbax logs a dozen INFO lines per save through absl; keep a training log readable."""
    level = logging.get_verbosity()
    logging.set_verbosity(min(level, logging.WARNING))  # absl: larger = more verbose
    try:
        yield
    finally:
        logging.set_verbosity(level)


class Checkpointer:
    """Saves and restores (state pytree, meta dict) under ``directory/<step>``."""

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 3):
        if keep < 1:
            raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
        self.directory = pathlib.Path(directory).absolute()
        # Synchronous saves: a step is only reported done once it is on disk, which is what resume
        # and the tests rely on; a save costs well under the step time of any real run.
        with _quiet():
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                     enable_async_checkpointing=False),
                item_names=("state", "meta"),
            )

    def latest_step(self) -> int | None:
        with _quiet():
            return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        with _quiet():
            self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                             meta=ocp.args.JsonSave(meta)))
            self._manager.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores onto the shapes, dtypes and shardings of ``abstract_state``.

        ``abstract_state`` may hold real arrays or `jax.ShapeDtypeStruct`s with shardings.
        """
        target = jax.tree.map(_abstract, abstract_state)
        with _quiet():
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        return restored["state"], dict(restored["meta"])

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """The params of a saved ``(params, opt_state)``, whatever optimizer state was saved with
        them (evaluating runs of several optimizers with one model), laid out like
        ``abstract_params``. The saved tree is read as saved, optimizer state included."""
        with _quiet():
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore()))
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
        with _quiet():
            self._manager.close()


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
