"""A random 2-layer decoder with SmolLM2's tokenizer: seconds per step, for tests and smoke runs.

The objective is REINFORCE with its failure reward (docs/algorithm.md §7), not GRPO: a random
model answers nothing right, so every GRPO group would be all zeros, every advantage and gradient
0, and the weights would never move — a smoke run that proves nothing. Here a wrong answer earns
−0.01 and the advantage −0.01 − b is nonzero while the running baseline b warms up
(b_k = −0.01·(1 − 0.9^k)), so every update moves the weights (tests/test_trainer.py checks it).
The optimizer is still LoGRA's GRPO variant (RowAdam + AdamW on the rest); set
``rl.algorithm=grpo`` for the GRPO loss path.

``data.size``: 256 task prompts, not the base's 10,000. A smoke run reads a dozen, and every prompt
is rendered and tokenized before anything compiles (the prompt-window check): 2 s of each process
at 10,000.

``data.skip_long_prompts``: with ``--config.data.source=gsm8k`` the 64-token prompt window takes the
GSM8K questions that fit (about 7 % of train) instead of stopping.
"""

from configs import base


def get_config():
    c = base.get_config()
    c.max_steps = 3
    c.model.source = "tiny"
    c.data.prompts_per_step = 4
    c.data.size = 256
    c.data.skip_long_prompts = True
    c.rl.algorithm = "reinforce"
    c.rl.num_generations = 2
    c.rl.max_prompt_length = 64
    c.rl.max_completion_length = 8
    c.rl.micro_batch_size = 8
    c.optimizer.logra.update(rank=8, learning_rate=1e-3, others_learning_rate=1e-3)
    c.optimizer.adamw.learning_rate = 1e-3
    c.checkpoint.every = 2
    c.log.progress = False
    c.log.tensorboard = False
    return c
