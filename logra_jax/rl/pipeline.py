"""The rollouts sampled ahead of the trainer under a lag η = ``rl.max_lag`` (docs/algorithm.md §9).

With η ≥ 1 step k trains on the rollout R_k sampled by the weights of version max(k − 1 − η, 0)
(version j: the weights after j updates). The schedule, not timing, fixes it: at the start of step
k the trainer holds version k − 1, which is the version R_{k+η} must be sampled by, so step k
first queues R_{k+η}'s sampling with the current weights, then trains on R_k, the oldest entry of
the queue. The sampler therefore always reads the newest weights it has (no old version is kept),
and the queue holds exactly η rollouts between steps: R_{k+1} … R_{k+η}, sampled by versions ≤ k − 1.

Those η rollouts are the whole of what the pipeline adds to a run's state. A checkpoint after
step k saves them (their arrays and rewards beside the weights, their versions in the meta), and a
resume trains on them as the uninterrupted run would have: the next rollout to sample, R_{k+η+1},
needs version k, the restored weights.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from logra_jax import host_arrays
from logra_jax.rl.policy import Sequences
from logra_jax.rl.rollout import Rollouts
from logra_jax.rl.sampler import decode_completions

# What a checkpoint's meta records of the queue (`RolloutQueue.meta`).
QUEUE_META = "queue"
# The arrays of one queued rollout a checkpoint holds, each [rows, ...].
ARRAYS = ("tokens", "segment_mask", "positions", "completion_mask", "rollout_logp", "completed",
          "token_steps", "rewards")


@dataclasses.dataclass
class Queued:
    """A rollout sampled and graded ahead of its step: ``version``, the number of updates of the
    weights that sampled it; ``rewards``, every row's (host, the same on every process)."""

    version: int
    rollouts: Rollouts
    rewards: np.ndarray

    def lag(self, trained_version: int) -> int:
        """Updates between the weights that sampled it and ``trained_version``, the ones it trains."""
        return trained_version - self.version


class RolloutQueue:
    """The rollouts sampled ahead, oldest first: at most ``lag`` between steps."""

    def __init__(self, lag: int):
        if lag < 1:
            raise ValueError(f"a rollout queue needs a lag >= 1, got {lag}")
        self.lag = lag
        self._items: collections.deque[Queued] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: Queued) -> None:
        if len(self._items) > self.lag:
            raise RuntimeError(f"the rollout queue holds {len(self._items)} rollouts, more than "
                               f"the lag {self.lag} allows")
        self._items.append(item)

    def pop(self) -> Queued:
        """The oldest rollout: the one this step trains on."""
        return self._items.popleft()

    # -- checkpointing ------------------------------------------------------------------------
    def arrays(self, sharding) -> tuple[dict[str, jax.Array], ...]:
        """The queued rollouts' arrays (`ARRAYS`) for a checkpoint's state, oldest first."""
        return tuple(_arrays_of(item, sharding) for item in self._items)

    def meta(self) -> dict:
        """The JSON a checkpoint records beside `arrays`: each rollout's version, and the arrays'
        shapes and dtypes (a resume's restore target), and the prompt window."""
        if not self._items:
            return {"versions": [], "prompt_length": 0, "arrays": {}}
        first = _arrays_of(self._items[0], None)
        return {"versions": [item.version for item in self._items],
                "prompt_length": int(self._items[0].rollouts.seqs.prompt_length),
                "arrays": {name: [list(np.shape(x)), str(x.dtype)] for name, x in first.items()}}

    @staticmethod
    def target(meta: dict, sharding) -> tuple[dict[str, jax.ShapeDtypeStruct], ...]:
        """The abstract arrays a checkpoint with ``meta`` (`RolloutQueue.meta`) restores onto,
        replicated over ``sharding``'s mesh (`restore` lays them out by rows)."""
        replicated = NamedSharding(sharding.mesh, PartitionSpec())
        one = {name: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=replicated)
               for name, (shape, dtype) in meta["arrays"].items()}
        return tuple(dict(one) for _ in meta["versions"])

    def restore(self, arrays, meta: dict, sharding, tokenizer, eos_ids) -> None:
        """Fills the queue from a checkpoint's ``arrays`` and ``meta``; the rows go to
        ``sharding`` (the trainer's batch layout) and this process's completions are decoded to
        text again (the sample log reads them)."""
        if len(meta["versions"]) != self.lag:
            raise ValueError(f"the checkpoint holds {len(meta['versions'])} queued rollouts, "
                             f"rl.max_lag={self.lag} needs {self.lag}")
        self._items.clear()
        for version, saved in zip(meta["versions"], arrays):
            placed = jax.device_put({k: v for k, v in saved.items() if k != "rewards"}, sharding)
            seqs = Sequences(tokens=placed["tokens"], segment_mask=placed["segment_mask"],
                             positions=placed["positions"],
                             completion_mask=placed["completion_mask"],
                             prompt_length=int(meta["prompt_length"]))
            rows = host_arrays.process_rows(sharding, seqs.tokens.shape[0])
            texts = decode_completions(tokenizer, host_arrays.local_rows(seqs.completions),
                                       host_arrays.local_rows(seqs.completion_mask), eos_ids)
            ro = Rollouts(seqs=seqs, rollout_logp=placed["rollout_logp"],
                          completed=placed["completed"], texts=texts, golds=[], rows=rows,
                          token_steps=placed["token_steps"])
            self._items.append(Queued(int(version), ro, host_arrays.to_host(saved["rewards"])))


def _arrays_of(item: Queued, sharding) -> dict:
    ro = item.rollouts
    rewards = item.rewards if sharding is None else jax.device_put(item.rewards, sharding)
    return dict(tokens=ro.seqs.tokens, segment_mask=ro.seqs.segment_mask,
                positions=ro.seqs.positions, completion_mask=ro.seqs.completion_mask,
                rollout_logp=ro.rollout_logp, completed=ro.completed, token_steps=ro.token_steps,
                rewards=rewards)
