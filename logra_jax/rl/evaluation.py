"""Greedy accuracy of a policy on a fixed, ordered set of questions (e.g. the first N of GSM8K test).

Before/after comparisons need the same questions, the same prompt and a decoding without chance,
so every question gets one greedy completion, graded like a rollout (`rewards.math_reward`: the
final answer must match the gold one). Batches have one fixed shape — the last is padded by
repeating its first question and the padding rows are dropped — so the sampler compiles once.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from logra_jax.data import Example, format_prompt
from logra_jax.rl import rewards
from logra_jax.rl.sampler import Sampler, decode_completions, pad_prompts


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Per question: its gold answer, the greedy completion and whether it was graded right."""

    answers: list[str]
    completions: list[str]
    correct: list[bool]
    clipped: list[bool]    # the completion hit max_completion_length without EOS

    @property
    def accuracy(self) -> float:
        return float(np.mean(self.correct)) if self.correct else float("nan")

    def summary(self) -> dict:
        return dict(num_questions=len(self.correct), num_correct=int(sum(self.correct)),
                    accuracy=self.accuracy, clipped_ratio=float(np.mean(self.clipped)))


def greedy_accuracy(sampler: Sampler, params, tokenizer, examples: Sequence[Example], *,
                    batch_size: int, instruction: str | None, system_prompt: str | None = None,
                    batch_sharding=None) -> EvalResult:
    """Greedy-decodes every example's prompt with ``params`` and grades the completions."""
    if not examples:
        raise ValueError("greedy_accuracy needs at least one example")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    prompts = [format_prompt(ex["question"], tokenizer, system_prompt=system_prompt,
                             instruction=instruction) for ex in examples]
    ids = [tokenizer.encode(p) for p in prompts]
    too_long = [i for i, row in enumerate(ids) if len(row) > sampler.max_prompt_length]
    if too_long:
        longest = max(len(ids[i]) for i in too_long)
        raise ValueError(f"{len(too_long)} prompt(s) exceed max_prompt_length="
                         f"{sampler.max_prompt_length} tokens (longest {longest}); raise it")
    completions, clipped = [], []
    for start in range(0, len(ids), batch_size):
        rows = ids[start:start + batch_size]
        real = len(rows)
        rows = rows + [rows[0]] * (batch_size - real)
        tokens, mask = pad_prompts(rows, sampler.max_prompt_length, sampler.pad_id)
        if batch_sharding is not None:
            tokens, mask = jax.device_put((tokens, mask), batch_sharding)
        out = sampler.generate(params, tokens, mask, jax.random.PRNGKey(0), greedy=True)
        texts = decode_completions(tokenizer, np.asarray(out.tokens), np.asarray(out.mask),
                                   sampler.eos_ids)
        completions += texts[:real]
        clipped += [not bool(d) for d in np.asarray(out.finished)[:real]]
    answers = [ex["answer"] for ex in examples]
    correct = [rewards.math_reward(c, a) >= 1.0 for c, a in zip(completions, answers)]
    return EvalResult(answers=answers, completions=completions, correct=correct, clipped=clipped)
