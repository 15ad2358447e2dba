"""SmolLM2-135M-Instruct on GSM8K with LoGRA (GRPO variant) — a real-data run for a GPU.

Point it at a folder holding GSM8K's train.jsonl / test.jsonl (nothing is downloaded):

    python -m launch.train --config configs/smollm2_gsm8k.py --workdir runs/gsm8k \
        --config.data.gsm8k_dir=/path/to/gsm8k

Measured here: this quantised 135M model solves ~2 % of GSM8K-style problems, so expect a slow
start; the reference GRPO shape (16 prompts × 8 completions) is kept.
"""

from configs import base


def get_config():
    c = base.get_config()
    c.max_steps = 100
    c.data.source = "gsm8k"
    c.data.split = "train"
    c.data.instruction = base.DEFAULT_INSTRUCTION
    c.data.prompts_per_step = 16
    c.rl.num_generations = 8
    c.rl.max_prompt_length = 320
    c.rl.max_completion_length = 256
    c.rl.micro_batch_size = 16
    c.rl.beta = 0.01
    c.optimizer.warmup_steps = 10
    c.optimizer.logra.update(learning_rate=1e-5, others_learning_rate=5e-6, others_warmup_steps=10)
    c.optimizer.adamw.learning_rate = 1e-5
    return c
