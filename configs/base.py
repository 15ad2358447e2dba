"""Every key a run can set, with the reference defaults; the named configs override a few.

Sections: model, mesh, data, rl (TRL/Tunix names), optimizer (name + one section per optimizer,
keyed like its function's arguments), sync, distributed, checkpoint, log. A command-line
``--config.a.b=v`` must name a key defined here.
"""

import ml_collections
from ml_collections.config_dict import placeholder

# Configs hold plain values and import nothing from the library; tests/test_infra.py checks that
# these equal the library's own defaults (optim.DEFAULT_TARGETS, data.DEFAULT_INSTRUCTION).
DEFAULT_TARGETS = r"(^|/)(q|k|v|o|gate|up|down)_proj/kernel$"   # attention and MLP projections
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


# The two LoGRA variants of docs/algorithm.md, as presets: the optimizer section and the RL
# objective each runs with. `use_logra_variant(c, "kl")` applies one.
LOGRA_VARIANTS = {
    "grpo": (dict(variant="learning_rate", others="adamw"), dict(algorithm="grpo")),
    "kl": (dict(variant="kl", others="frozen", kl_control=True, weight_decay=0.0),
           dict(algorithm="reinforce")),
}


# The reference's measured GRPO batch (docs/algorithm.md §7): 16 GSM8K prompts × 8 completions of
# 512 + 1536 tokens. A published fact, so the memory-planning configs share it by name.
REFERENCE_BATCH = (dict(source="gsm8k", prompts_per_step=16),
                   dict(num_generations=8, max_prompt_length=512, max_completion_length=1536))


def use_reference_batch(c: ml_collections.ConfigDict, micro_batch_size: int) -> ml_collections.ConfigDict:
    """The reference batch, ``micro_batch_size`` rows per micro-step (1 sequence per device)."""
    data, rl = REFERENCE_BATCH
    c.data.update(data)
    c.rl.update(rl, micro_batch_size=micro_batch_size)
    return c


def use_model_shape(c: ml_collections.ConfigDict, shape: str, *, param_dtype: str = "float32",
                    fsdp: int = 8, rollout_devices: int = 0) -> ml_collections.ConfigDict:
    """A memory plan of a published shape (``model.source="shape:<shape>"``, no weights) as the
    large runs are laid out: bf16 compute, per-layer remat, an FSDP-only training mesh of ``fsdp``
    devices (-1: all that are left), the sampler colocated (0) or on ``rollout_devices`` of its own."""
    c.model.update(source=f"shape:{shape}", dtype="bfloat16", param_dtype=param_dtype, remat=True)
    c.mesh.update(fsdp=fsdp, tensor=1)
    c.sync.rollout_devices = rollout_devices
    return c


def use_logra_variant(c: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    optimizer, rl = LOGRA_VARIANTS[name]
    c.optimizer.name = "logra"
    c.optimizer.logra.update(optimizer)
    c.rl.update(rl)
    return c


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.max_steps = 100

    c.model = ml_collections.ConfigDict(dict(
        source="smollm2-135m-instruct",   # or a local HF folder, a .gguf file, "tiny" (random),
                                          # "shape:<name>" (no weights; launch.memory only), or
                                          # "random:<name>": a shape of logra_jax/model_shapes.py
                                          # with weights drawn from init_seed and SmolLM2's
                                          # tokenizer ($LOGRA_TOKENIZER_GGUF: a GGUF or its header)
        dtype="float32",                  # compute dtype
        param_dtype="float32",            # master weights
        remat=False,
        init_seed=0,                      # random init of source="tiny" and "random:<name>"
        tiny=ml_collections.ConfigDict(dict(
            hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-5, qkv_bias=False,
            tie_embeddings=True, max_position_embeddings=512)),
    ))
    # Axis sizes; -1 takes whatever devices the other axes leave.
    c.mesh = ml_collections.ConfigDict(dict(fsdp=-1, tensor=1))

    c.data = ml_collections.ConfigDict(dict(
        source="task",                    # "task" (reasoning-gym, offline) | "gsm8k" (local JSONL)
                                          # | "sums" ("What is a + b?", no package; size, task_seed)
        task="chain_sum",
        task_kwargs=ml_collections.ConfigDict(dict(min_terms=2, max_terms=2, min_digits=1,
                                                   max_digits=1)),
        task_seed=0,
        size=10_000,
        gsm8k_dir="",                     # folder with train.jsonl / test.jsonl
        gsm8k_cache_dir="",               # where tfds keeps the prepared copy ("" = tfds default)
        split="train",
        system_prompt="",
        instruction="",                   # appended to the question; "" = the question alone
        prompts_per_step=8,
        shuffle=True,
        skip_long_prompts=False,          # True: leave out prompts longer than rl.max_prompt_length
                                          # (False: they are an error, found before compiling)
    ))

    c.rl = ml_collections.ConfigDict(dict(
        algorithm="grpo",                 # "grpo" | "reinforce" (the KL variant's objective)
        num_generations=4,
        temperature=1.0, top_p=1.0, top_k=0,
        max_prompt_length=96, max_completion_length=48,
        beta=0.0, kl_estimator="k3",
        epsilon=0.2, epsilon_high=0.0,    # 0 → symmetric clipping. Inert at max_lag=0: one update
                                          # per batch, so π_old is the policy itself (detached),
                                          # the ratio is 1 and no token is ever clipped; with a lag
                                          # π_old is the behaviour policy and the clip binds
        loss_agg_mode="token-mean",
        scale_rewards=True,
        advantage_baseline="mean",        # grpo: "mean" (TRL) | "leave_one_out" (the reference)
        micro_batch_size=8,
        failure_reward=-0.01, baseline_momentum=0.9, is_cap=2.0,   # reinforce only
        format_reward_weight=0.0,
        decode_weights="auto",            # "per_layer" | "stacked"; auto: a rule of the platform
        rollout_micro_batch=0,            # sampler rows per pass (KV cache holds one pass); 0: all
        rollout_engine="static",          # "static" | "slots": groups prefilled once, slots refilled
        rollout_slots=0,                  # slots: decode slots (× num_generations); 0: every row
        max_lag=0,                        # η: step k trains on rollouts sampled by the weights of
                                          # η updates earlier (k−1−η), sampled while the trainer
                                          # updates; 0: the sequential, on-policy loop
        importance_correction="tis",      # lag ≥ 1 (reinforce: always): "tis" truncates the
                                          # ratio π_θ/π_behaviour at the cap, "mis" masks the token
        importance_cap=2.0,               # grpo's cap C at lag ≥ 1 (reinforce's is is_cap)
    ))

    # `name` picks the section that builds the optimizer; each section's keys are the keyword
    # arguments of the function it configures (None: that function's own default).
    c.optimizer = ml_collections.ConfigDict(dict(
        name="logra",                     # "logra" | "lora" | dense: "adamw", "adafactor", "galore"
        warmup_steps=0,                   # linear warmup of `learning_rate` (either section)
        probe_size=2,                     # rows for the predicted and the realized KL
        max_consecutive_skips=3,          # non-finite updates in a row (skipped) that stop the run
        max_weight_norm_growth=2.0,       # ‖θ‖ > this × the initial ‖θ‖ stops the run (diverged)
    ))
    # logra_jax.optim.logra(...) (docs/algorithm.md §2–6). Variants: LOGRA_VARIANTS above.
    c.optimizer.logra = ml_collections.ConfigDict(dict(
        variant="learning_rate",          # the step: "learning_rate" (the GRPO variant) | "kl"
        learning_rate=1e-6, weight_decay=0.0,                      # grpo only
        max_grad_norm=placeholder(float),  # None: 1.0 for grpo, no clipping for kl; inf: none
        # sketch and RowAdam (§2–4)
        targets=DEFAULT_TARGETS, rank=256, b2=0.95, eps=1e-8, seed=42, refresh=True,
        distribution="rademacher",        # | "gaussian" | "rademacher_threefry" (the reference's A)
        others=placeholder(str),          # "adamw" | "frozen"; None: adamw for grpo, frozen for kl
        others_learning_rate=5e-6, others_weight_decay=0.0, others_warmup_steps=0,
        # predicted-KL control (§6)
        kl_control=placeholder(bool),     # None: on for kl, off for grpo
        kl_budget=2e-4, kl_budget_final=2e-5, kl_budget_horizon=300, alpha_max=3.0,
        mismatch_weight=0.3,
        kl_safeguard=1.0,                 # measured KL > this × budget: the step is scaled back
        kl_correction=0.3,                # EMA weight of the learned realized/predicted ratio
                                          # (inf and 0: the reference's controller)
        update_ratio=6e-5,                # kl only: relative size of the proposed step
        factor_dtype=placeholder(str),    # "bfloat16": round the GRPO variant's U (exact factors sync)
        merge_rounding="stochastic",      # bf16 weights: "stochastic" (unbiased) | "nearest"
        exact_merge=placeholder(bool),    # order-free U·A; None: only where a factors receiver
                                          # replays the merge (rl/build.py: replays_merge)
    ))
    # optax.adamw(...) after clipping by the global norm (max_grad_norm 0: no clipping).
    c.optimizer.adamw = ml_collections.ConfigDict(dict(
        learning_rate=1e-6, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=1.0,
    ))
    # optax.adafactor(...) after the same clipping (logra_jax/optim/baselines.py): factored second
    # moments; multiply_by_parameter_scale off so learning_rate is an absolute step as for AdamW.
    c.optimizer.adafactor = ml_collections.ConfigDict(dict(
        learning_rate=1e-6, decay_rate=0.8, min_dim_size_to_factor=128, clipping_threshold=1.0,
        multiply_by_parameter_scale=False, momentum=placeholder(float),
        weight_decay_rate=placeholder(float), max_grad_norm=1.0,
    ))
    # LoRA (logra_jax/optim/lora.py): rank-r adapters s·B·A (s = alpha / rank) on the targets,
    # AdamW (after the same clipping) on the adapters only; the base frozen in model.param_dtype.
    c.optimizer.lora = ml_collections.ConfigDict(dict(
        rank=64, alpha=128.0, targets=DEFAULT_TARGETS, init_seed=0,
        learning_rate=1e-5, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=1.0,
    ))
    # GaLore (optax.contrib.galore's math) on the targets (one projector per layer), AdamW on the
    # rest. projector: "svd" (the paper's) | "randomized" (a range finder: compiles in seconds for
    # TPU, where an SVD compiles for minutes per matrix shape; logra_jax/optim/galore.py).
    c.optimizer.galore = ml_collections.ConfigDict(dict(
        learning_rate=1e-6, rank=128, update_proj_gap=200, scale=1.0, b1=0.9, b2=0.999, eps=1e-8,
        weight_decay=0.0, targets=DEFAULT_TARGETS, projector="svd", max_grad_norm=1.0,
    ))

    # Trainer → rollout engine (docs/algorithm.md §8; logra_jax/rl/sync.py).
    c.sync = ml_collections.ConfigDict(dict(
        mode="off",            # "off": the sampler reads the trainer's params (colocated, no copy)
                               # | "full" | "factors" | "sparse": a separate engine receives messages
        rollout_devices=0,     # 0: engine on the trainer's devices; n > 0: the last n devices
        rollout_mesh=ml_collections.ConfigDict(dict(fsdp=-1, tensor=1)),
        master_copy=True,      # factors: keep fp32 targets on the engine → bit-exact; False drifts
        dtype="bfloat16",      # the engine's weights
    ))

    # More than one process (logra_jax/distributed.py, launch/local_cluster.sh): empty = one process.
    c.distributed = ml_collections.ConfigDict(dict(
        coordinator_address="",   # process 0's "host:port"; "auto": JAX reads the cluster (SLURM, TPU)
        num_processes=0,
        process_id=-1,
        initialization_timeout=300,   # s for every process to join; then the waiting ones stop
        heartbeat_timeout=100,        # s of silence after which a process counts as dead
    ))
    c.checkpoint = ml_collections.ConfigDict(dict(every=10, keep=2))
    c.log = ml_collections.ConfigDict(dict(tensorboard=True, progress=True, sample_every=10))
    return c
