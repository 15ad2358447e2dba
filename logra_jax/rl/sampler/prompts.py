"""Prompts in, text out: padding a batch of token lists into the sampler's window, aligning
rows to the right end, and decoding completions back to text."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def decode_completions(tokenizer, tokens: np.ndarray, mask: np.ndarray, eos_ids) -> list[str]:
    """The text of each completion row: its valid tokens, EOS dropped."""
    eos = set(int(e) for e in eos_ids)
    return [tokenizer.decode([int(t) for t, v in zip(row, m) if v and int(t) not in eos])
            for row, m in zip(tokens, mask)]


def left_align(tokens: np.ndarray | jax.Array, mask: np.ndarray | jax.Array, pad_id: int):
    """Moves each row's real tokens to the right end ([pad … pad, t0 … tn]).

    Accepts left- or right-padded (or arbitrarily holed) rows; token order within a row is kept.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    mask = jnp.asarray(mask, bool)
    # Stable sort on "is real" puts pads first and keeps the real tokens in order.
    order = jnp.argsort(mask.astype(jnp.int32), axis=1, stable=True)
    tokens = jnp.take_along_axis(tokens, order, axis=1)
    mask = jnp.take_along_axis(mask, order, axis=1)
    return jnp.where(mask, tokens, pad_id), mask


def pad_prompts(prompts: Sequence[Sequence[int]], length: int, pad_id: int):
    """Left-pads token lists to ``length``; a prompt longer than that is an error, not a truncation."""
    too_long = [i for i, p in enumerate(prompts) if len(p) > length]
    if too_long:
        longest = max(len(prompts[i]) for i in too_long)
        raise ValueError(f"{len(too_long)} prompt(s) exceed max_prompt_length={length} "
                         f"(longest has {longest} tokens); raise max_prompt_length or shorten them")
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for i, p in enumerate(prompts):
        if len(p):
            tokens[i, length - len(p):] = p
            mask[i, length - len(p):] = True
    return tokens, mask

