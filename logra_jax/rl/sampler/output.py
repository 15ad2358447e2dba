"""What a rollout returns: each row's completion tokens, their log-probs and masks, and the work
the program ran for it."""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Completions of a batch: tokens, the sampling log-probs of each token, and validity masks.

    ``logprobs`` are log softmax(logits / temperature) of the sampled token, before top-k/top-p
    truncation: with temperature 1 they are the model's own log-probs, which is what the RL losses
    compare against. ``mask`` is True for generated tokens up to and including EOS.

    ``token_steps`` is the work the decode loop ran, counted by the program's own loop (not
    inferred from the masks): for each row, the token steps of the pass that drew it, one draw for
    every row of that pass each, the first from the prefill's logits and every later one after a
    decode forward pass. A pass runs until its longest row ends, so a row of L kept tokens in a
    pass whose longest row keeps L_max cost L_max steps (L_max − 1 forward passes), and a GPU's
    16-token chunks also run the discarded steps of the last chunk: 1 + 16·⌈(L_max − 1)/16⌉.
    Σ token_steps = the row-steps executed (`rollout.work_metrics`).
    """

    prompt_tokens: jax.Array      # [b, P] left-padded
    prompt_mask: jax.Array        # [b, P] bool
    tokens: jax.Array             # [b, C]
    logprobs: jax.Array           # [b, C] float32
    mask: jax.Array               # [b, C] bool
    finished: jax.Array           # [b] bool: the row emitted EOS
    token_steps: jax.Array        # [b] int32: token steps its pass ran (forward passes + 1)
