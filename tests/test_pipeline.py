"""The pipelined loop (rl.max_lag = η, logra_jax/rl/pipeline.py) on the tiny config, colocated:
η = 0 is the sequential loop, step for step; with η = 1 each step trains on rollouts sampled by
the weights of one update earlier (the initial ones at step 1), an exact resume (after a real
SIGTERM too) holds the queued rollouts, and a resume with another η is refused by name."""

import os
import shutil
import signal

import jax
import numpy as np
import pytest

from launch import train as train_cli
from logra_jax import metrics
from logra_jax.rl import assembly
from logra_jax.rl import trainer as trainer_lib
from logra_jax.rl.rollout import RewardError, collect_rollouts
from logra_jax.rl.update import TrainBatch
from tiny_config import flat_params, tiny_config

# configs/tiny.py as shipped: REINFORCE, whose updates are never zero (its failure reward), so a
# rollout sampled by the wrong weights shows in the weights.
STEPS = 3


def _config(lag, extra=None):
    return tiny_config(dict(max_steps=STEPS, rl=dict(max_lag=lag),
                            checkpoint=dict(every=1, keep=STEPS)), extra or {})


@pytest.fixture(scope="module")
def parts(shipped_tiny_parts):
    """Compiled parts per lag: at 0 the session's (rl.max_lag = 0 is configs/tiny.py's own); the
    loss reads rl.max_lag (η ≥ 1 adds importance_weight/max), so 1 has its own."""
    return {0: shipped_tiny_parts, 1: assembly.build_run(_config(1))}


def _train(config, workdir, parts):
    run = trainer_lib.Run(config, workdir, parts=parts)
    try:
        run.loop()
    finally:
        run.close()
    return run


@pytest.fixture(scope="module")
def lagged(parts, tmp_path_factory):
    """An uninterrupted η = 1 run, checkpointed after every step."""
    return _train(_config(1), tmp_path_factory.mktemp("lagged"), parts[1])


def test_lag_0_is_the_sequential_loop_bit_for_bit(parts, tmp_path):
    """η = 0 against the loop written out here as it was before the pipeline: sample with the
    current weights, grade, update, sync; every update metric and the final weights equal."""
    t, config = parts[0], _config(0)
    run = _train(config, tmp_path / "run", t)
    rows = metrics.read_jsonl(tmp_path / "run" / "metrics.jsonl")

    ref = trainer_lib.Run(config, tmp_path / "reference", parts=t)
    try:
        params, opt_state = t.init_state()
        source, baseline = t.rollout_source(params), 0.0
        base_rng = jax.random.PRNGKey(config.seed)
        for step in range(1, STEPS + 1):
            ro = collect_rollouts(t.sampler, source.weights, t.tokenizer, ref.data.next(),
                                  t.rollout_spec, jax.random.fold_in(base_rng, step),
                                  source.batch_sharding)
            ro.seqs, ro.rollout_logp, ro.completed, ro.token_steps = jax.device_put(
                (ro.seqs, ro.rollout_logp, ro.completed, ro.token_steps), t.batch_sharding)
            r = np.asarray(t.grader(ro.texts, ro.golds))
            adv, baseline = t.advantages(r, baseline)
            batch = TrainBatch(seqs=ro.seqs, advantages=jax.device_put(adv, t.batch_sharding),
                               rollout_logp=ro.rollout_logp, ref_logp=t.reference_logprobs(ro),
                               completed=ro.completed)
            params, opt_state, got, *compact = t.update(params, opt_state, batch)
            got = jax.device_get(got)
            got.update(source.after_update(params, compact[0] if compact else None,
                                           jax.tree.map(lambda x: x[:config.optimizer.probe_size],
                                                        ro.seqs)))
            row = rows[step - 1]
            want = trainer_lib.step_row(t, step, got, r, ro, opt_state, {})
            assert "rollout/lag" not in row and "importance_weight/max" not in row
            assert {k for k in row if not k.startswith("time/")} == set(want) - {"time/step"} | {"step"}
            for key, value in want.items():
                if key != "time/step":
                    assert row[key] == value or (np.isnan(row[key]) and np.isnan(value)), (step, key)
    finally:
        ref.close()
    a, b = flat_params(run.params), flat_params(params)
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=path)


def test_lag_1_trains_on_rollouts_one_update_old(lagged):
    rows = metrics.read_jsonl(lagged.workdir / "metrics.jsonl")
    assert [r["rollout/lag"] for r in rows] == [0] + [1] * (STEPS - 1)
    for r in rows:
        assert np.isfinite(r["importance_weight/max"]) and np.isfinite(r["rollout_mismatch"])
    # From step 2 on the sampler's weights are one update behind the trained ones: ratios ≠ 1.
    assert all(r["importance_weight/max"] > 1 for r in rows[1:])


def _until(lagged, step, workdir):
    """``workdir`` as ``lagged``'s (a finished Run) was after ``step``."""
    shutil.copytree(lagged.workdir, workdir)
    for later in (workdir / "checkpoints").iterdir():
        if later.name.isdigit() and int(later.name) > step:
            shutil.rmtree(later)
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    (workdir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[:step]))


def _assert_sampled_by_its_schedule(t, config, lagged, tmp_path):
    """After step 1 the queue holds R_2, which the schedule samples with version 0 (the initial
    weights), not version 1 (the weights after step 1): resampling step 2's prompts with the same
    rng and version 0, as the sampler holds it, gives its tokens and log-probs bit for bit;
    version 1 gives other log-probs."""
    _until(lagged, 1, tmp_path / "w")
    run = trainer_lib.Run(config, tmp_path / "w", parts=t)
    try:
        version_1, _, step, _ = run._start()          # restores the weights and the queue
        assert step == 1 and len(run.queue) == 1
        queued = run.queue.pop()
        assert queued.version == 0
        fresh = trainer_lib.Run(config, tmp_path / "fresh", parts=t)
        try:
            fresh.data.next()                     # R_1's prompts
            prompts = fresh.data.next()           # R_2's
        finally:
            fresh.close()
        rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), 2)
        for params, same in ((t.init_state()[0], True), (version_1, False)):
            source = t.rollout_source(params)     # the weights as the sampler holds them
            ro = collect_rollouts(t.sampler, source.weights, t.tokenizer, prompts,
                                  t.rollout_spec, rng, source.batch_sharding)
            logp_equal = np.array_equal(np.asarray(ro.rollout_logp),
                                        np.asarray(queued.rollouts.rollout_logp))
            assert logp_equal == same
            if same:
                np.testing.assert_array_equal(np.asarray(ro.seqs.tokens),
                                              np.asarray(queued.rollouts.seqs.tokens))
    finally:
        run.close()


def test_the_queued_rollout_was_sampled_by_the_weights_of_its_schedule(parts, lagged, tmp_path):
    _assert_sampled_by_its_schedule(parts[1], _config(1), lagged, tmp_path)


def test_on_rollout_devices_of_its_own_the_schedule_holds_and_the_engine_stays_exact(tmp_path):
    """4 devices train, 4 sample, synced by factors: the sampling of the next rollout is queued
    on the rollout devices before the update and the factors' merge into the same engine
    buffers, yet R_2 is version 0's, bit for bit, and the engine ends on the trainer's weights."""
    config = _config(1, dict(max_steps=2, sync=dict(mode="factors", rollout_devices=4,
                                                    master_copy=True)))
    run = _train(config, tmp_path / "split", None)
    t = run.parts
    assert {d.id for d in t.mesh.devices.flat}.isdisjoint(d.id for d in t.rollout_mesh.devices.flat)
    rows = metrics.read_jsonl(tmp_path / "split" / "metrics.jsonl")
    assert [r["rollout/lag"] for r in rows] == [0, 1]
    engine, trainer = flat_params(run.engine.params), flat_params(run.params)
    for path in engine:
        np.testing.assert_array_equal(engine[path], trainer[path].astype(engine[path].dtype),
                                      err_msg=path)
    _assert_sampled_by_its_schedule(t, config, run, tmp_path)


def _assert_same_end(want, got, workdir):
    a, b = flat_params(want.params), flat_params(got.params)
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=path)
    assert jax.tree.all(jax.tree.map(np.array_equal, jax.device_get(want.opt_state),
                                     jax.device_get(got.opt_state)))
    rows = zip(metrics.read_jsonl(want.workdir / "metrics.jsonl"),
               metrics.read_jsonl(workdir / "metrics.jsonl"), strict=True)
    for w, g in rows:
        assert {k: v for k, v in w.items() if not k.startswith("time/")} == \
               {k: v for k, v in g.items() if not k.startswith("time/")}


def test_a_resume_mid_pipeline_is_bit_identical(parts, lagged, tmp_path):
    """Stopped after step 1 with R_2 queued (sampled by the initial weights, which no checkpoint
    holds), then resumed: the same weights, optimizer state and metrics as the uninterrupted run.
    (After step 2, through a real SIGTERM: the test below.)"""
    _until(lagged, 1, tmp_path / "w")
    _assert_same_end(lagged, _train(_config(1), tmp_path / "w", parts[1]), tmp_path / "w")


def test_a_sigterm_with_a_rollout_in_flight_then_a_resume_is_bit_identical(parts, lagged, tmp_path,
                                                                           monkeypatch):
    """A real SIGTERM to this process while step 2 grades the rollout it sampled for step 3 (the
    third grading: R_1 before step 1, R_2 in step 1, R_3 in step 2): the step finishes, its
    checkpoint holds R_3, and the resume ends on the uninterrupted run's bits."""
    t, graded = parts[1], []
    grader = t.grader

    def signalling(texts, golds):
        graded.append(len(texts))
        if len(graded) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return grader(texts, golds)
    monkeypatch.setattr(t, "grader", signalling)
    config = _config(1, dict(checkpoint=dict(every=1000, keep=1)))
    with pytest.raises(trainer_lib.Preempted, match="after step 2"):
        _train(config, tmp_path, t)
    monkeypatch.setattr(t, "grader", grader)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]
    _assert_same_end(lagged, _train(config, tmp_path, t), tmp_path)


def test_a_resume_with_another_lag_is_one_error_line_naming_it(lagged, tmp_path):
    _until(lagged, 1, tmp_path / "w")
    with pytest.raises(SystemExit) as exit_:
        train_cli.run(_config(2), str(tmp_path / "w"))
    line = exit_.value.code
    assert isinstance(line, str) and line.startswith("error: ") and "\n" not in line, line
    assert "rl.max_lag changed" in line, line


def test_a_reward_error_on_a_rollout_graded_ahead_names_the_step_it_was_for(parts, tmp_path,
                                                                            monkeypatch):
    """The third grading (R_3, graded during step 2 under η = 1) raises: the error names step 3,
    whose rollout it was, and the step it was graded in; nothing is left behind."""
    t, graded = parts[1], []
    grader = t.grader

    def failing(texts, golds):
        graded.append(len(texts))
        if len(graded) == 3:
            raise RewardError("reward function mine on the prompts raised KeyError: 'score'")
        return grader(texts, golds)
    monkeypatch.setattr(t, "grader", failing)
    with pytest.raises(RewardError) as caught:
        _train(_config(1, dict(checkpoint=dict(every=1000, keep=1))), tmp_path / "w", t)
    assert str(caught.value) == (
        "step 3 (its rollout, sampled ahead under rl.max_lag and graded during step 2): reward "
        "function mine on the prompts raised KeyError: 'score'")
    assert not (tmp_path / "w").exists()
