"""The rollout engine: completions for a batch of prompts from weights that change between calls.

    prompts.py  padding prompts into the window, aligning rows, decoding completions to text
    draw.py     one token per row: Gumbel-max noise keyed by (run key, row, token position)
    output.py   SampleOutput, what a rollout returns
    static.py   `Sampler`: a static batch, prefilled per row and decoded until its longest row ends
    slots.py    the slot engine: each group prefilled once, rows through slots refilled as rows end
    slot_schedule.py  the slot engine's schedule replayed on the host from completion lengths
"""

from logra_jax.rl.sampler.draw import (NEG_INF, TOP_P_CANDIDATES, draw, filter_logits, first_argmax,
                                       gumbel_max, gumbel_noise, token_words, truncated_draw,
                                       truncation)
from logra_jax.rl.sampler.output import SampleOutput
from logra_jax.rl.sampler.prompts import decode_completions, left_align, pad_prompts
from logra_jax.rl.sampler.static import CHUNKED_PLATFORMS, DECODE_CHUNK, Sampler

__all__ = ["CHUNKED_PLATFORMS", "DECODE_CHUNK", "NEG_INF", "TOP_P_CANDIDATES", "SampleOutput",
           "Sampler", "decode_completions", "draw", "filter_logits", "first_argmax", "gumbel_max",
           "gumbel_noise", "left_align", "pad_prompts", "token_words", "truncated_draw",
           "truncation"]
