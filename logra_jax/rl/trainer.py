"""The RL training loop: rollout → rewards → advantages → reference log-probs → policy update.

`train(config, workdir)` is the whole job behind ``python -m launch.train``. It reads top to
bottom like the loop it runs (big_vision style): build everything from the config, resume if the
workdir holds a checkpoint, then per step

  1. take prompts from the data iterator and sample completions with the rollout engine,
  2. grade them (1 for the right final answer) and turn rewards into advantages (GRPO: group
     relative; REINFORCE: outcome minus a running baseline),
  3. score the completions under the frozen reference model (only when beta > 0),
  4. update the policy (`PolicyUpdate`: sketched gradients, LoGRA or AdamW, KL control),
  5. hand the new weights to the rollout engine, log metrics, checkpoint.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from logra_jax import checkpoint as checkpoint_lib
from logra_jax import metrics as metrics_lib
from logra_jax import model_shapes
from logra_jax import sharding as sharding_lib
from logra_jax.memory import opt_state_shardings
from logra_jax.data import PromptIterator, format_prompt, load_gsm8k, make_task_source
from logra_jax.models import Decoder, ModelConfig, from_pretrained
from logra_jax.models import gguf_loader
from logra_jax.optim import SketchSpec, logra, logra_metrics, update_index, warmup_constant
from logra_jax.rl import losses, rewards, sync
from logra_jax.rl.policy import Policy, Sequences
from logra_jax.rl.sampler import Sampler, decode_completions, pad_prompts
from logra_jax.rl.update import LossConfig, PolicyUpdate, TrainBatch


# ----------------------------------------------------------------------------------------------
# Building blocks from the config
# ----------------------------------------------------------------------------------------------
def build_mesh(axes: ml_collections.ConfigDict, devices=None):
    """A mesh over ``devices`` (default: all); an axis of -1 takes all devices the others leave."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = dict(axes)
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {sizes}")
    if free:
        fixed = int(np.prod([s for s in sizes.values() if s != -1]))
        if len(devices) % fixed:
            raise ValueError(f"mesh {sizes}: {len(devices)} devices are not divisible by {fixed}")
        sizes[free[0]] = len(devices) // fixed
    return sharding_lib.make_mesh(sizes, devices=devices)


def build_model(cfg: ml_collections.ConfigDict, mesh):
    """(model, tokenizer). ``source="tiny"`` is a random small decoder with SmolLM2's tokenizer."""
    if model_shapes.is_shape_source(cfg.source):
        raise ValueError(f"model.source={cfg.source!r} is a model shape without weights, for "
                         "`python -m launch.memory`; to train, set model.source to a local Hugging "
                         "Face folder of that model")
    if cfg.source == "tiny":
        import gguf  # the tokenizer (with its chat template) comes from the SmolLM2 GGUF
        tokenizer = gguf_loader.tokenizer_from_gguf(gguf.GGUFReader(gguf_loader.smollm2_gguf_path()))
        model_config = ModelConfig(vocab_size=tokenizer.vocab_size, dtype=cfg.dtype,
                                   param_dtype=cfg.param_dtype, remat=cfg.remat, **dict(cfg.tiny))
        model = Decoder(model_config, rngs=nnx.Rngs(cfg.init_seed))
        return sharding_lib.shard_model(model, mesh), tokenizer
    return from_pretrained(cfg.source, mesh=mesh, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                           remat=cfg.remat)


def build_data(cfg: ml_collections.ConfigDict, seed: int):
    if cfg.source == "task":
        source = make_task_source(cfg.task, size=cfg.size, seed=cfg.task_seed, **dict(cfg.task_kwargs))
    elif cfg.source == "gsm8k":
        if not cfg.gsm8k_dir:
            raise ValueError("data.source='gsm8k' needs data.gsm8k_dir: a folder with train.jsonl and "
                             "test.jsonl (nothing is downloaded)")
        source = load_gsm8k(cfg.gsm8k_dir, cfg.split, cache_dir=cfg.gsm8k_cache_dir or None)
    else:
        raise ValueError(f"data.source must be 'task' or 'gsm8k', got {cfg.source!r}")
    return PromptIterator(source, batch_size=cfg.prompts_per_step, seed=seed, shuffle=cfg.shuffle)


def build_optimizer(cfg: ml_collections.ConfigDict):
    """(tx, SketchSpec or None, train_others, kl_control) from ``config.optimizer``."""
    if cfg.name == "adamw":
        tx = optax.chain(
            optax.clip_by_global_norm(cfg.max_grad_norm) if cfg.max_grad_norm > 0 else optax.identity(),
            optax.adamw(warmup_constant(cfg.learning_rate, cfg.warmup_steps), b1=cfg.b1,
                        b2=cfg.adam_b2, eps=cfg.adam_eps, weight_decay=cfg.weight_decay))
        return tx, None, True, False
    if cfg.name != "logra":
        raise ValueError(f"optimizer.name must be 'logra' or 'adamw', got {cfg.name!r}")
    sketch = dict(targets=cfg.targets, rank=cfg.rank, seed=cfg.sketch_seed,
                  distribution=cfg.distribution, refresh=cfg.refresh)
    kl_control = cfg.variant == "kl" or cfg.kl_control
    tx = logra(
        variant=cfg.variant, **sketch,
        learning_rate=warmup_constant(cfg.learning_rate, cfg.warmup_steps),
        weight_decay=cfg.weight_decay if cfg.variant == "grpo" else 0.0,
        max_grad_norm=cfg.max_grad_norm or None, b2=cfg.b2, eps=cfg.eps,
        others=cfg.others, others_learning_rate=cfg.others_learning_rate,
        others_weight_decay=cfg.weight_decay, others_warmup_steps=cfg.warmup_steps,
        kl_control=kl_control, kl_budget=cfg.kl_budget, kl_budget_final=cfg.kl_budget_final,
        kl_budget_horizon=cfg.kl_budget_horizon, alpha_max=cfg.alpha_max,
        update_ratio=cfg.update_ratio, factor_dtype=cfg.factor_dtype or None)
    return tx, SketchSpec(**sketch), cfg.others != "frozen", kl_control


# ----------------------------------------------------------------------------------------------
# Rollouts and rewards
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Rollouts:
    seqs: Sequences
    rollout_logp: jax.Array
    completed: jax.Array
    texts: list[str]
    golds: list[str]


def collect_rollouts(sampler: Sampler, params, tokenizer, examples, rl_cfg, data_cfg, rng,
                     batch_sharding) -> Rollouts:
    """Samples ``num_generations`` completions per prompt (rows of a group are adjacent)."""
    prompts = [format_prompt(ex["question"], tokenizer, system_prompt=data_cfg.system_prompt or None,
                             instruction=data_cfg.instruction or None) for ex in examples]
    ids = [tokenizer.encode(p) for p in prompts for _ in range(rl_cfg.num_generations)]
    tokens, mask = pad_prompts(ids, rl_cfg.max_prompt_length, sampler.pad_id)
    tokens, mask = jax.device_put((tokens, mask), batch_sharding)
    out = sampler.generate(params, tokens, mask, rng, temperature=rl_cfg.temperature,
                           top_p=rl_cfg.top_p, top_k=rl_cfg.top_k)
    seqs = Sequences.from_sample(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
    texts = decode_completions(tokenizer, np.asarray(out.tokens), np.asarray(out.mask), sampler.eos_ids)
    golds = [ex["answer"] for ex in examples for _ in range(rl_cfg.num_generations)]
    return Rollouts(seqs=seqs, rollout_logp=out.logprobs, completed=out.finished, texts=texts,
                    golds=golds)


def score(texts: list[str], golds: list[str], rl_cfg) -> np.ndarray:
    """Outcome reward per completion (+ optional format reward)."""
    failure = rl_cfg.failure_reward if rl_cfg.algorithm == "reinforce" else 0.0
    r = np.array([rewards.math_reward(t, g, failure_reward=failure) for t, g in zip(texts, golds)],
                 np.float32)
    if rl_cfg.format_reward_weight:
        r += rl_cfg.format_reward_weight * np.array([rewards.format_reward(t) for t in texts], np.float32)
    return r


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------
SYNC_MODES = ("off", "full", "factors", "sparse")
SYNC_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def batch_sharding(mesh, rows: int) -> NamedSharding:
    """Rows over the fsdp axis when they divide evenly, else replicated."""
    return NamedSharding(mesh, P("fsdp" if rows % mesh.shape["fsdp"] == 0 else None))


def validate(config: ml_collections.ConfigDict) -> None:
    rl = config.rl
    if rl.algorithm == "grpo" and rl.num_generations < 2:
        raise ValueError(f"rl.num_generations={rl.num_generations}: GRPO compares completions within "
                         "a group, so it needs at least 2 per prompt")
    if rl.algorithm not in ("grpo", "reinforce"):
        raise ValueError(f"rl.algorithm must be 'grpo' or 'reinforce', got {rl.algorithm!r}")
    if config.max_steps <= 0:
        raise ValueError(f"max_steps must be positive, got {config.max_steps}")
    if config.sync.mode not in SYNC_MODES:
        raise ValueError(f"sync.mode must be one of {SYNC_MODES}, got {config.sync.mode!r}")
    if config.sync.rollout_devices and config.sync.mode == "off":
        raise ValueError("sync.rollout_devices > 0 puts the sampler on its own devices, so it needs "
                         "a sync.mode (full | factors | sparse) to receive the weights")
    if config.sync.mode == "factors" and config.optimizer.name != "logra":
        raise ValueError("sync.mode='factors' sends LoGRA's low-rank factors; optimizer.name="
                         f"{config.optimizer.name!r} has none (use full or sparse)")
    if config.sync.dtype not in SYNC_DTYPES:
        raise ValueError(f"sync.dtype must be one of {sorted(SYNC_DTYPES)}, got {config.sync.dtype!r}")
    rows = config.data.prompts_per_step * rl.num_generations
    if rows % rl.micro_batch_size:
        raise ValueError(f"prompts_per_step × num_generations = {rows} rows is not a multiple of "
                         f"rl.micro_batch_size={rl.micro_batch_size}")


class Trainer:
    """All long-lived objects of a run, built once from the config (jitted functions included)."""

    def __init__(self, config: ml_collections.ConfigDict):
        validate(config)
        self.config = config
        train_devices, rollout_devices = sync.split_devices(config.sync.rollout_devices)
        self.mesh = build_mesh(config.mesh, train_devices)
        self.rollout_mesh = build_mesh(config.sync.rollout_mesh, rollout_devices)
        colocated = not config.sync.rollout_devices
        # Colocated, every sync is a local cast of the trainer's weights (sync.placed_mode).
        self.sync_mode = sync.placed_mode(config.sync.mode, colocated)
        if self.sync_mode != config.sync.mode:
            logging.info("sync.mode=%s with a colocated sampler runs as a local cast of the trainer's "
                         "weights (exact, no master copy or mirror); sync.rollout_devices > 0 puts "
                         "the sampler on its own devices and sends %s", config.sync.mode,
                         config.sync.mode)
        model, self.tokenizer = build_model(config.model, self.mesh)
        self.policy = Policy(model)
        self.rollout_shardings = sync.rollout_shardings(model, self.rollout_mesh)
        params = Policy.params_of(model)
        del model
        # The devices hold one copy of the weights during training: the policy's. The initial
        # weights (the start of every Run of this Trainer) wait on the host, and the frozen
        # reference is kept only when the loss uses it (beta > 0), in the compute dtype: every
        # layer casts its weights to that dtype anyway, so its log-probs are unchanged (fp32
        # master weights would cost 4 instead of 2 bytes per parameter at bf16 compute).
        self.param_shardings = jax.tree.map(lambda x: x.sharding, params)
        self.initial_params = jax.device_get(params)
        compute = jnp.dtype(config.model.dtype)
        self.reference_params = (
            jax.jit(lambda p: jax.tree.map(lambda x: x.astype(compute) if jnp.issubdtype(
                x.dtype, jnp.floating) else x, p), out_shardings=self.param_shardings)(params)
            if config.rl.beta > 0 else None)
        self.tx, self.sketch, self.train_others, kl_control = build_optimizer(config.optimizer)
        rl = config.rl
        self.update = PolicyUpdate(
            self.policy, self.tx,
            LossConfig(algorithm=rl.algorithm, epsilon=rl.epsilon, epsilon_high=rl.epsilon_high or None,
                       beta=rl.beta, kl_estimator=rl.kl_estimator, loss_agg_mode=rl.loss_agg_mode,
                       is_cap=rl.is_cap, temperature=rl.temperature),
            micro_batch_size=rl.micro_batch_size, probe_size=config.optimizer.probe_size,
            sketch=self.sketch, train_others=self.train_others, kl_control=kl_control,
            return_updates=self.sync_mode == "factors")
        eos_ids = [self.tokenizer.eos_id]
        pad_id = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else self.tokenizer.eos_id
        self.sampler = Sampler(self.policy, max_prompt_length=rl.max_prompt_length,
                               max_completion_length=rl.max_completion_length, eos_ids=eos_ids,
                               pad_id=pad_id)
        rows = config.data.prompts_per_step * rl.num_generations
        self.batch_sharding = batch_sharding(self.mesh, rows)
        self.rollout_batch_sharding = batch_sharding(self.rollout_mesh, rows)
        self._ref_logprobs = jax.jit(self._ref_logprobs_impl)
        # Optimizer state sharded like the params it belongs to (RowAdam's v like the kernel's out
        # dim): jit(tx.init) alone puts every output on one device, since none depends on values.
        self._init_opt = jax.jit(self.tx.init, out_shardings=opt_state_shardings(self.tx, params))
        del params

    def _ref_logprobs_impl(self, ref_params, seqs: Sequences):
        logp, _ = self.policy.completion_logprobs(ref_params, seqs, temperature=self.config.rl.temperature)
        return logp

    def init_state(self):
        """(params, opt_state) at the initial weights, on the training devices."""
        params = jax.device_put(self.initial_params, self.param_shardings)
        return params, self._init_opt(params)

    def advantages(self, r: np.ndarray, baseline: float) -> tuple[np.ndarray, float]:
        rl = self.config.rl
        if rl.algorithm == "grpo":
            adv = losses.group_advantages(jnp.asarray(r), rl.num_generations,
                                          scale_by_std=rl.scale_rewards)
            return np.asarray(adv), baseline
        adv = r - baseline  # the baseline is updated after use (ALGORITHM.md §7)
        return adv.astype(np.float32), float(losses.update_baseline(baseline, jnp.asarray(r),
                                                                     momentum=rl.baseline_momentum))


class Run:
    """One training run in a workdir: everything built (errors in the config surface here), then
    `loop()` trains to ``max_steps``, resuming from the latest complete checkpoint."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
                 trainer: Trainer | None = None):
        self.config = config
        self.workdir = pathlib.Path(workdir)
        # A Trainer holds compiled functions; runs of one config (e.g. a resumed run) may share it.
        self.trainer = trainer if trainer is not None else Trainer(config)
        self.data = build_data(config.data, config.seed)
        self.ckpt = checkpoint_lib.Checkpointer(self.workdir / "checkpoints", keep=config.checkpoint.keep)

    def loop(self) -> dict[str, Any]:
        """Trains to ``max_steps``; returns the last step's metrics row."""
        config, t, data, ckpt = self.config, self.trainer, self.data, self.ckpt
        rl = config.rl
        params, opt_state = t.init_state()
        step, baseline = 0, 0.0
        latest = ckpt.latest_step()
        if latest is not None:
            (params, opt_state), meta = ckpt.restore(latest, (params, opt_state))
            step, baseline = meta["step"], meta["baseline"]
            data.restore(meta["data"])
            logging.info("resumed from %s at step %d", ckpt.directory, step)
        ref_params = t.reference_params
        # The rollout engine starts from the (restored) trainer weights; factors/sparse messages
        # are deltas from there, so a resume only needs a fresh sender and engine.
        sync_mode = t.sync_mode
        if sync_mode != "off":
            dtype = SYNC_DTYPES[config.sync.dtype]
            sender = sync.SyncSender(sync_mode, params, sketch=t.sketch,
                                     train_others=t.train_others, dtype=dtype)
            engine = sync.RolloutEngine(t.policy, params, t.rollout_shardings, mode=sync_mode,
                                        sketch=t.sketch, train_others=t.train_others,
                                        master_copy=config.sync.master_copy, dtype=dtype,
                                        temperature=rl.temperature)
        writer = metrics_lib.MetricsWriter(self.workdir, total_steps=config.max_steps, start_step=step,
                                           tensorboard=config.log.tensorboard,
                                           progress=config.log.progress)
        base_rng = jax.random.PRNGKey(config.seed)
        last: dict[str, Any] = {}
        while step < config.max_steps:
            step += 1
            times = {}
            rng = jax.random.fold_in(base_rng, step)  # a pure function of the step: resume-exact

            # 1. Rollout with the current weights.
            tic = time.perf_counter()
            examples = data.next()
            if sync_mode == "off":
                ro = collect_rollouts(t.sampler, params, t.tokenizer, examples, rl, config.data,
                                      rng, t.batch_sharding)
            else:  # the engine's weights, on its devices; then the batch moves to the trainer
                ro = collect_rollouts(t.sampler, engine.params, t.tokenizer, examples, rl,
                                      config.data, rng, t.rollout_batch_sharding)
                ro.seqs, ro.rollout_logp, ro.completed = jax.device_put(
                    (ro.seqs, ro.rollout_logp, ro.completed), t.batch_sharding)
            times["time/rollout"] = time.perf_counter() - tic

            # 2. Rewards and advantages.
            tic = time.perf_counter()
            r = score(ro.texts, ro.golds, rl)
            adv, baseline = t.advantages(r, baseline)
            times["time/reward"] = time.perf_counter() - tic

            # 3. Reference log-probs (skipped when beta = 0).
            tic = time.perf_counter()
            ref_logp = (t._ref_logprobs(ref_params, ro.seqs) if ref_params is not None
                        else jnp.zeros_like(ro.rollout_logp))
            times["time/reference"] = time.perf_counter() - tic

            # 4. Policy update.
            tic = time.perf_counter()
            batch = TrainBatch(seqs=ro.seqs, advantages=jax.device_put(adv, t.batch_sharding),
                               rollout_logp=ro.rollout_logp, ref_logp=ref_logp, completed=ro.completed)
            # k of this update's A, read before the step donates opt_state.
            k = int(update_index(opt_state)) if sync_mode == "factors" else None
            params, opt_state, update_metrics, *low_rank = t.update(params, opt_state, batch)
            update_metrics = jax.device_get(update_metrics)
            times["time/update"] = time.perf_counter() - tic

            # 5. Sync the rollout engine (mode "off": it reads the trainer's params directly).
            tic = time.perf_counter()
            if sync_mode != "off":
                probe = jax.tree.map(lambda x: x[:config.optimizer.probe_size], ro.seqs)
                update_metrics.update(sync.sync_step(
                    sender, engine, params, updates=low_rank[0] if low_rank else None,
                    update_index=k, probe=probe))
            times["time/sync"] = time.perf_counter() - tic
            lengths = np.asarray(ro.seqs.completion_mask).sum(axis=1)
            row = dict(update_metrics,
                       reward=float(r.mean()), reward_std=float(r.std()),
                       accuracy=float(np.mean(r >= 1.0)),
                       **{"completions/mean_length": float(lengths.mean()),
                          "completions/clipped_ratio": float(1.0 - np.asarray(ro.completed).mean())},
                       **times)
            if t.sketch is not None:
                row.update(jax.device_get(logra_metrics(opt_state)))
            row["learning_rate"] = float(warmup_constant(config.optimizer.learning_rate,
                                                         config.optimizer.warmup_steps)(step - 1))
            row["time/step"] = sum(times.values())
            last = writer.write(step, row)
            if config.log.sample_every and step % config.log.sample_every == 0:
                logging.info("step %d sample: %r → reward %.2f", step, ro.texts[0], r[0])

            if step % config.checkpoint.every == 0 or step == config.max_steps:
                ckpt.save(step, (params, opt_state),
                          {"step": step, "baseline": baseline, "data": data.state()})
        writer.close()
        self.params, self.opt_state = params, opt_state
        self.engine = engine if sync_mode != "off" else None
        return last

    def close(self) -> None:
        self.ckpt.close()


def train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict[str, Any]:
    """Runs (or resumes) the job; returns the last step's metrics."""
    run = Run(config, workdir)
    try:
        return run.loop()
    finally:
        run.close()
