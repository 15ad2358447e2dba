"""Host values and global arrays when a process holds only some of the shards.

With one process every array is fully addressable and these are plain ``device_put`` / ``np.asarray``.
With several (logra_jax/distributed.py) an array on the global mesh is split between processes, and
each of them may touch only the shards on its own devices:

- a batch is built from each process's own rows (`process_rows`, `from_process_rows`) and read back
  the same way (`local_rows`): rows of a batch sharded over the mesh are contiguous per process,
  because the mesh lists devices process by process;
- a value every process needs whole (rewards for group advantages, metrics) is gathered
  (`to_host`), which for one process is a copy to the host;
- a tree kept on the host for later (the run's initial weights) keeps only the local shards
  (`HostShards`): a 70B model is not copied whole into every host's memory.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _row_range(index: tuple, rows: int) -> tuple[int, int]:
    first = index[0] if index else slice(None)
    start, stop, _ = first.indices(rows)
    return start, stop


def process_rows(sharding: jax.sharding.Sharding, rows: int) -> slice:
    """The rows of a ``rows``-row batch laid out by ``sharding`` that this process's devices hold:
    one contiguous range (all rows when the batch is replicated)."""
    ranges = sorted({_row_range(index, rows)
                     for index in sharding.addressable_devices_indices_map((rows,)).values()})
    start, stop = ranges[0]
    for a, b in ranges[1:]:
        if a > stop:
            raise ValueError(f"this process holds rows {ranges} of the batch, not one contiguous "
                             f"range: the mesh must list each process's devices together")
        stop = max(stop, b)
    return slice(start, stop)


def from_process_rows(local: Any, sharding: jax.sharding.Sharding, rows: int) -> Any:
    """Global arrays of ``rows`` rows from this process's rows ``local`` (a tree of host arrays,
    each the `process_rows` slice of the whole)."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x),
                                                         (rows,) + np.shape(x)[1:]), local)


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of the batch-sharded array ``x`` (all of them with one process)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    pieces = {}
    for shard in x.addressable_shards:
        pieces.setdefault(_row_range(shard.index, x.shape[0]), shard)
    ordered = [pieces[key] for key in sorted(pieces)]
    # A shard may also be split along other dims; rows are what this reads, so those must be whole.
    if any(any(s != slice(None) and s.indices(n) != (0, n, 1)
               for s, n in zip(shard.index[1:], x.shape[1:])) for shard in ordered):
        raise ValueError(f"local_rows: {x.sharding} splits more than the rows of a {x.shape} array")
    return np.concatenate([np.asarray(shard.data) for shard in ordered])


def to_host(tree: Any) -> Any:
    """The whole value of every array in ``tree`` as numpy, on every process (gathered from the
    others when this one holds only some shards)."""
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree.map(one, tree)


def _key(index: tuple) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


class HostShards:
    """The local shards of a tree of arrays, copied to host memory, and `to_devices` to put them
    back: ``jax.device_get`` for a process that holds everything, and what a process of several
    can keep (it may not even read the others' shards)."""

    def __init__(self, tree: Any):
        self._treedef = jax.tree.structure(tree)
        self._leaves = []
        for x in jax.tree.leaves(tree):
            shards = {}
            for shard in x.addressable_shards:
                shards.setdefault(_key(shard.index), shard)  # a replicated shard is kept once
            self._leaves.append((x.shape, x.sharding,
                                 {k: np.asarray(s.data) for k, s in shards.items()}))

    def to_devices(self, shardings: Any = None) -> Any:
        """The arrays again, on their original shardings (or on ``shardings`` of the same layout)."""
        targets = (jax.tree.leaves(shardings) if shardings is not None
                   else [sharding for _, sharding, _ in self._leaves])
        leaves = [jax.make_array_from_callback(shape, target, lambda index, d=data: d[_key(index)])
                  for (shape, _, data), target in zip(self._leaves, targets)]
        return jax.tree.unflatten(self._treedef, leaves)

    def to_numpy(self) -> Any:
        """The whole tree as numpy, assembled from the shards; only where this process holds all
        of them (one process: tests and tools read the initial weights this way)."""
        out = []
        for shape, sharding, data in self._leaves:
            if not sharding.is_fully_addressable:
                raise ValueError("HostShards.to_numpy: this process holds only some shards")
            first = next(iter(data.values()))
            whole = np.empty(shape, first.dtype)
            for key, piece in data.items():
                whole[tuple(slice(*k) for k in key)] = piece
            out.append(whole)
        return jax.tree.unflatten(self._treedef, out)
