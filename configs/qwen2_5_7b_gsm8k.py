"""Qwen2.5-7B shapes on GSM8K, laid out like the reference's measured run (memory planning).

The reference (docs/algorithm.md, "public measured numbers"): Qwen2.5-Math-7B, GSM8K, GRPO variant,
16 prompts × 8 responses per step, 2048 tokens, reference KL β = 0.01 (k3), 8 GPUs of which 4 train
(FSDP) and 4 generate; peak per training GPU 36.13 GiB (dense AdamW) vs 19.36 GiB (LoGRA).
Here: fp32 master weights, bf16 compute, per-layer remat, 512 prompt + 1536 completion tokens,
micro-batches of 1 sequence per training device.

``model.source = "shape:qwen2_5_7b"`` carries the shape only (no weights ship with this project):
``python -m launch.memory`` plans with it; to train, point model.source at a local Hugging Face
folder of Qwen2.5-(Math-)7B(-Instruct).
"""

from configs import base


def get_config():
    c = base.get_config()
    c.max_steps = 100
    base.use_model_shape(c, "qwen2_5_7b", fsdp=4, rollout_devices=4)   # 4 train + 4 roll out

    base.use_reference_batch(c, micro_batch_size=4)   # 1 sequence per training device per micro-step
    c.data.instruction = "Let's think step by step and output the final answer within \\boxed{}."
    c.rl.beta = 0.01
    c.rl.kl_estimator = "k3"

    base.use_logra_variant(c, "grpo")
    c.optimizer.warmup_steps = 50
    # In the reference GRPO variant the targets take the AdamW group's lr, weight decay and
    # schedule (warmup from 0.1·lr): the same 5e-6, 0.01 and 50 steps for both groups here.
    c.optimizer.logra.update(rank=256, learning_rate=5e-6,
                             weight_decay=0.01, others_learning_rate=5e-6,
                             others_weight_decay=0.01, others_warmup_steps=50)
    c.optimizer.adamw.update(learning_rate=5e-6, weight_decay=0.01)
    c.log.progress = False
    return c
