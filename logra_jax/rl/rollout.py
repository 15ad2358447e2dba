"""Rollouts: completions sampled (`collect_rollouts` with a `RolloutSpec`) and graded (`Grader`),
and the weights the sampler uses (docs/algorithm.md §7–8).

The loop sees one small interface for where rollouts come from, so it does not branch on the sync
mode. `RolloutSource` gives the weights to sample with and the batch's placement, and hears about
every update (``after_update``). Two kinds, picked by `rollout_source`:

- `SharedWeights` (``sync.mode="off"``): the sampler reads the trainer's own params, no copy.
- `SyncedEngine` (``full`` | ``factors`` | ``sparse``): a `sync.RolloutEngine` on its own devices
  (or the trainer's, colocated), kept in step by `sync.SyncSender` messages after every update.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from logra_jax import host_arrays
from logra_jax.data import SubsetSource, format_prompt
from logra_jax.rl import rewards, sync
from logra_jax.rl.policy import Sequences
from logra_jax.rl.sampler import Sampler, decode_completions, pad_prompts
from logra_jax.rl.update import CompactUpdate


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """How prompts become rollouts: the group size, the prompt window, sampling and prompt text."""

    num_generations: int
    max_prompt_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    system_prompt: str | None = None
    instruction: str | None = None


# A reward function: the step's completions and their reference answers → one reward each.
RewardFunction = Callable[[list[str], list[str]], Sequence[float]]


class RewardError(ValueError):
    """A reward function raised, or returned other than one finite number per completion. Its
    message names the function and the task; the loop adds the step (`trainer.Run.loop`)."""


@dataclasses.dataclass(frozen=True)
class Grader:
    """Outcome reward per completion (docs/algorithm.md §7), plus an optional format reward:
    the weighted sum of `functions`' rewards.

    failure_reward: what a wrong answer earns (the KL variant's REINFORCE: −0.01; GRPO: 0).
    task: where the prompts come from, as the config says it (``data.task=chain_sum``), named
    when a reward function fails.

    Each function's output is checked before it is added: one finite number per completion. A
    function that raises, returns a list of another length, or NaN / ±inf is a `RewardError`
    naming it and the task — never a reward the advantages would silently mask, nor a shape
    error deep in the batch's assembly.
    """

    failure_reward: float = 0.0
    format_reward_weight: float = 0.0
    task: str = "the prompts"

    def functions(self) -> list[tuple[str, float, RewardFunction]]:
        """(name, weight, function) of each reward term; a subclass may add its own."""
        def math(texts, golds):
            return [rewards.math_reward(t, g, failure_reward=self.failure_reward)
                    for t, g in zip(texts, golds)]

        def form(texts, golds):
            del golds
            return [rewards.format_reward(t) for t in texts]

        terms = [("rewards.math_reward", 1.0, math)]
        if self.format_reward_weight:
            terms.append(("rewards.format_reward", self.format_reward_weight, form))
        return terms

    def __call__(self, texts: list[str], golds: list[str]) -> np.ndarray:
        total = np.zeros(len(texts), np.float32)
        for name, weight, function in self.functions():
            total += weight * self._checked(name, function, texts, golds)
        return total

    def _checked(self, name: str, function: RewardFunction, texts: list[str],
                 golds: list[str]) -> np.ndarray:
        who = f"reward function {name} on {self.task}"
        try:
            scores = function(texts, golds)
            r = np.asarray(scores, np.float64)
        except Exception as e:   # the user's code: its exception, named, without a traceback
            said = " ".join(str(e).split("\n")) or "(no message)"
            raise RewardError(f"{who} raised {type(e).__name__}: {said}") from e
        if r.shape != (len(texts),):
            raise RewardError(f"{who} returned rewards of shape {r.shape} for {len(texts)} "
                              f"completions: it must return one number per completion, shape "
                              f"({len(texts)},)")
        bad = np.flatnonzero(~np.isfinite(r))
        if bad.size:
            i = int(bad[0])
            raise RewardError(f"{who} returned {r[i]} for {bad.size} of {len(texts)} completions "
                              f"(the first, row {i}: {texts[i][:60]!r}, answer {golds[i]!r}); a "
                              f"reward must be a finite number")
        return r.astype(np.float32)


@dataclasses.dataclass
class Rollouts:
    """A step's completions: the arrays are global (every row, on the mesh); ``texts`` and
    ``golds`` are this process's ``rows`` only, which is all of them with one process.
    ``token_steps``: the sampler's count of the steps each row's pass ran (`SampleOutput`)."""

    seqs: Sequences
    rollout_logp: jax.Array
    completed: jax.Array
    texts: list[str]
    golds: list[str]
    rows: slice
    token_steps: jax.Array


def work_metrics(completion_mask: np.ndarray, token_steps: np.ndarray,
                 prefill_tokens: int) -> dict[str, float]:
    """What a rollout's sampling spent against what it kept, every row's (host arrays):

    - ``rollout/kept_tokens``: completion tokens kept, Σ mask (each row's up to and including EOS);
    - ``rollout/decode_row_steps``: row-steps the decode executed, Σ token_steps: for each pass,
      its rows × the token steps it ran (`SampleOutput.token_steps`: one draw per row and step,
      the first from the prefill's logits, each later one after a forward pass), passes summed;
    - ``rollout/efficiency`` = kept / executed: 1 when every executed row-step drew a kept
      token; a static pass runs every row until its longest ends, and a GPU to the end of a
      16-step chunk;
    - ``rollout/prefill_tokens``: prompt tokens prefilled, the sampler's prefilled rows × the
      left-padded window (`Sampler.prefilled_rows`): the static engine prefills every row, its
      group's prompt G times over; the slot engine each group once.
    """
    kept = int(np.sum(completion_mask))
    executed = int(np.sum(token_steps))
    return {"rollout/kept_tokens": kept, "rollout/decode_row_steps": executed,
            "rollout/efficiency": kept / executed,
            "rollout/prefill_tokens": int(prefill_tokens)}


def prompt_text(example, tokenizer, spec: RolloutSpec) -> str:
    """``example``'s chat-formatted prompt, as the sampler receives it."""
    return format_prompt(example["question"], tokenizer, system_prompt=spec.system_prompt,
                         instruction=spec.instruction)


def fit_prompt_window(source, tokenizer, spec: RolloutSpec, *, skip_long: bool):
    """``source``, checked before anything is compiled: every prompt must fit the
    ``max_prompt_length`` window. One that does not is an error naming the key, or, with
    ``skip_long`` (verl's filter_overlong_prompts), left out of a `SubsetSource` of the rest."""
    texts = [prompt_text(source[i], tokenizer, spec) for i in range(len(source))]
    lengths = np.array([len(ids) for ids in tokenizer.encode_batch(texts)])
    too_long = lengths > spec.max_prompt_length
    if not too_long.any():
        return source
    what = (f"{int(too_long.sum())} of the {len(source)} prompts of {source!r} are longer than "
            f"rl.max_prompt_length={spec.max_prompt_length} tokens (the longest has "
            f"{int(lengths.max())})")
    if not skip_long:
        raise ValueError(f"{what}; raise rl.max_prompt_length to {int(lengths.max())}, or set "
                         f"data.skip_long_prompts=True to train on the others")
    if too_long.all():
        raise ValueError(f"{what}: none is left to train on; raise rl.max_prompt_length")
    logging.warning("%s: data.skip_long_prompts leaves them out", what)
    return SubsetSource(source, np.flatnonzero(~too_long),
                        f"prompts of ≤ {spec.max_prompt_length} tokens")


def process_prompts(batch_sharding, num_prompts: int, num_generations: int) -> slice:
    """The prompts of a step whose rows this process samples and grades: its rows of the batch
    (`host_arrays.process_rows`) must be whole groups, since a group's rows are one prompt's."""
    rows = host_arrays.process_rows(batch_sharding, num_prompts * num_generations)
    if rows.start % num_generations or rows.stop % num_generations:
        raise ValueError(f"this process holds rows {rows.start}–{rows.stop - 1} of the "
                         f"{num_prompts * num_generations}-row batch, which splits a group of "
                         f"rl.num_generations={num_generations}: make data.prompts_per_step="
                         f"{num_prompts} a multiple of the number of processes "
                         f"({jax.process_count()})")
    return slice(rows.start // num_generations, rows.stop // num_generations)


@dataclasses.dataclass
class PendingRollouts:
    """A batch of completions the sampler was asked for, not yet read back: `dispatch_rollouts`
    returns as soon as the sampler's programs are queued (JAX's asynchronous dispatch), so the
    caller can queue the trainer's update on its own devices before `finish_rollouts` waits."""

    out: Any            # the sampler's SampleOutput, its arrays possibly still being computed
    local: Any          # this process's examples
    mine: slice         # this process's prompts of the step
    num_generations: int


def dispatch_rollouts(sampler: Sampler, params, tokenizer, examples, spec: RolloutSpec, rng,
                      batch_sharding) -> PendingRollouts:
    """Queues the sampling of ``num_generations`` completions per prompt (rows of a group are
    adjacent). ``examples`` are the step's prompts, the same on every process; each process
    encodes only its own (`process_prompts`), and the sampler runs once over the global batch."""
    g = spec.num_generations
    mine = process_prompts(batch_sharding, len(examples), g)
    local = examples[mine]
    ids = [ids for ex in local for ids in [tokenizer.encode(prompt_text(ex, tokenizer, spec))] * g]
    tokens, mask = pad_prompts(ids, spec.max_prompt_length, sampler.pad_id)
    tokens, mask = host_arrays.from_process_rows((tokens, mask), batch_sharding, len(examples) * g)
    out = sampler.generate(params, tokens, mask, rng, temperature=spec.temperature,
                           top_p=spec.top_p, top_k=spec.top_k)
    return PendingRollouts(out=out, local=local, mine=mine, num_generations=g)


def finish_rollouts(pending: PendingRollouts, tokenizer, eos_ids) -> Rollouts:
    """The `Rollouts` of ``pending``: waits for the sampler's tokens and decodes this process's
    rows to text (host work)."""
    out, g, mine = pending.out, pending.num_generations, pending.mine
    seqs = Sequences.from_sample(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
    texts = decode_completions(tokenizer, host_arrays.local_rows(out.tokens),
                               host_arrays.local_rows(out.mask), eos_ids)
    golds = [ex["answer"] for ex in pending.local for _ in range(g)]
    return Rollouts(seqs=seqs, rollout_logp=out.logprobs, completed=out.finished, texts=texts,
                    golds=golds, rows=slice(mine.start * g, mine.stop * g),
                    token_steps=out.token_steps)


def collect_rollouts(sampler: Sampler, params, tokenizer, examples, spec: RolloutSpec, rng,
                     batch_sharding) -> Rollouts:
    """Samples ``num_generations`` completions per prompt and decodes them: `dispatch_rollouts`
    then `finish_rollouts`."""
    return finish_rollouts(dispatch_rollouts(sampler, params, tokenizer, examples, spec, rng,
                                             batch_sharding), tokenizer, sampler.eos_ids)


class RolloutSource(Protocol):
    """Where the sampler's weights come from."""

    batch_sharding: jax.sharding.Sharding   # where the sampler's batch of prompts lives
    weights: Any                            # the params to sample the next rollout with

    def after_update(self, params, update: CompactUpdate | None, probe: Sequences) -> dict[str, float]:
        """The trainer has ``params`` now (``update``: the step's compact form, factors only);
        returns this step's sync metrics."""


class SharedWeights:
    """The sampler reads the trainer's params themselves: no copy and nothing to sync."""

    def __init__(self, params, batch_sharding):
        self.weights = params
        self.batch_sharding = batch_sharding

    def after_update(self, params, update, probe) -> dict[str, float]:
        del update, probe
        self.weights = params
        return {}


class SyncedEngine:
    """A rollout engine fed by a sync sender after every update (sync.py); ``engine`` holds the
    sampler's weights on the rollout mesh. Built from the trainer's current params, so a resumed
    run starts with a fresh sender and engine."""

    def __init__(self, sender: sync.SyncSender, engine: sync.RolloutEngine, batch_sharding):
        self.sender, self.engine = sender, engine
        self.batch_sharding = batch_sharding

    @property
    def weights(self):
        return self.engine.params

    def after_update(self, params, update, probe) -> dict[str, float]:
        if self.sender.mode == "factors":
            return sync.sync_step(self.sender, self.engine, params, updates=update.low_rank,
                                  update_index=int(update.update_index), probe=probe)
        return sync.sync_step(self.sender, self.engine, params, probe=probe)


def rollout_source(mode: str, params, *, policy, shardings, batch_sharding, sketch,
                   train_others: bool, master_copy: bool, dtype, temperature: float) -> RolloutSource:
    """The source for ``mode`` (the placed mode: `sync.placed_mode`), starting at ``params``."""
    if mode == "off":
        return SharedWeights(params, batch_sharding)
    dtype = jnp.dtype(dtype)
    sender = sync.SyncSender(mode, params, sketch=sketch, train_others=train_others, dtype=dtype)
    engine = sync.RolloutEngine(policy, params, shardings, mode=mode, sketch=sketch,
                                train_others=train_others, master_copy=master_copy, dtype=dtype,
                                temperature=temperature)
    return SyncedEngine(sender, engine, batch_sharding)
