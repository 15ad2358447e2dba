"""The RL training loop: rollout → rewards → advantages → reference log-probs → policy update.

`Run(config, workdir)` is the job behind ``python -m launch.train``, which checks the config and
the workdir's path before jax is imported, builds the `Run` from that checked recipe, calls its
`loop` and `close`, and ends each anticipated error or signal as one line and an exit status.
`train(config, workdir)` is the same run for code (tests, launch.rl_step_time): `Run` (which then
checks the config itself), `loop` and `close`, its errors raised as they are.

`Run` reads top to bottom like the loop it runs (big_vision style): assemble the run's parts from
the config (rl/assembly.py), resume if the workdir holds a checkpoint (the workdir's side of a
run — lock, history, checkpoints, config.json, metrics writer, the decode program's record — is
rl/run_dir.py's `RunDir`), then per step

  1. take prompts from the data iterator and sample completions with the rollout engine,
  2. grade them (1 for the right final answer) and turn rewards into advantages (the algorithm's:
     GRPO group relative, REINFORCE outcome minus a running baseline),
  3. score the completions under the frozen reference model (when the algorithm's loss reads it),
  4. update the policy (`PolicyUpdate`: sketched gradients, LoGRA or AdamW, KL control),
  5. hand the new weights to the rollout engine, log metrics, checkpoint.

With ``rl.max_lag`` = η ≥ 1 the loop is pipelined (rl/pipeline.py): step k first queues the
sampling of the rollout for step k + η with the current weights, then trains on the rollout
sampled η updates earlier while the sampler works (on the rollout devices, when the run has them),
and decodes and grades the new rollout in between (host work beside the devices' work).
"""

from __future__ import annotations

import contextlib
import pathlib
import signal
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from logra_jax import distributed, host_arrays
from logra_jax.rl import assembly, build, stopping
from logra_jax.rl import pipeline as pipeline_lib
from logra_jax.rl import run_dir as run_dir_lib
from logra_jax.rl.assembly import RunParts
from logra_jax.rl.rollout import (RewardError, Rollouts, dispatch_rollouts, finish_rollouts,
                                  fit_prompt_window, work_metrics)
from logra_jax.rl.update import TrainBatch


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


def step_row(t: RunParts, step: int, update_metrics, r: np.ndarray, ro: Rollouts, opt_state,
             times: dict[str, float]) -> dict[str, Any]:
    """The metrics row of one step: the update's, the rollouts', the optimizer's and the clocks;
    ``r``: every row's reward. The same on every process."""
    mask, completed, token_steps = host_arrays.to_host(
        (ro.seqs.completion_mask, ro.completed, ro.token_steps))
    lengths = mask.sum(axis=1)
    row = dict(update_metrics, reward=float(r.mean()), reward_std=float(r.std()),
               accuracy=float(np.mean(r >= 1.0)),
               **{"completions/mean_length": float(lengths.mean()),
                  "completions/clipped_ratio": float(1.0 - completed.mean())},
               **work_metrics(mask, token_steps,
                              t.sampler.prefilled_rows(len(mask)) * ro.seqs.prompt_length),
               **times)
    row.update(jax.device_get(t.optimizer.metrics(opt_state)))
    row["learning_rate"] = float(t.optimizer.learning_rate(step - 1))
    row["time/step"] = sum(times.values())
    return row


class Run:
    """One training run in a workdir: everything built (errors in the config surface here), then
    `loop()` trains to ``max_steps``, resuming from the latest complete checkpoint; `close()` ends
    it. The workdir's side of the run (its lock from construction to `close()`, its history,
    checkpoints, config.json, metrics writer, and the record of the decode program) is its
    `RunDir` (logra_jax/rl/run_dir.py); this class builds the run's parts and drives the loop.

    ``fresh``: start over in a workdir that holds an earlier run, which is moved into
    ``previous-<time>/`` once everything else is built (a run that fails to build moves nothing);
    without it such a workdir is resumed, or refused when the run cannot continue it (another
    config, or metrics without a checkpoint).

    ``recipe``: ``config`` prepared already (`assembly.Recipe.of` of a config that passed
    `config.validate`), so it is not checked twice; default `assembly.Recipe.checked(config)`.

    A run that ends before its first step (refused, failed, or stopped by a signal) leaves the
    workdir as it found it: the entries it created are removed, and so is a workdir it created.

    ``rl.decode_weights="auto"`` becomes the decode program `decode_mode.rule` picks for the
    platform; the run records it (config.json, each checkpoint's fingerprint) and a resumed
    process runs the recorded one (a workdir written on another platform, or by an older version
    that timed its pick): the two programs round differently."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
                 parts: RunParts | None = None, fresh: bool = False,
                 recipe: assembly.Recipe | None = None):
        self.config = config
        self.run_dir: run_dir_lib.RunDir | None = None
        self.queue: pipeline_lib.RolloutQueue | None = None   # rollouts sampled ahead (max_lag ≥ 1)
        self.summary: str | None = None   # `loop`'s one line of what it trained (process 0)
        # What can be checked in a moment is checked before the model is built, and before
        # anything in the workdir is written.
        if recipe is None:   # given, the config was checked already (launch.train: before jax)
            recipe = assembly.Recipe.checked(config)
        if parts is None:   # given parts were built from a config that passed the shape checks
            recipe.check_shapes()
        # Creates the workdir, agrees with the other processes, takes the lock.
        self.run_dir = run_dir_lib.RunDir(config, workdir)
        self.workdir = self.run_dir.path
        try:
            source = build.build_prompt_source(config.data)   # the data files: bad input first
            # Every prompt fits the prompt window, checked with the tokenizer alone where it
            # comes without the weights (a refusal in a moment, not after the model is built).
            early = build.build_tokenizer(config.model)
            if early is not None:
                source = fit_prompt_window(source, early, build.build_rollout_spec(config),
                                           skip_long=config.data.skip_long_prompts)
            self.run_dir.open_history(fresh)
            # The parts hold compiled functions; runs of one config (e.g. a resumed run) may share them.
            self.parts = parts if parts is not None else recipe.build()
            self.data = build.build_data(config.data, config.seed, source=source,
                                         tokenizer=self.parts.tokenizer,
                                         rollout_spec=None if early else self.parts.rollout_spec)
            if fresh:   # everything that could fail has been built: now the earlier run moves
                self.run_dir.set_aside()
            self.run_dir.ready()
        except BaseException:
            self.close()
            raise

    @property
    def ckpt(self):
        """The run's checkpointer (`RunDir`'s); None once closed."""
        return self.run_dir.ckpt

    def _start(self):
        """(params, opt_state, step, baseline): the newest intact checkpoint, else the start. The
        workdir's config.json is written only once that is known: a run refused or failed before
        here leaves the config.json of the run it would have continued as it was."""
        params, opt_state = self.parts.init_state()
        lag = self.config.rl.max_lag
        self.queue = pipeline_lib.RolloutQueue(lag) if lag else None
        queue_meta = self.run_dir.queue_meta() if lag else None
        state = (params, opt_state)
        if queue_meta is not None:
            state += (pipeline_lib.RolloutQueue.target(queue_meta, self.parts.batch_sharding),)
        restored = self.run_dir.restore(state)
        if restored is None:
            return params, opt_state, 0, 0.0
        params, opt_state, *queued = restored.state
        self.data.restore(restored.data_state)
        if self.queue is not None:
            self.queue.restore(queued[0], restored.meta[pipeline_lib.QUEUE_META],
                               self.parts.batch_sharding, self.parts.tokenizer,
                               self.parts.sampler.eos_ids)
        self.run_dir.keep_decode_mode(restored.meta, self.parts.sampler)
        logging.info("resumed from %s at step %d", self.ckpt.directory, restored.step)
        self.run_dir.resumed()
        return params, opt_state, restored.step, restored.baseline

    def loop(self) -> dict[str, Any]:
        """Trains to ``max_steps``; returns the last step's metrics row. On SIGTERM / SIGINT it
        finishes the step in progress, saves a checkpoint and raises `Preempted`."""
        config, t = self.config, self.parts
        params, opt_state, step, baseline = self._start()
        self.run_dir.agree("the first step", step=step, data=self.data.state())
        self.summary = None
        if step >= config.max_steps:
            logging.warning("max_steps=%d is already reached: %s holds step %d; nothing to train "
                            "(raise max_steps to continue)", config.max_steps, self.workdir, step)
            self.params, self.opt_state, self.engine = params, opt_state, None
            return {}
        # factors/sparse messages are deltas from these weights: a resume builds a fresh source.
        rollouts = t.rollout_source(params)
        writer = self.run_dir.metrics_writer(step, kl_measured=t.reference_params is not None)
        base_rng = jax.random.PRNGKey(config.seed)
        if config.rl.max_lag and not config.sync.rollout_devices:
            logging.info("rl.max_lag=%d with sync.rollout_devices=0: the sampler shares the "
                         "trainer's devices, so nothing overlaps; the run is %d step(s) off-policy "
                         "all the same", config.rl.max_lag, config.rl.max_lag)
        try:
            with stopping.deferred() as stop:
                last, step, params, opt_state, stopped = self._steps(
                    stop, step, params, opt_state, baseline, rollouts, writer, base_rng)
        except RewardError as e:   # the step in progress: the last written one's next
            writer.close()
            self.run_dir.forget_steps_without_checkpoint()
            current = (writer.rows[-1]["step"] if writer.rows else writer.start_step) + 1
            ahead = getattr(e, "step", None)   # a rollout graded ahead names its own step
            where = (f"step {current}" if ahead in (None, current) else
                     f"step {ahead} (its rollout, sampled ahead under rl.max_lag and graded "
                     f"during step {current})")
            raise RewardError(f"{where}: {e}") from e.__cause__
        except BaseException:
            writer.close()
            self.run_dir.forget_steps_without_checkpoint()
            raise
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
        config, t, data, ckpt = self.config, self.parts, self.data, self.ckpt
        lag, queue = config.rl.max_lag, self.queue
        last: dict[str, Any] = {}
        skipped_in_a_row = 0
        stopped = False
        if queue is not None:   # a fresh run: R_1 … R_η, sampled by the initial weights
            while len(queue) < lag:
                index = step + 1 + len(queue)
                queue.push(self._graded(self._dispatch(index, rollouts, base_rng), rollouts,
                                        version=step, index=index))
        while step < config.max_steps and not stopped:
            step += 1
            times: dict[str, float] = {}

            if queue is None:
                # 1. Rollout with the sampler's weights, on its devices; the batch then moves to
                #    ours. 2. Rewards (each process grades its own rows).
                with _timed(times, "time/rollout"):
                    pending = self._dispatch(step, rollouts, base_rng)
                    ro = self._finished(pending)
                with _timed(times, "time/reward"):
                    r = self._rewards(ro, rollouts)
                    adv, baseline = t.advantages(r, baseline)  # REINFORCE: updated after use
            else:
                # 1. The rollout for step + η is queued on the sampler with the current weights
                #    (version step − 1); this step trains on the oldest queued one.
                with _timed(times, "time/rollout"):
                    ahead = self._dispatch(step + lag, rollouts, base_rng)
                    trained = queue.pop()
                    ro, r = trained.rollouts, trained.rewards
                with _timed(times, "time/reward"):
                    adv, baseline = t.advantages(r, baseline)

            # 2. (cont.) Advantages are from every row's rewards: a GRPO group is whole,
            #    REINFORCE's baseline sees the whole batch.
            # 3. Reference log-probs (zeros when the algorithm reads none).
            with _timed(times, "time/reference"):
                ref_logp = t.reference_logprobs(ro)

            # 4. Policy update (params and opt_state are donated).
            with _timed(times, "time/update"):
                batch = TrainBatch(seqs=ro.seqs, advantages=jax.device_put(adv, t.batch_sharding),
                                   rollout_logp=ro.rollout_logp, ref_logp=ref_logp,
                                   completed=ro.completed)
                params, opt_state, update_metrics, *compact = t.update(params, opt_state, batch)
                if queue is None:
                    update_metrics = jax.device_get(update_metrics)
            if queue is not None:
                # While the devices sample and update: the queued rollout's text and rewards.
                with _timed(times, "time/overlap_host"):
                    queue.push(self._graded(ahead, rollouts, version=step - 1, index=step + lag))
                with _timed(times, "time/update_wait"):
                    update_metrics = jax.device_get(update_metrics)
                update_metrics["rollout/lag"] = trained.lag(step - 1)

            # 5. The new weights reach the sampler; log; checkpoint.
            with _timed(times, "time/sync"):
                probe = jax.tree.map(lambda x: x[:config.optimizer.probe_size], ro.seqs)
                update_metrics.update(rollouts.after_update(params, compact[0] if compact else None,
                                                            probe))
            self.run_dir.note_decode_mode(t.sampler)
            self.run_dir.record_config()   # a fresh run's config.json: with the decode program it ran
            last = writer.write(step, step_row(t, step, update_metrics, r, ro, opt_state, times))
            self.run_dir.trained = True
            if config.log.sample_every and step % config.log.sample_every == 0:
                logging.info("step %d sample: %r → reward %.2f", step, ro.texts[0], r[ro.rows.start])
            skipped_in_a_row = self._check_divergence(step, last, params, skipped_in_a_row)
            stopped = distributed.any_process(stop.signum is not None)
            if step % config.checkpoint.every == 0 or step == config.max_steps or stopped:
                self._save(step, params, opt_state, baseline)
        return last, step, params, opt_state, stopped

    def _dispatch(self, index: int, rollouts, base_rng):
        """Queues the sampling of the rollout step ``index`` trains on: the data's next prompts,
        the rng a pure function of ``index`` (resume-exact), the sampler's current weights."""
        t = self.parts
        rng = jax.random.fold_in(base_rng, index)
        return dispatch_rollouts(t.sampler, rollouts.weights, t.tokenizer, self.data.next(),
                                 t.rollout_spec, rng, rollouts.batch_sharding)

    def _finished(self, pending) -> Rollouts:
        """``pending``'s rollouts, decoded, their arrays moved to the trainer's batch layout."""
        t = self.parts
        ro = finish_rollouts(pending, t.tokenizer, t.sampler.eos_ids)
        ro.seqs, ro.rollout_logp, ro.completed, ro.token_steps = jax.device_put(
            (ro.seqs, ro.rollout_logp, ro.completed, ro.token_steps), t.batch_sharding)
        return ro

    def _rewards(self, ro: Rollouts, rollouts) -> np.ndarray:
        """Every row's reward (each process grades its own rows), on the host."""
        return host_arrays.to_host(host_arrays.from_process_rows(
            self.parts.grader(ro.texts, ro.golds), rollouts.batch_sharding, len(ro.rollout_logp)))

    def _graded(self, pending, rollouts, *, version: int, index: int) -> pipeline_lib.Queued:
        """The rollout step ``index`` trains on, finished and graded ahead of that step; a
        reward function's failure names ``index``, the step whose rollout it graded."""
        ro = self._finished(pending)
        try:
            return pipeline_lib.Queued(version, ro, self._rewards(ro, rollouts))
        except RewardError as e:
            e.step = index
            raise

    def _save(self, step: int, params, opt_state, baseline) -> None:
        """Checkpoint ``step``: the weights, the optimizer, the loop's meta and, with a lag, the
        queued rollouts (rl/pipeline.py)."""
        state, queued = (params, opt_state), {}
        if self.queue is not None:
            state += (self.queue.arrays(self.parts.batch_sharding),)
            queued[pipeline_lib.QUEUE_META] = self.queue.meta()
        self.run_dir.save(step, state, baseline, self.data.state(), queued)

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
        norm = float(self.parts.weight_norm(params))
        if not np.isfinite(norm) and not bool(self.parts.params_finite(params)):
            raise ValueError(f"step {step}: the weights are not finite (the run diverged); they were "
                             f"not saved, {kept}; lower the learning rate")
        growth = self.config.optimizer.max_weight_norm_growth
        if not norm <= growth * self.parts.initial_norm:  # an fp32 overflow of the norm, too
            raise ValueError(f"step {step}: the weight norm grew to {norm:.4g}, "
                             f"{norm / self.parts.initial_norm:.3g}× the initial "
                             f"{self.parts.initial_norm:.4g} (the run diverged; "
                             f"optimizer.max_weight_norm_growth={growth}); the weights were not "
                             f"saved, {kept}; lower the learning rate")
        if not row.get(self.parts.optimizer.skipped_key, False):
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
        """Closes the checkpointer and releases the workdir (idempotent): `RunDir.close`."""
        if self.run_dir is not None:
            self.run_dir.close()


def train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
          fresh: bool = False) -> dict[str, Any]:
    """Runs (or resumes) the job of ``launch.train`` without its one-line errors, signal exits and
    printed summary: `Run`, `Run.loop`, `Run.close`. Returns the last step's metrics row."""
    run = Run(config, workdir, fresh=fresh)
    try:
        return run.loop()
    finally:
        run.close()
