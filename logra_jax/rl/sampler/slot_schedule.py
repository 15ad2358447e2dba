"""The slot engine's schedule, replayed on the host from the completion lengths alone.

`slots.generate_in_slots` decides inside its program which row runs in which slot at which step;
what it executes depends only on each row's length (the tokens it keeps, its EOS or its cap
included), the group size and the slot counts. This replays those decisions in numpy, step by
step, as the program takes them:

- the admission loop: while a group waits, free the places of ended rows (`release`), admit the
  waiting groups that fit (G free decode slots and a free prompt slot, lowest slots first), then
  run every slot for one chunk (``refill_every`` steps: `slots.REFILL_EVERY` on a GPU, 1
  elsewhere);
- the tail: once no group waits, chunks of every slot while more rows live than the next smaller
  power of two holds; then the live rows move to the first slots (`compact`, stable) and the
  executed size halves, down to 1.

A row of length L draws its first token from its group's prefill and L − 1 more in decode steps;
it stops after the step that draws its last token, and its slot idles to the chunk's end. A
step of slot s writes its column cₛ and attends to columns 0 … cₛ of its own completion (a slot
that has ended keeps its last column). So `launch.cost` can count a rollout's steps at each
executed size, and the completion columns they read, without running it; a test checks the
replay against the engine's own ``token_steps``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from logra_jax.rl.sampler.slots import check_slots, executed_sizes


@dataclasses.dataclass(frozen=True)
class SlotSchedule:
    """What the slot engine runs for one rollout."""

    sizes: tuple[int, ...]           # the executed sizes, largest (every slot) first
    admission_trips: int             # trips of the admission loop, each one chunk of every slot
    tail_trips: dict[int, int]       # executed size → trips (chunks) of its tail loop
    refill_every: int                # decode steps per chunk
    groups: int                      # groups admitted, one prefill each
    token_steps: np.ndarray          # per row, as `SampleOutput.token_steps`
    columns_read: dict[int, int]     # executed size → Σ over its steps and slots of the
                                     # completion columns a slot attends to (its column + 1)

    @property
    def steps(self) -> dict[int, int]:
        """Executed size → decode steps (forward passes) run at that size."""
        out = {n: trips * self.refill_every for n, trips in self.tail_trips.items()}
        out[self.sizes[0]] += self.admission_trips * self.refill_every
        return out

    @property
    def row_steps(self) -> int:
        """Row-steps executed: each row's draw from its prefill, and n per step of size n
        (slots holding no live row included)."""
        return len(self.token_steps) + sum(n * k for n, k in self.steps.items())


def replay(lengths, *, group_size: int, slots: int, prompt_slots: int,
           refill_every: int) -> SlotSchedule:
    """The schedule `slots.generate_in_slots` runs for rows of completion ``lengths`` (each ≥ 1;
    groups of ``group_size`` adjacent rows) through ``slots`` decode slots and ``prompt_slots``
    prompt slots, ``refill_every`` steps per chunk."""
    lengths = np.asarray(lengths, np.int64)
    batch = lengths.size
    check_slots(batch, group_size, slots, prompt_slots)
    if lengths.min() < 1:
        raise ValueError(f"completion lengths must be ≥ 1, got {lengths.min()}")
    groups = batch // group_size
    row = np.full(slots, batch)                    # batch: a slot no row has held
    live = np.zeros(slots, bool)
    column = np.zeros(slots, np.int64)             # the column of each slot's last drawn token
    members = np.full((prompt_slots, group_size), slots)   # slots: none
    token_steps = np.zeros(batch, np.int64)
    next_group = 0
    columns_read: dict[int, int] = {}

    def release():
        held = np.append(live, False)[members]
        members[~held] = slots

    def chunk(n):
        for _ in range(refill_every):
            held = row[:n] < batch
            np.add.at(token_steps, row[:n][held], 1)
            columns_read[n] = columns_read.get(n, 0) + int(np.sum(column[:n] + 1))
            going = live[:n].copy()
            column[:n][going] += 1
            ends = going & (column[:n] + 1 >= lengths[np.minimum(row[:n], batch - 1)])
            live[:n][ends] = False

    admission_trips = 0
    while next_group < groups:
        release()
        while (next_group < groups and np.sum(~live) >= group_size
               and np.any(np.all(members == slots, axis=1))):
            q = int(np.argmax(np.all(members == slots, axis=1)))
            free = np.argsort(live, kind="stable")[:group_size]
            rows = next_group * group_size + np.arange(group_size)
            ended = lengths[rows] <= 1
            members[q] = np.where(ended, slots, free)
            row[free], live[free], column[free] = rows, ~ended, 0
            token_steps[rows] = 1
            next_group += 1
        chunk(slots)
        admission_trips += 1

    sizes = executed_sizes(slots)
    tail_trips = {}
    for i, size in enumerate(sizes):
        smaller = sizes[i + 1] if i + 1 < len(sizes) else 0
        if size < slots:   # compact: the live rows to the first slots, stable
            release()
            order = np.argsort(~live, kind="stable")
            new_id = np.zeros(slots + 1, np.int64)
            new_id[order] = np.arange(slots)
            new_id[slots] = slots
            members[:] = new_id[members]
            row[:], live[:], column[:] = row[order], live[order], column[order]
        trips = 0
        while np.sum(live) > smaller:
            chunk(size)
            trips += 1
        tail_trips[size] = trips
    return SlotSchedule(sizes, admission_trips, tail_trips, refill_every, groups, token_steps,
                        columns_read)
