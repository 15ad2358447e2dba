"""Deterministic, resumable batches of Examples.

Epoch e visits the source in the order ``numpy.random.default_rng([seed, e]).permutation(n)``
(identity order when ``shuffle=False``). A batch that runs past the end of an epoch continues with
the next epoch's order, so every example is seen once per epoch and no batch is short. The whole
position is (epoch, index into that epoch's order): two integers that go into a checkpoint as JSON,
and restoring them continues with exactly the batches an uninterrupted run would have drawn.
"""

from __future__ import annotations

import numpy as np

from logra_jax.data.example import Example, ExampleSource


class PromptIterator:
    """Endless batches of ``batch_size`` Examples from ``source``; ``state()``/``restore()`` resume."""

    def __init__(self, source: ExampleSource, *, batch_size: int, seed: int, shuffle: bool = True):
        if len(source) == 0:
            raise ValueError(f"source {source!r} is empty: nothing to iterate over")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.source = source
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.source)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next(self) -> list[Example]:
        """The next ``batch_size`` Examples (crossing into the next epoch when needed)."""
        batch = []
        while len(batch) < self.batch_size:
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
            take = min(self.batch_size - len(batch), len(self._order) - self._position)
            indices = self._order[self._position:self._position + take]
            batch.extend(self.source[int(i)] for i in indices)
            self._position += take
        return batch

    __next__ = next

    def __iter__(self) -> PromptIterator:
        return self

    def state(self) -> dict[str, int]:
        """Where the next batch starts: {"epoch": e, "position": p}, JSON-serialisable."""
        return {"epoch": self._epoch, "position": self._position}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a ``state()``; the same source, seed and shuffle must be used."""
        if not isinstance(state, dict) or set(state) != {"epoch", "position"}:
            raise ValueError(f"iterator state must be a dict with keys 'epoch' and 'position', "
                             f"got {state!r}")
        epoch, position = state["epoch"], state["position"]
        # Checkpoint libraries may hand back numpy integers.
        epoch = int(epoch) if isinstance(epoch, (int, np.integer)) else epoch
        position = int(position) if isinstance(position, (int, np.integer)) else position
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"iterator state epoch must be an int >= 0, got {epoch!r}")
        if not isinstance(position, int) or not 0 <= position <= len(self.source):
            raise ValueError(f"iterator state position must be an int in [0, {len(self.source)}] "
                             f"(the source's size), got {position!r}")
        self._epoch = epoch
        self._position = position
        self._order = self._epoch_order(epoch)
