"""A random 2-layer decoder with SmolLM2's tokenizer: seconds per step, for tests and smoke runs."""

from configs import base


def get_config():
    c = base.get_config()
    c.max_steps = 3
    c.model.source = "tiny"
    c.data.prompts_per_step = 4
    c.rl.num_generations = 2
    c.rl.max_prompt_length = 64
    c.rl.max_completion_length = 8
    c.rl.micro_batch_size = 4
    c.optimizer.logra.update(rank=8, learning_rate=1e-3, others_learning_rate=1e-3)
    c.optimizer.adamw.learning_rate = 1e-3
    c.checkpoint.every = 2
    c.log.progress = False
    c.log.tensorboard = False
    return c
