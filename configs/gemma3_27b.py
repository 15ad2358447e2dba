"""Gemma-3-27B shapes on one 8-device node (memory planning: does the RL loop fit in 80 GiB?).

The paper's claim: a 27B model trained with LoGRA on one 8-GPU node where dense Adam runs out of
memory. Layout: all 8 devices train (FSDP) and the rollout engine shares them (colocated, bf16
weights); GRPO variant with a reference KL (β = 0.01), so a bf16 reference copy is resident too;
fp32 master weights, bf16 compute, per-layer remat, 1 sequence of 512 + 1536 tokens per device
per micro-step. The architecture is Gemma 3's own (logra_jax/model_shapes.py).
"""

from configs import base


def get_config():
    c = base.get_config()
    # colocated: sampler and KV cache live on the training devices
    base.use_model_shape(c, "gemma3_27b", fsdp=8)

    base.use_reference_batch(c, micro_batch_size=8)   # 1 sequence per device per micro-step
    c.rl.beta = 0.01

    base.use_logra_variant(c, "grpo")
    c.optimizer.logra.rank = 256
    c.log.progress = False
    return c
