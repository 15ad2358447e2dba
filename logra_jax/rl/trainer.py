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

import contextlib
import pathlib
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from logra_jax import checkpoint as checkpoint_lib
from logra_jax import config as config_lib
from logra_jax import distributed, host_arrays, model_shapes
from logra_jax import metrics as metrics_lib
from logra_jax import sharding as sharding_lib
from logra_jax.models import Decoder
from logra_jax.optim import logra_metrics, skip_metrics
from logra_jax.optim.low_rank import all_finite
from logra_jax.rl import build, stopping, sync
from logra_jax.rl import workdir as workdir_lib
from logra_jax.rl.policy import Policy, Sequences
from logra_jax.rl.rollout import (Rollouts, RolloutSource, collect_rollouts, process_prompts,
                                  rollout_source)
from logra_jax.rl.update import TrainBatch


def uses_reference(rl: ml_collections.ConfigDict) -> bool:
    """Whether the loss reads the reference model's log-probs: GRPO's KL term, when beta > 0
    (REINFORCE has none, whatever beta says)."""
    return rl.algorithm == "grpo" and rl.beta > 0


class Trainer:
    """All long-lived objects of a run, built once from the config (jitted functions included)."""

    def __init__(self, config: ml_collections.ConfigDict):
        build.validate(config)
        distributed.check_joined(config.distributed)
        if jax.process_count() > 1 and config.sync.rollout_devices:
            raise ValueError(f"sync.rollout_devices={config.sync.rollout_devices} with "
                             f"{jax.process_count()} processes: a sampler on its own devices runs "
                             f"in one process only for now; colocate it (sync.rollout_devices=0)")
        self.config = config
        self.optimizer = build.build_optimizer(  # before the model: fails fast
            config.optimizer, replayed_merge=build.replays_merge(config))
        self.tx, self.sketch = self.optimizer.tx, self.optimizer.sketch
        train_devices, rollout_devices = sync.split_devices(config.sync.rollout_devices)
        self.mesh = build.build_mesh(config.mesh, train_devices)
        self.rollout_mesh = build.build_mesh(config.sync.rollout_mesh, rollout_devices)
        if (uneven := build.uneven_micro_batches(config.rl, self.mesh)) is not None:
            logging.warning(uneven)
        # Colocated, every sync is a local cast of the trainer's weights (sync.placed_mode).
        self.sync_mode = sync.placed_mode(config.sync.mode, not config.sync.rollout_devices)
        if self.sync_mode != config.sync.mode:
            logging.info("sync.mode=%s with a colocated sampler runs as a local cast of the trainer's "
                         "weights (exact, no master copy or mirror); sync.rollout_devices > 0 puts "
                         "the sampler on its own devices and sends %s", config.sync.mode,
                         config.sync.mode)
        model, self.tokenizer = build.build_model(config.model, self.mesh)
        self.policy = Policy(model, lora_scale=build.lora_scale(config.optimizer))
        params = build.with_adapters(config.optimizer, Policy.params_of(model))   # + LoRA's
        self.rollout_shardings = build.with_adapter_shardings(
            params, sync.rollout_shardings(model, self.rollout_mesh))
        del model
        # The devices hold one copy of the weights during training: the policy's. The initial
        # weights (the start of every Run of this Trainer) wait on the host, and the frozen
        # reference is kept only when the loss uses it (`uses_reference`), in the compute dtype:
        # every layer casts its weights to that dtype anyway, so its log-probs are unchanged (fp32
        # master weights would cost 4 instead of 2 bytes per parameter at bf16 compute).
        self.param_shardings = jax.tree.map(lambda x: x.sharding, params)
        self._initial = host_arrays.HostShards(params)  # each process: its own shards only
        compute = jnp.dtype(config.model.dtype)
        self.reference_params = (
            jax.jit(lambda p: jax.tree.map(lambda x: x.astype(compute) if jnp.issubdtype(
                x.dtype, jnp.floating) else x, p), out_shardings=self.param_shardings)(params)
            if uses_reference(config.rl) else None)
        self.update = build.build_policy_update(config, self.policy, optimizer=self.optimizer,
                                                return_updates=self.sync_mode == "factors")
        self.sampler = build.build_sampler(config.rl, self.policy, self.tokenizer)
        self.rollout_spec = build.build_rollout_spec(config)
        self.grader = build.build_grader(config.rl)
        self.advantages = build.build_advantages(config.rl)
        rows = config.data.prompts_per_step * config.rl.num_generations
        self.batch_sharding = sharding_lib.batch_sharding(self.mesh, rows)
        self.rollout_batch_sharding = sharding_lib.batch_sharding(self.rollout_mesh, rows)
        for batch_sharding in (self.batch_sharding, self.rollout_batch_sharding):  # whole groups
            process_prompts(batch_sharding, config.data.prompts_per_step, config.rl.num_generations)
        self._ref_logprobs = jax.jit(self._ref_logprobs_impl)
        self.params_finite = jax.jit(all_finite)
        self.weight_norm = jax.jit(optax.tree.norm)
        self.initial_norm = float(self.weight_norm(params))
        # Optimizer state sharded like the params it belongs to (RowAdam's v like the kernel's out
        # dim): jit(tx.init) alone puts every output on one device, since none depends on values.
        # LoRA's optimizer sees the adapters only (Optimizer.subtree).
        trained = (lambda p: p[self.optimizer.subtree]) if self.optimizer.subtree else (lambda p: p)
        self._init_opt = jax.jit(lambda p: self.tx.init(trained(p)),
                                 out_shardings=sharding_lib.opt_state_shardings(self.tx, trained(params)))
        del params

    def _ref_logprobs_impl(self, ref_params, seqs: Sequences):
        logp, _ = self.policy.completion_logprobs(ref_params, seqs, temperature=self.config.rl.temperature)
        return logp

    @property
    def initial_params(self):
        """The initial weights as numpy (one process: tests and tools read them)."""
        return self._initial.to_numpy()

    def init_state(self):
        """(params, opt_state) at the initial weights, on the training devices."""
        params = self._initial.to_devices(self.param_shardings)
        return params, self._init_opt(params)

    def rollout_source(self, params) -> RolloutSource:
        """Where rollouts are sampled from, starting at ``params`` (rollout.py)."""
        s = self.config.sync
        return rollout_source(
            self.sync_mode, params, policy=self.policy, shardings=self.rollout_shardings,
            batch_sharding=self.batch_sharding if self.sync_mode == "off" else self.rollout_batch_sharding,
            sketch=self.sketch, train_others=self.optimizer.train_others, master_copy=s.master_copy,
            dtype=s.dtype, temperature=self.config.rl.temperature)

    def reference_logprobs(self, ro: Rollouts) -> jax.Array:
        """log π_ref of the completions; zeros when beta = 0 (the loss then never reads them)."""
        if self.reference_params is None:
            return jnp.zeros_like(ro.rollout_logp)
        return self._ref_logprobs(self.reference_params, ro.seqs)


class Preempted(Exception):
    """The run stopped on SIGTERM or SIGINT after its step in progress, with a checkpoint saved;
    the same command resumes it. ``signum`` is the signal's number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


@contextlib.contextmanager
def _timed(times: dict[str, float], name: str):
    tic = time.perf_counter()
    yield
    times[name] = time.perf_counter() - tic


def step_row(t: Trainer, step: int, update_metrics, r: np.ndarray, ro: Rollouts, opt_state,
             times: dict[str, float]) -> dict[str, Any]:
    """The metrics row of one step: the update's, the rollouts', the optimizer's and the clocks;
    ``r``: every row's reward. The same on every process."""
    mask, completed = host_arrays.to_host((ro.seqs.completion_mask, ro.completed))
    lengths = mask.sum(axis=1)
    row = dict(update_metrics, reward=float(r.mean()), reward_std=float(r.std()),
               accuracy=float(np.mean(r >= 1.0)),
               **{"completions/mean_length": float(lengths.mean()),
                  "completions/clipped_ratio": float(1.0 - completed.mean())},
               **times)
    row.update(jax.device_get(logra_metrics(opt_state) if t.sketch is not None
                              else skip_metrics(opt_state)))
    row["learning_rate"] = float(t.optimizer.learning_rate(step - 1))
    row["time/step"] = sum(times.values())
    return row


def check_with_shapes(config: ml_collections.ConfigDict) -> None:
    """The checks that need the model's parameters (targets that match nothing or no matrix,
    ranks against widths, LoRA's adapters) on abstract shapes made from the model's config alone
    (`build.build_model_config`: a Hugging Face config.json or a GGUF header, no weights): the
    optimizer's init is traced, nothing is allocated."""
    if model_shapes.is_shape_source(config.model.source):
        return   # a plan without weights: build_model refuses it, naming launch.memory
    model_config = build.build_model_config(config.model)
    if model_config is None:
        return
    optimizer = build.build_optimizer(config.optimizer, replayed_merge=build.replays_merge(config))
    model = nnx.eval_shape(lambda: Decoder(model_config, rngs=nnx.Rngs(0)))
    try:
        params = build.with_adapters(config.optimizer, Policy.params_of(model))
        jax.eval_shape(optimizer.tx.init, params[optimizer.subtree] if optimizer.subtree else params)
    except ValueError as e:   # the optimizer's own message, with the section it comes from
        section = f"optimizer.{config.optimizer.name}"
        message = str(e).replace("lower rank", f"lower {section}.rank")
        rank = config.optimizer[config.optimizer.name].get("rank")
        given = f" ({section}.rank={rank})" if rank is not None and "rank" in message else ""
        raise ValueError(f"{section} on this model{given}: {message}") from None


# What `Run._steps` saves beside the arrays: the step, REINFORCE's running baseline, the data
# position; and the fingerprint of the config that trained it (`config.fingerprint`), which a
# resume is checked against (checkpoints written before it was added have none).
LOOP_META = ("step", "baseline", "data")
CONFIG_META = "config"


def _loop_meta(meta: dict, where: pathlib.Path) -> tuple[int, float, Any]:
    """(step, baseline, data state) of a checkpoint's meta; ValueError naming the checkpoint when
    any is missing (a checkpoint this loop did not write, or one edited by hand)."""
    missing = [key for key in LOOP_META if key not in meta]
    if missing:
        raise ValueError(f"checkpoint {where} has no {', '.join(missing)} in its meta (written by "
                         f"something other than this trainer, or edited); move it out of "
                         f"{where.parent} to resume from an earlier one")
    return meta["step"], meta["baseline"], meta["data"]


class Run:
    """One training run in a workdir: everything built (errors in the config surface here), then
    `loop()` trains to ``max_steps``, resuming from the latest complete checkpoint; `close()` ends
    it. From construction to `close()` the run holds the workdir's lock (logra_jax/rl/workdir.py).

    ``fresh``: start over in a workdir that holds an earlier run, which is moved into
    ``previous-<time>/`` once everything else is built (a run that fails to build moves nothing);
    without it such a workdir is resumed, or refused when the run cannot continue it (another
    config, or metrics without a checkpoint).

    A run that ends before its first step (refused, failed, or stopped by a signal) leaves the
    workdir as it found it: the entries it created are removed, and so is a workdir it created.

    ``rl.decode_weights="auto"`` becomes the decode program the sampler picks by timing both on the
    first rollout; the run records that pick (config.json, each checkpoint's fingerprint) and a
    resumed process runs it again instead of timing: the two programs round differently, so a
    pick that changed with the machine's load would change the run's numbers."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
                 trainer: Trainer | None = None, fresh: bool = False):
        self.config = config
        self._fingerprint = config_lib.fingerprint(config)   # recorded in every checkpoint
        self._lock = self.ckpt = None
        self._created_root = None   # the outermost folder of the workdir's path this run created
        self._present: set[str] | None = None   # the history entries there before this run
        self._trained = False       # a step of this run reached metrics.jsonl
        self._restored = False      # the run continues a checkpoint
        self._decode_mode: str | None = None    # the sampler's resolved decode program
        self._config_recorded = False
        self.summary: str | None = None   # `loop`'s one line of what it trained (process 0)
        # What can be checked in a moment is checked before the model is built, and before
        # anything in the workdir is written.
        build.validate(config)
        if trainer is None:   # a given Trainer was built from a config that passed them
            check_with_shapes(config)
        self._created_root = workdir_lib.missing_root(workdir)
        self.workdir = workdir_lib.prepare(workdir)
        try:
            if distributed.is_primary():   # one lock per run, not per process
                self._lock = workdir_lib.WorkdirLock(self.workdir)
                self._lock.acquire()
            source = build.build_prompt_source(config.data)   # the data files: bad input first
            self._open_history(fresh)
            # A Trainer holds compiled functions; runs of one config (e.g. a resumed run) may share it.
            self.trainer = trainer if trainer is not None else Trainer(config)
            self.data = build.build_data(config.data, config.seed, source=source,
                                         tokenizer=self.trainer.tokenizer,
                                         rollout_spec=self.trainer.rollout_spec)
            if fresh:   # everything that could fail has been built: now the earlier run moves
                self._set_aside()
            self._present = workdir_lib.present(self.workdir)
            if self.ckpt is None:
                self.ckpt = self._checkpointer()
        except BaseException:
            self.close()
            raise

    def _open_history(self, fresh: bool) -> None:
        """Refuses a run that cannot continue the workdir's history; ``fresh`` checks instead that
        the history can be moved aside whole (the move itself waits until the run is built); the
        checkpointer of the checkpoints it holds, if any."""
        if fresh:
            if distributed.is_primary():
                workdir_lib.check_set_aside(self.workdir)
            self._history = None
            return
        self._history = workdir_lib.History(self.workdir)
        if (self.workdir / workdir_lib.CHECKPOINTS).exists():
            self.ckpt = self._checkpointer()
        self._history.check_continues(self.config, self._recorded_configs())

    def _set_aside(self) -> None:
        if distributed.is_primary():
            aside = workdir_lib.set_aside(self.workdir)
            if aside is not None:
                logging.info("--fresh: the earlier run of %s is now in %s", self.workdir, aside)
        distributed.barrier("workdir history set aside")

    def _recorded_configs(self) -> dict[int, dict | None]:
        """{step: the config fingerprint checkpoint ``step`` records (None: none)} of every
        checkpoint whose meta can be read; a damaged one is `_start`'s to set aside."""
        recorded = {}
        for step in self.ckpt.all_steps() if self.ckpt else []:
            try:
                meta = self.ckpt.read_meta(step)
            except Exception:  # noqa: BLE001  orbax raises many kinds for a damaged folder
                continue
            recorded[step] = meta.get(CONFIG_META)
        return recorded

    def _checkpointer(self) -> checkpoint_lib.Checkpointer:
        """The checkpoints' folder is created by the first save: a run that ends before it leaves
        none."""
        return checkpoint_lib.Checkpointer(self.workdir / workdir_lib.CHECKPOINTS,
                                           keep=self.config.checkpoint.keep)

    def _start(self):
        """(params, opt_state, step, baseline): the newest intact checkpoint, else the start. The
        workdir's config.json is written only once that is known: a run refused or failed before
        here leaves the config.json of the run it would have continued as it was."""
        params, opt_state = self.trainer.init_state()
        latest = self.ckpt.restore_latest((params, opt_state))
        if latest is None:
            return params, opt_state, 0, 0.0
        saved, (params, opt_state), meta = latest
        self._restored = True
        where = self.ckpt.directory / str(saved)
        step, baseline, data_state = _loop_meta(meta, where)
        # History checked every readable checkpoint; this is the one restored, read whole.
        workdir_lib.check_checkpoint_config(meta.get(CONFIG_META), where, self.config)
        self.data.restore(data_state)
        self._keep_decode_mode(config_lib.recorded_decode_mode(meta.get(CONFIG_META))
                               or config_lib.recorded_decode_mode(self._history and
                                                                  self._history.config))
        logging.info("resumed from %s at step %d", self.ckpt.directory, step)
        # A resume keeps the config.json it started with (History checked that only keys a resume
        # may change differ); one whose config.json was lost writes it again, from this config.
        self._config_recorded = (self.workdir / workdir_lib.CONFIG).exists()
        self._record_config()
        return params, opt_state, step, baseline

    def _keep_decode_mode(self, recorded: str | None) -> None:
        """A resumed run samples with the decode program its first process picked (``recorded``),
        without timing the two again, when ``rl.decode_weights`` is "auto"; a fixed mode that
        differs is the user's choice, said once."""
        if recorded is None:
            return
        asked = self.config.rl.decode_weights
        if asked == "auto":
            self.trainer.sampler.preset_decode_mode(recorded)
            self._decode_mode = recorded
            self._fingerprint[config_lib.DECODE_KEY] = recorded
        elif asked != recorded:
            logging.warning("rl.decode_weights=%s, but this run's earlier steps sampled with %s: "
                            "the two programs round differently, so the resumed steps will not be "
                            "the bits an uninterrupted run computes", asked, recorded)

    def _note_decode_mode(self) -> None:
        """After a rollout: the decode program the sampler ran, recorded once (a fresh run's
        "auto" resolves at its first rollout)."""
        if self._decode_mode is not None:
            return
        self._decode_mode = getattr(self.trainer.sampler, "last_decode_mode", None)
        if self._decode_mode is not None:
            self._fingerprint[config_lib.DECODE_KEY] = self._decode_mode

    def _record_config(self) -> None:
        """Writes config.json (process 0) unless the workdir holds this run's already: the config,
        with ``rl.decode_weights`` as the sampler resolved it."""
        if self._config_recorded or not distributed.is_primary():
            return
        recorded = config_lib.as_json(self.config)
        if self._decode_mode is not None:
            recorded["rl"]["decode_weights"] = self._decode_mode
        workdir_lib.write_config(self.workdir, recorded)
        self._config_recorded = True

    def loop(self) -> dict[str, Any]:
        """Trains to ``max_steps``; returns the last step's metrics row. On SIGTERM / SIGINT it
        finishes the step in progress, saves a checkpoint and raises `Preempted`."""
        config, t = self.config, self.trainer
        params, opt_state, step, baseline = self._start()
        self.summary = None
        if step >= config.max_steps:
            logging.warning("max_steps=%d is already reached: %s holds step %d; nothing to train "
                            "(raise max_steps to continue)", config.max_steps, self.workdir, step)
            self.params, self.opt_state, self.engine = params, opt_state, None
            return {}
        # factors/sparse messages are deltas from these weights: a resume builds a fresh source.
        rollouts = t.rollout_source(params)
        writer = metrics_lib.MetricsWriter(self.workdir, total_steps=config.max_steps, start_step=step,
                                           tensorboard=config.log.tensorboard,
                                           progress=config.log.progress,
                                           files=distributed.is_primary(),
                                           kl_measured=uses_reference(config.rl))
        base_rng = jax.random.PRNGKey(config.seed)
        try:
            with stopping.deferred() as stop:
                last, step, params, opt_state, stopped = self._steps(
                    stop, step, params, opt_state, baseline, rollouts, writer, base_rng)
        finally:
            writer.close()
        self.params, self.opt_state = params, opt_state
        self.engine = getattr(rollouts, "engine", None)
        trained = writer.summary()
        if trained is not None and distributed.is_primary():
            latest = self.ckpt.latest_step()
            self.summary = f"{trained}; checkpoint {latest} in {self.ckpt.directory}"
        if stopped:
            signum = stop.signum or signal.SIGTERM  # another process was the one signalled
            how = (f"by {signal.Signals(signum).name}" if stop.signum else
                   "because another process was stopped")
            raise Preempted(f"stopped {how} after step {step}; checkpoint {step} is in "
                            f"{self.ckpt.directory}, and the same command resumes from it", signum)
        return last

    def _steps(self, stop, step, params, opt_state, baseline, rollouts, writer, base_rng):
        """The steps from ``step`` to max_steps (or to a stop request on any process): the five of
        the docstring. Returns (last row, step, params, opt_state, stopped)."""
        config, t, data, ckpt = self.config, self.trainer, self.data, self.ckpt
        last: dict[str, Any] = {}
        skipped_in_a_row = 0
        stopped = False
        while step < config.max_steps and not stopped:
            step += 1
            times: dict[str, float] = {}
            rng = jax.random.fold_in(base_rng, step)  # a pure function of the step: resume-exact

            # 1. Rollout with the sampler's weights, on its devices; the batch then moves to ours.
            with _timed(times, "time/rollout"):
                ro = collect_rollouts(t.sampler, rollouts.weights, t.tokenizer, data.next(),
                                      t.rollout_spec, rng, rollouts.batch_sharding)
                ro.seqs, ro.rollout_logp, ro.completed = jax.device_put(
                    (ro.seqs, ro.rollout_logp, ro.completed), t.batch_sharding)

            # 2. Rewards (each process grades its own rows) and advantages (from every row's:
            #    a GRPO group is whole, REINFORCE's baseline sees the whole batch).
            with _timed(times, "time/reward"):
                r = host_arrays.to_host(host_arrays.from_process_rows(
                    t.grader(ro.texts, ro.golds), rollouts.batch_sharding, len(ro.rollout_logp)))
                adv, baseline = t.advantages(r, baseline)  # REINFORCE: baseline updated after use

            # 3. Reference log-probs (zeros when beta = 0).
            with _timed(times, "time/reference"):
                ref_logp = t.reference_logprobs(ro)

            # 4. Policy update (params and opt_state are donated).
            with _timed(times, "time/update"):
                batch = TrainBatch(seqs=ro.seqs, advantages=jax.device_put(adv, t.batch_sharding),
                                   rollout_logp=ro.rollout_logp, ref_logp=ref_logp,
                                   completed=ro.completed)
                params, opt_state, update_metrics, *compact = t.update(params, opt_state, batch)
                update_metrics = jax.device_get(update_metrics)

            # 5. The new weights reach the sampler; log; checkpoint.
            with _timed(times, "time/sync"):
                probe = jax.tree.map(lambda x: x[:config.optimizer.probe_size], ro.seqs)
                update_metrics.update(rollouts.after_update(params, compact[0] if compact else None,
                                                            probe))
            self._note_decode_mode()
            self._record_config()   # a fresh run's config.json: with the decode program it ran
            last = writer.write(step, step_row(t, step, update_metrics, r, ro, opt_state, times))
            self._trained = True
            if config.log.sample_every and step % config.log.sample_every == 0:
                logging.info("step %d sample: %r → reward %.2f", step, ro.texts[0], r[ro.rows.start])
            skipped_in_a_row = self._check_divergence(step, last, params, skipped_in_a_row)
            stopped = distributed.any_process(stop.signum is not None)
            if step % config.checkpoint.every == 0 or step == config.max_steps or stopped:
                ckpt.save(step, (params, opt_state),
                          {**dict(zip(LOOP_META, (step, baseline, data.state()))),
                           CONFIG_META: self._fingerprint})
        return last, step, params, opt_state, stopped

    def _check_divergence(self, step: int, row: dict, params, skipped_in_a_row: int) -> int:
        """Counts updates dropped as non-finite (the weights stayed as they were) and stops the run
        after ``optimizer.max_consecutive_skips`` of them in a row, when the weights themselves are
        not finite, or when their norm has grown past ``optimizer.max_weight_norm_growth`` times
        the initial one (finite but exploding: lr = 1e6 multiplies it by ~1e6 in one step; RL
        post-training moves it by a few percent) — before any of them could reach a checkpoint.
        Returns the new count."""
        limit = self.config.optimizer.max_consecutive_skips
        latest = self.ckpt.latest_step()
        kept = f"the last checkpoint is step {latest}" if latest is not None else "no checkpoint yet"
        norm = float(self.trainer.weight_norm(params))
        if not np.isfinite(norm) and not bool(self.trainer.params_finite(params)):
            raise ValueError(f"step {step}: the weights are not finite (the run diverged); they were "
                             f"not saved, {kept}; lower the learning rate")
        growth = self.config.optimizer.max_weight_norm_growth
        if not norm <= growth * self.trainer.initial_norm:  # an fp32 overflow of the norm, too
            raise ValueError(f"step {step}: the weight norm grew to {norm:.4g}, "
                             f"{norm / self.trainer.initial_norm:.3g}× the initial "
                             f"{self.trainer.initial_norm:.4g} (the run diverged; "
                             f"optimizer.max_weight_norm_growth={growth}); the weights were not "
                             f"saved, {kept}; lower the learning rate")
        if not row.get("logra/skipped", row.get("skipped", False)):
            return 0
        skipped_in_a_row += 1
        logging.warning("step %d: the update was not finite and was skipped (weights unchanged); "
                        "%d in a row of at most %d", step, skipped_in_a_row, limit)
        if skipped_in_a_row >= limit:
            raise ValueError(f"{skipped_in_a_row} updates in a row were not finite (steps "
                             f"{step - skipped_in_a_row + 1}–{step}): the run diverged; {kept}; "
                             f"lower the learning rate (optimizer.max_consecutive_skips={limit})")
        return skipped_in_a_row

    def close(self) -> None:
        """Closes the checkpointer and releases the workdir (idempotent). A run that trained no
        step takes back what it created there: the workdir is as it found it."""
        if getattr(self, "ckpt", None) is not None:
            self.ckpt.close()
            self.ckpt = None
        unused = not self._trained and not self._restored and distributed.is_primary()
        if unused and self._present is not None:
            workdir_lib.remove_unused(self.workdir, self._present)
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if unused and getattr(self, "workdir", None) is not None:
            workdir_lib.remove_created(self.workdir, self._created_root)


def train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
          fresh: bool = False) -> dict[str, Any]:
    """Runs (or resumes) the job; returns the last step's metrics."""
    run = Run(config, workdir, fresh=fresh)
    try:
        return run.loop()
    finally:
        run.close()
