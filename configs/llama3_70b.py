"""Llama-3.1-70B shapes on one 8 × 80 GB node, full-parameter GRPO with bf16 weights (memory planning).

No framework we know trains a 70B model full-parameter on one 8-GPU node without CPU offload; LoRA
does, with a frozen bf16 base. Here every weight trains and is stored in bf16: the projections
take LoGRA's low-rank merges, rounded stochastically (unbiased, `optimizer.logra.merge_rounding`),
and the embeddings and head take AdamW in bf16 (moments in the weights' dtype, optax's default).
The sampler is colocated and reads the policy's own bf16 weights (no copy); its KV cache holds the
whole rollout batch. β = 0: no reference model, predicted-KL control is the trust region.

Batch: 16 prompts × 8 completions × (512 + 1536) tokens per step, as the Gemma-3-27B config;
1 sequence per device per micro-step, bf16 compute, per-layer remat.
``python -m launch.memory --config configs/llama3_70b.py --compare adamw,logra:fp32``.
"""

from configs import base


def get_config():
    c = base.get_config()
    # colocated, sync.mode "off": the sampler reads the bf16 params themselves
    base.use_model_shape(c, "llama3_1_70b", param_dtype="bfloat16", fsdp=8)

    base.use_reference_batch(c, micro_batch_size=8)   # 1 sequence per device per micro-step
    c.rl.beta = 0.0

    base.use_logra_variant(c, "grpo")
    c.optimizer.logra.update(rank=256, kl_control=True, merge_rounding="stochastic")
    c.log.progress = False
    return c
