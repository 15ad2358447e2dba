"""A checkpoint records the config that trained it, so a resume with another config is refused by
name whether or not the workdir's config.json is still there, and config.json is rebuilt only
from a checkpoint whose config matches.

Each test copies the workdir of the session's 2-step tiny run (`trained_tiny_run`: seed 0,
checkpoint 2) and runs `launch.train`'s `run` on it in this process; a refusal comes before the
model is built, and a matching resume reuses the session's compiled RunParts.
"""

import copy
import hashlib
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from launch import train as train_cli
from logra_jax import config as config_lib
from logra_jax.rl import build
from logra_jax.rl import trainer as trainer_lib
from logra_jax.tree_paths import leaves_with_paths
from tiny_config import tiny_config


def _snapshot(workdir: pathlib.Path) -> dict[str, tuple[int, str] | None]:
    return {str(f.relative_to(workdir)): (f.stat().st_mtime_ns,
                                          hashlib.sha256(f.read_bytes()).hexdigest())
            if f.is_file() else None for f in sorted(workdir.rglob("*"))}


@pytest.fixture
def copied(trained_tiny_run, tmp_path) -> pathlib.Path:
    """A copy of the trained workdir, without its config.json."""
    workdir = tmp_path / "workdir"
    shutil.copytree(trained_tiny_run.workdir, workdir)
    (workdir / "config.json").unlink()
    return workdir


def _refused(config, workdir) -> str:
    before = _snapshot(workdir)
    with pytest.raises(SystemExit) as exit_:
        train_cli.run(config, str(workdir))
    line = exit_.value.code
    assert isinstance(line, str) and line.startswith("error: ") and "\n" not in line, line
    assert _snapshot(workdir) == before          # nothing written, config.json not rebuilt
    return line


def test_a_resume_with_another_seed_is_refused_without_config_json(copied):
    """Seed 0's checkpoint with config.json deleted: without the checkpoint's own record, a run
    with seed 1 would resume it and record seed 1 for a history trained with seed 0."""
    line = _refused(tiny_config(dict(max_steps=3, seed=1)), copied)
    assert f"checkpoint 2 in {copied / 'checkpoints'} was trained with another config" in line, line
    assert "seed 0 → 1" in line, line
    assert "--fresh" in line


def test_a_resume_with_another_optimizer_is_refused_before_the_model(copied, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the refusal")
    monkeypatch.setattr(build, "build_model", refuse)
    line = _refused(tiny_config(dict(max_steps=3, optimizer=dict(name="adamw"))), copied)
    assert "optimizer.name 'logra' → 'adamw'" in line, line


def test_config_json_is_rebuilt_from_a_matching_checkpoint(copied, shipped_tiny_parts):
    """max_steps, log.* and the other keys a resume may change do not count; config.json comes
    back as the resuming config, with the decode program the checkpoint records for
    rl.decode_weights="auto"."""
    config = tiny_config(dict(max_steps=2, log=dict(sample_every=5)))
    run = trainer_lib.Run(config, copied, parts=shipped_tiny_parts)
    try:
        assert run.loop() == {}                   # step 2 already reached: restored, nothing trained
    finally:
        run.close()
    meta = json.loads((copied / "checkpoints" / "2" / "meta" / "metadata").read_text())
    expected = config_lib.as_json(config)
    expected["rl"]["decode_weights"] = meta["config"]["rl.decode_weights"]
    assert expected["rl"]["decode_weights"] in ("stacked", "per_layer")
    assert json.loads((copied / "config.json").read_text()) == expected


def _strip_fingerprint(workdir: pathlib.Path) -> None:
    """What a checkpoint written before checkpoints carried their config holds: the loop's meta."""
    for meta in (workdir / "checkpoints").glob("*/meta/metadata"):
        saved = json.loads(meta.read_text())
        assert "config" in saved, saved          # this version writes it
        meta.write_text(json.dumps({k: v for k, v in saved.items() if k != "config"}))


def test_a_checkpoint_holding_a_nan_is_refused_naming_the_leaf(copied, trained_tiny_run):
    """A NaN in the restored optimizer state stopped the run three steps later advising a lower
    learning rate, after writing another checkpoint holding it: the restore names the leaf, and
    nothing is written (config.json not rebuilt)."""
    from logra_jax import checkpoint as checkpoint_lib
    saver = checkpoint_lib.Checkpointer(copied / "checkpoints")
    state = (trained_tiny_run.params, trained_tiny_run.opt_state)
    (params, opt_state), meta = saver.restore(2, state)
    path, leaf = next((p, x) for p, x in leaves_with_paths(opt_state)
                      if np.issubdtype(x.dtype, np.floating) and x.size > 1)
    broken = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.nan) if x is leaf else x, opt_state)
    saver.save(3, (params, broken), dict(meta, step=3))
    saver.close()
    line = _refused(tiny_config(dict(max_steps=4)), copied)
    assert line.startswith(f"error: checkpoint {copied / 'checkpoints' / '3'} holds NaN or "
                           f"infinite values in opt_state/{path}; nothing was written"), line


def test_an_old_checkpoint_without_a_config_needs_its_config_json(copied, trained_tiny_run,
                                                                  shipped_tiny_parts):
    """Without the fingerprint and without config.json nothing can tell the config: refused.
    With config.json back, config.json's check decides, as before fingerprints."""
    _strip_fingerprint(copied)
    line = _refused(tiny_config(dict(max_steps=2)), copied)
    assert "records no config" in line and "config.json" in line, line
    shutil.copy(trained_tiny_run.workdir / "config.json", copied / "config.json")
    assert "seed changed" in _refused(tiny_config(dict(max_steps=3, seed=1)), copied)
    run = trainer_lib.Run(tiny_config(dict(max_steps=2)), copied, parts=shipped_tiny_parts)
    try:
        assert run.loop() == {}
    finally:
        run.close()


def test_an_unfinished_checkpoint_write_is_named_in_the_refusal(tmp_path, monkeypatch):
    """A run whose first checkpoint write failed leaves metrics rows and orbax's temporary folder
    of that checkpoint (what a file size limit left in a real run): the refusal names the folder."""
    monkeypatch.setattr(build, "build_model", lambda *a, **k: pytest.fail("model built"))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    line = _refused(tiny_config(), tmp_path)
    assert ("but no checkpoint to resume them from (the run stopped before its first one, or "
            "checkpoints/ was removed); 2.orbax-checkpoint-tmp in checkpoints/ is a write that did "
            "not finish and cannot be resumed; pass --fresh") in line, line


def test_a_dropped_cut_metrics_line_is_reported(tmp_path, capsys):
    from logra_jax import metrics
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew')
    metrics.MetricsWriter(tmp_path, total_steps=3, start_step=1, tensorboard=False,
                          progress=False).close()
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {path}:2: dropped a last line cut short (a run stopped mid-write): "
        "'{\"step\": 2, \"rew'"]
    assert path.read_text() == '{"step": 1}\n'


def _with_new_sampler(parts, policy=None):
    """A run's ``parts`` as a new process would hold them: a new Sampler (of ``policy``, default
    the run's; the compiled update and the weights are shared)."""
    fresh = copy.copy(parts)
    fresh.sampler = build.build_sampler(parts.config.rl, policy or parts.policy, parts.tokenizer)
    return fresh


def _assert_same_weights(a_run, b_run):
    for (path, a), b in zip(leaves_with_paths(jax.device_get(a_run.params)),
                            jax.tree.leaves(jax.device_get(b_run.params)), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=path)


def test_two_fresh_runs_end_bit_identical_whichever_decode_program_is_slowed(
        tmp_path, shipped_tiny_parts, trained_tiny_run):
    """rl.decode_weights="auto" is a rule, not a clock: a run on a machine where the rule's decode
    program is slowed (a timed pick took the other one there, which rounds differently) ends with
    the weights of the session's run of the same config on a quiet one, bit for bit."""
    from slow_decode import SLOW, SlowablePolicy
    loaded = _with_new_sampler(shipped_tiny_parts, SlowablePolicy(shipped_tiny_parts.policy))
    SLOW["mode"] = "per_layer"
    try:
        run = trainer_lib.Run(tiny_config(dict(max_steps=2)), tmp_path / "loaded", parts=loaded)
        run.loop()
        run.close()
    finally:
        SLOW["mode"] = None
    assert loaded.sampler.last_decode_mode == "per_layer"
    assert trained_tiny_run.parts.sampler.last_decode_mode == "per_layer"
    _assert_same_weights(trained_tiny_run, run)


def test_a_resume_runs_the_decode_program_its_workdir_records(tmp_path, shipped_tiny_parts,
                                                             monkeypatch):
    """A run records the decode program "auto" resolved to (config.json, each checkpoint), and a
    resumed process runs that program even where its own rule would take the other (a workdir
    written by an older version, which timed its pick, or on another platform): the two round
    differently, and the run ends with the weights of an uninterrupted one."""
    from logra_jax.rl import decode_mode
    monkeypatch.setattr(decode_mode, "rule", lambda platform, devices: "stacked")
    first = _with_new_sampler(shipped_tiny_parts)
    straight = trainer_lib.Run(tiny_config(dict(max_steps=3)), tmp_path / "straight", parts=first)
    straight.loop()
    straight.close()
    stopped = trainer_lib.Run(tiny_config(dict(max_steps=2)), tmp_path / "resumed", parts=first)
    stopped.loop()
    stopped.close()
    workdir = tmp_path / "resumed"
    assert json.loads((workdir / "config.json").read_text())["rl"]["decode_weights"] == "stacked"
    meta = json.loads((workdir / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["config"]["rl.decode_weights"] == "stacked"

    monkeypatch.setattr(decode_mode, "rule", lambda platform, devices: "per_layer")
    second = _with_new_sampler(shipped_tiny_parts)
    resumed = trainer_lib.Run(tiny_config(dict(max_steps=3)), workdir, parts=second)
    resumed.loop()
    resumed.close()
    assert second.sampler.last_decode_mode == "stacked"
    _assert_same_weights(straight, resumed)
