"""Qwen2.5-1.5B shapes: the smallest ≥ 1B model of the memory tables, and the GPU check's model.

All devices train (FSDP) and the sampler is colocated. 1 sequence of 256 + 768 tokens per device
per micro-step, bf16 compute over fp32 master weights, per-layer remat. ``shape:`` means no
weights: launch.memory plans with it and launch.step_time runs it with random weights.
"""

from configs import base


def get_config():
    c = base.get_config()
    base.use_model_shape(c, "qwen2_5_1_5b", fsdp=-1)

    c.data.prompts_per_step = 4
    c.rl.num_generations = 2
    c.rl.max_prompt_length = 256
    c.rl.max_completion_length = 768
    c.rl.micro_batch_size = 8
    c.rl.beta = 0.0

    base.use_logra_variant(c, "grpo")
    c.optimizer.logra.rank = 256
    c.log.progress = False
    return c
