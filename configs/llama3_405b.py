"""Llama-3.1-405B shapes, full-parameter GRPO with bf16 weights, on a TPU slice (memory planning).

Laid out as configs/llama3_70b.py: every weight trains and is stored in bf16 (LoGRA's merges
rounded stochastically on the projections, AdamW in bf16 on the embeddings and head), the sampler
is colocated and reads the policy's own bf16 weights, β = 0 (no reference model; predicted-KL
control is the trust region), 16 prompts × 8 completions × (512 + 1536) tokens per step.

The bf16 weights alone are 811.7 GB, more than any 8-accelerator node holds, so the plan is for a
TPU slice: ``python -m launch.memory --config configs/llama3_405b.py --target v5p-32 --compare
adamw`` (FSDP over all 16 chips, micro-steps of 16 rows: one sequence per chip; on a larger
slice give ``--config.rl.micro_batch_size`` its device count). ``rl.rollout_micro_batch``
generates the 128 rows in passes when the KV cache of all of them does not fit beside the weights.
"""

from configs import base


def get_config():
    c = base.get_config()
    # colocated, sync.mode "off": the sampler reads the bf16 params themselves
    base.use_model_shape(c, "llama3_1_405b", param_dtype="bfloat16", fsdp=-1)

    base.use_reference_batch(c, micro_batch_size=16)
    c.rl.beta = 0.0

    base.use_logra_variant(c, "grpo")
    c.optimizer.logra.update(rank=256, kl_control=True, merge_rounding="stochastic")
    c.log.progress = False
    return c
