"""The learning comparison (docs/results/learning.md): SmolLM2-135M, one task, five optimizers.

The default job's task (two one-digit terms) is learnt mostly as an answer format and flattens after
a few updates, so this one mixes in two-digit terms: reasoning-gym chain_sum, two terms of 1–2
digits ("… 47 - 8 ="). Measured on the initial weights (64 questions, task seed 7, 32 tokens):
greedy 0.30, sampled at T = 1 0.11–0.19; the one-digit default task: greedy 0.45, sampled
0.14–0.30. Everything else is the default job (configs/default.py): 4 prompts × 4 completions,
20 steps, GRPO.

Each optimizer keeps the default job's settings, plus what a user of it would start from:
  logra      as `make train` runs it: sketched RowAdam on the targets, AdamW on the rest, 3e-5,
             predicted-KL control (budget 0.03 → 0.01).
  adamw      dense AdamW at the same 3e-5, no KL control (it needs LoGRA's factors).
  adafactor  optax.adafactor at the same absolute step size (parameter scaling off).
  lora       adapters on the same targets at 10× the full-parameter rate (3e-4), α = 32 for every
             rank (s = α / r), the convention under which the best LoRA rate hardly depends on the
             rank (Schulman et al., "LoRA Without Regret", 2025); the base and non-targets frozen.
Choose one with --config.optimizer.name and, for LoRA, the rank with --config.optimizer.lora.rank.
"""

from configs import default


def get_config():
    c = default.get_config()
    c.data.task = "chain_sum"
    c.data.task_kwargs.update(min_terms=2, max_terms=2, min_digits=1, max_digits=2)
    c.optimizer.adafactor.learning_rate = 3e-5
    c.optimizer.lora.update(learning_rate=3e-4, alpha=32.0)
    return c
