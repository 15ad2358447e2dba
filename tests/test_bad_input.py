"""Bad input, wherever it is found, is one `error: …` line and exit status 1, and loses nothing.

Every row runs `launch.train` — in this process through `launch.train.run` (what ``main`` calls, so
the same `error:` handling) on a copy of a real run's workdir, or as a real process for what is
checked before jax is imported (the command line itself). Each row asserts the single line, what
it names, and that the workdir holds exactly the files, bytes and times it held before.
"""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from absl import flags

from configs import base, tiny
from launch import cli
from launch import train as train_cli
from logra_jax import config as config_lib
from logra_jax.rl import build
from tiny_config import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOOD_GSM8K = {"question": "Tom has 3 apples and buys 2 more. How many apples does he have?",
              "answer": "3 + 2 = 5\n#### 5"}


def _snapshot(workdir: pathlib.Path) -> dict[str, tuple[int, int, str] | None]:
    """{relative path: (size, mtime_ns, sha256), or None for a folder} of everything."""
    return {str(f.relative_to(workdir)): (f.stat().st_size, f.stat().st_mtime_ns,
                                          hashlib.sha256(f.read_bytes()).hexdigest())
            if f.is_file() else None for f in sorted(workdir.rglob("*"))}


@pytest.fixture(scope="module")
def trained(trained_tiny_run):
    """The workdir of a real 2-step tiny run (weights moved, checkpoint 2 written)."""
    return trained_tiny_run.workdir


def _gsm8k_dir(tmp_path: pathlib.Path, train_lines: list[str | bytes]) -> str:
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    (folder / "train.jsonl").write_bytes(b"".join(
        (line if isinstance(line, bytes) else line.encode()) + b"\n" for line in train_lines))
    (folder / "test.jsonl").write_text(json.dumps(GOOD_GSM8K) + "\n")
    return str(folder)


# (row id, overrides of configs/tiny.py — a callable gets tmp_path —, what the line must say).
# Every row here is refused before the model is built (`test_bad_config_is_one_line_and_loses_nothing`
# makes building it a failure): the value alone, or with the rest of the config and the workdir.
ROWS = [
    ("max_steps", dict(max_steps=0), "max_steps must be a positive integer, got 0"),
    ("temperature-zero", dict(rl=dict(temperature=0.0)), "rl.temperature must be a finite number > 0, got 0.0"),
    ("temperature-negative", dict(rl=dict(temperature=-1.0)), "rl.temperature must be a finite number > 0, got -1.0"),
    ("top-p", dict(rl=dict(top_p=1.5)), "rl.top_p must be in (0, 1], got 1.5"),
    ("top-k", dict(rl=dict(top_k=-1)), "rl.top_k must be an integer ≥ 0, got -1"),
    ("algorithm", dict(rl=dict(algorithm="ppo")), "rl.algorithm must be one of 'grpo', 'reinforce', got 'ppo'"),
    ("grpo-group-of-one", dict(rl=dict(algorithm="grpo", num_generations=1)), "num_generations=1"),
    ("micro-batch", dict(rl=dict(micro_batch_size=3)), "not a multiple of rl.micro_batch_size=3"),
    ("micro-batch-zero", dict(rl=dict(micro_batch_size=0)), "rl.micro_batch_size must be a positive integer, got 0"),
    ("rollout-micro-batch", dict(rl=dict(rollout_micro_batch=3)), "not a multiple of rl.rollout_micro_batch=3"),
    ("rollout-micro-batch-negative", dict(rl=dict(rollout_micro_batch=-1)),
     "rl.rollout_micro_batch must be an integer ≥ 0, got -1"),
    ("rollout-engine", dict(rl=dict(rollout_engine="paged")),
     "rl.rollout_engine must be one of 'static', 'slots', got 'paged'"),
    ("rollout-slots-split-a-group", dict(rl=dict(rollout_engine="slots", rollout_slots=3, num_generations=2)),
     "rl.rollout_slots=3 must be a multiple of rl.num_generations=2"),
    ("rollout-slots-and-passes", dict(data=dict(prompts_per_step=2), rl=dict(
        rollout_engine="slots", num_generations=2, rollout_micro_batch=2, micro_batch_size=2)),
     "the slot engine's memory is rl.rollout_slots"),
    ("num-generations-zero", dict(rl=dict(num_generations=0)), "rl.num_generations must be a positive integer, got 0"),
    ("prompts-per-step-zero", dict(data=dict(prompts_per_step=0)), "data.prompts_per_step must be a positive integer"),
    ("advantage-baseline", dict(rl=dict(advantage_baseline="median")), "rl.advantage_baseline must be one of 'mean', 'leave_one_out'"),
    ("completion-length", dict(rl=dict(max_completion_length=0)), "rl.max_completion_length must be a positive integer, got 0"),
    ("format-reward-nan", dict(rl=dict(format_reward_weight=float("nan"))), "rl.format_reward_weight must be a finite number, got nan"),
    # Options only GRPO reads are checked under REINFORCE too (tiny.py's algorithm), and vice versa.
    ("beta-negative-reinforce", dict(rl=dict(beta=-1.0)), "rl.beta must be a finite number ≥ 0, got -1.0"),
    ("beta-negative-grpo", dict(rl=dict(algorithm="grpo", beta=-1.0)), "rl.beta must be a finite number ≥ 0, got -1.0"),
    ("epsilon-negative-reinforce", dict(rl=dict(epsilon=-0.2)), "rl.epsilon must be a finite number > 0, got -0.2"),
    ("kl-estimator-reinforce", dict(rl=dict(kl_estimator="bogus")), "rl.kl_estimator must be one of 'k1', 'k2', 'k3', got 'bogus'"),
    ("is-cap-grpo", dict(rl=dict(algorithm="grpo", is_cap=float("nan"))), "rl.is_cap must be a number > 0 (inf: off), got nan"),
    ("decode-weights", dict(rl=dict(decode_weights="rows")), "rl.decode_weights must be one of 'auto', 'per_layer', 'stacked'"),
    ("checkpoint-every-zero", dict(checkpoint=dict(every=0)), "checkpoint.every must be a positive integer, got 0"),
    ("checkpoint-every-negative", dict(checkpoint=dict(every=-1)), "checkpoint.every must be a positive integer, got -1"),
    ("checkpoint-keep-zero", dict(checkpoint=dict(keep=0)), "checkpoint.keep must be a positive integer, got 0"),
    ("sample-every-negative", dict(log=dict(sample_every=-1)), "log.sample_every must be an integer ≥ 0, got -1"),
    ("model-dtype", dict(model=dict(dtype="float64")), "model.dtype must be one of 'float32', 'bfloat16', got 'float64'"),
    ("tiny-width-zero", dict(model=dict(tiny=dict(hidden_size=0))), "model.tiny.hidden_size must be a positive integer, got 0"),
    ("mesh-axis-zero", dict(mesh=dict(fsdp=0)), "mesh.fsdp must be a positive integer or -1 (the devices left), got 0"),
    ("optimizer-name", dict(optimizer=dict(name="sgd")), "optimizer.name must be one of 'logra', 'adamw', 'adafactor', 'galore', 'lora', got 'sgd'"),
    ("lr-nan", dict(optimizer=dict(logra=dict(learning_rate=float("nan")))),
     "optimizer.logra.learning_rate must be a finite number ≥ 0, got nan"),
    ("adamw-lr-inf", dict(optimizer=dict(name="adamw", adamw=dict(learning_rate=float("inf")))),
     "optimizer.adamw.learning_rate must be a finite number ≥ 0, got inf"),
    ("adamw-b2-one", dict(optimizer=dict(adamw=dict(b2=1.0))), "optimizer.adamw.b2 must be in [0, 1), got 1.0"),
    ("others-lr-negative", dict(optimizer=dict(logra=dict(others_learning_rate=-1.0))),
     "optimizer.logra.others_learning_rate must be a finite number ≥ 0, got -1.0"),
    ("warmup", dict(optimizer=dict(warmup_steps=-2)), "optimizer.warmup_steps must be an integer ≥ 0, got -2"),
    ("skips", dict(optimizer=dict(max_consecutive_skips=0)), "optimizer.max_consecutive_skips must be a positive integer"),
    ("weight-growth", dict(optimizer=dict(max_weight_norm_growth=1.0)),
     "optimizer.max_weight_norm_growth must be a number > 1"),
    ("rank", dict(optimizer=dict(logra=dict(rank=0))), "optimizer.logra.rank must be a positive integer, got 0"),
    ("variant", dict(optimizer=dict(logra=dict(variant="adam"))), "optimizer.logra.variant must be one of 'learning_rate', 'kl'"),
    ("variant-old-name", dict(optimizer=dict(logra=dict(variant="grpo"))),
     "('grpo' is now 'learning_rate': the variant is named by its step, rl.algorithm by its objective), got 'grpo'"),
    ("kl-budget", dict(optimizer=dict(logra=dict(kl_control=True, kl_budget=0.0))),
     "optimizer.logra.kl_budget must be a finite number > 0, got 0.0"),
    ("targets-not-a-regex", dict(optimizer=dict(lora=dict(targets="(q_proj"))),
     "optimizer.lora.targets must be a valid regular expression, got '(q_proj'"),
    # Checked on the model's abstract shapes (from model.tiny, or a Hugging Face config.json),
    # before its weights exist.
    ("targets", dict(optimizer=dict(logra=dict(targets="no_such_layer"))),
     "optimizer.logra on this model: targets pattern 'no_such_layer' matched no parameter"),
    # model.tiny is the model config's keyword arguments: a key that is none of its fields.
    ("model-tiny-typo", dict(model=dict(tiny=dict(hiden_size=4))),
     "model.tiny.hiden_size is not a field of the model's config"),
    # ... and a value its own checks refuse is named as the key typed, not ModelConfig's field.
    ("model-tiny-heads", dict(model=dict(tiny=dict(num_heads=3))),
     "model.tiny.num_heads (3) must be a multiple of model.tiny.num_kv_heads (2) for grouped-query"),
    ("rank-not-below-width", dict(optimizer=dict(logra=dict(rank=64))),
     "optimizer.logra on this model (optimizer.logra.rank=64): rank 64 is not below the input width of 6 targets: 'layers/mlp/gate_proj/kernel' (64), 'layers/mlp/up_proj/kernel' (64), 'layers/self_attn/k_proj/kernel' (64), 'layers/self_attn/o_proj/kernel' (64) and 2 more; a sketch of rank r ≥ in compresses nothing, so no target's rank is lowered for it: lower optimizer.logra.rank below 64 (or exclude those targets)"),
    ("rank-far-above-width", dict(optimizer=dict(logra=dict(rank=100000))),
     "(optimizer.logra.rank=100000): rank 100000 is not below the input width of 7 targets: 'layers/mlp/down_proj/kernel' (128),"),
    ("seed-negative", dict(seed=-1), "seed must be an integer ≥ 0, got -1"),
    ("lora-targets", dict(optimizer=dict(name="lora", lora=dict(targets="no_such_layer"))),
     "optimizer.lora on this model: LoRA targets 'no_such_layer' match no parameter"),
    ("model-config-lacks-a-field",
     lambda tmp: dict(model=dict(source=_file(tmp / "m" / "config.json", b'{"model_type": "llama"}'))),
     "cannot be read: the field 'num_attention_heads' is missing from its config"),
    ("model-config-not-json", lambda tmp: dict(model=dict(source=_file(tmp / "m" / "config.json", b"{"))),
     "cannot be read: Expecting property name enclosed in double quotes"),
    ("mesh-indivisible", dict(mesh=dict(fsdp=3)), "but there are 8 devices"),
    ("mesh-too-big", dict(mesh=dict(fsdp=4, tensor=4)), "but there are 8 devices"),
    ("sync-mode", dict(sync=dict(mode="bogus")), "sync.mode must be one of"),
    ("sync-devices-without-mode", dict(sync=dict(rollout_devices=4)), "needs a sync.mode"),
    ("factors-without-logra", dict(optimizer=dict(name="adamw"), sync=dict(mode="factors")),
     "has none (use full or sparse)"),
    ("factors-replayed-inexact", dict(sync=dict(mode="factors", rollout_devices=4),
                                      optimizer=dict(logra=dict(exact_merge=False))),
     "needs optimizer.logra.exact_merge=True"),
    ("data-source", dict(data=dict(source="csv")), "data.source must be one of 'task', 'gsm8k', 'sums', got 'csv'"),
    ("task", dict(data=dict(task="no_such_task")), "no_such_task"),
    ("gsm8k-no-dir", dict(data=dict(source="gsm8k")), "needs data.gsm8k_dir"),
    ("gsm8k-missing-dir", dict(data=dict(source="gsm8k", gsm8k_dir="/no/such/dir")),
     "GSM8K data directory /no/such/dir does not exist; point data.gsm8k_dir"),
    ("gsm8k-empty-file", lambda tmp: dict(data=dict(source="gsm8k", gsm8k_dir=_gsm8k_dir(tmp, []))),
     "train.jsonl holds no examples (it is empty)"),
    ("gsm8k-malformed-line",
     lambda tmp: dict(data=dict(source="gsm8k", gsm8k_dir=_gsm8k_dir(
         tmp, [json.dumps(GOOD_GSM8K), '{"question": "2+2?", "answer": "4']),
         gsm8k_cache_dir=str(tmp / "cache"))), "train.jsonl:2: not valid JSON"),
    ("gsm8k-not-utf8",
     lambda tmp: dict(data=dict(source="gsm8k", gsm8k_dir=_gsm8k_dir(
         tmp, [json.dumps(GOOD_GSM8K), b'{"question": "2\xff", "answer": "#### 4"}']),
         gsm8k_cache_dir=str(tmp / "cache"))), "train.jsonl:2: not UTF-8 text (invalid start byte"),
    ("resume-other-rank", dict(optimizer=dict(logra=dict(rank=4))),
     "holds a run with another config: optimizer.logra.rank changed"),
    # Found with the tokenizer alone, before the model is built (it was found after, 12-15 s in).
    ("prompts-too-long", dict(rl=dict(max_prompt_length=8)),
     "longer than rl.max_prompt_length=8 tokens (the longest has 46): none is left"),
    ("prompts-too-long-no-skip", dict(rl=dict(max_prompt_length=8), data=dict(skip_long_prompts=False)),
     "raise rl.max_prompt_length to 46, or set data.skip_long_prompts=True"),
    # A GGUF model's tokenizer is read from its header: the window is refused before any weight
    # is read (this file's weights are cut short, which only the model's build would find).
    ("gguf-prompts-too-long", lambda tmp: dict(model=dict(source=_cut_gguf(tmp, 49_181_216)),
                                               rl=dict(max_prompt_length=8)),
     "longer than rl.max_prompt_length=8 tokens (the longest has 46): none is left"),
]
# What only the model (or its tokenizer) can tell: these rows build it, in a new workdir (each
# changes a key that the resume check of the trained workdir would refuse first).
MODEL_ROWS = [
    ("model-missing-path", dict(model=dict(source="/no/such/model")),
     "model source '/no/such/model' does not exist"),
    ("model-unknown-name", dict(model=dict(source="gpt-17")), "unknown model source 'gpt-17'"),
    ("model-shape-only", dict(model=dict(source="shape:qwen2_5_7b")), "a model shape without weights"),
    ("gguf-empty", lambda tmp: dict(model=dict(source=_file(tmp / "m.gguf", b""))),
     "cannot be read: cannot mmap an empty file"),
    ("gguf-not-gguf", lambda tmp: dict(model=dict(source=_file(tmp / "m.gguf", b"not a gguf file"))),
     "m.gguf is not a GGUF file"),
    # Weights cut short (an interrupted copy): the file, the tensor, the bytes described and found.
    ("gguf-cut-in-its-header", lambda tmp: dict(model=dict(source=_cut_gguf(tmp, 1_000_000))),
     "m.gguf is cut short: it ends at byte 1000000, inside its header"),
    ("gguf-cut-in-half", lambda tmp: dict(model=dict(source=_cut_gguf(tmp, 49_181_216))),
     "m.gguf is cut short: tensor 'blk.15.attn_output.weight' (Q4_1 (576, 576)) takes bytes "
     "49114432 to 49321792, but the file has 49181216 of the 98362432 bytes its header describes"),
    ("safetensors-cut-in-half", lambda tmp: dict(model=dict(source=_cut_hf_folder(tmp))),
     # the embedding, 49152 × 64 fp32, is the file's first tensor: the half cut ends inside it
     "model.safetensors is cut short: tensor 'model.embed_tokens.weight' (F32 (49152, 64)) takes "
     "bytes 2120 to 12585032, but the file has 6440612 of the 12881224 bytes its header describes"),
]


def _cut_gguf(tmp: pathlib.Path, size: int) -> str:
    """The first ``size`` bytes of SmolLM2's GGUF (98,362,432 bytes), as an interrupted copy
    leaves it."""
    from logra_jax.models import gguf_loader
    with open(gguf_loader.smollm2_gguf_path(), "rb") as f:
        return _file(tmp / "m.gguf", f.read(size))


def _file(path: pathlib.Path, data: bytes) -> str:
    """Writes ``data`` to ``path``; returns what model.source names: the file, or a config.json's
    folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path.parent if path.name == "config.json" else path)


def _cut_hf_folder(tmp: pathlib.Path) -> str:
    """configs/tiny.py's model written as a Hugging Face folder (config.json, safetensors,
    tokenizer), its model.safetensors then cut to its first half, as an interrupted copy leaves it."""
    import jax
    import numpy as np
    from flax import nnx

    from logra_jax.models import Decoder, ModelConfig, gguf_loader
    from logra_jax.models.hf_export import write_hf_folder
    from logra_jax.rl.policy import Policy
    from logra_jax.tree_paths import leaves_with_paths
    tokenizer = gguf_loader.smollm2_tokenizer()
    config = ModelConfig(vocab_size=tokenizer.vocab_size, **dict(tiny_config().model.tiny))
    weights = {path: np.asarray(jax.device_get(value)) for path, value in
               leaves_with_paths(Policy.params_of(Decoder(config, rngs=nnx.Rngs(0))))}
    folder = tmp / "hf"
    write_hf_folder(config, weights, tokenizer, folder)
    cut = folder / "model.safetensors"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    return str(folder)


# Rows found after the workdir's resume check (which would refuse their key first): a new workdir.
NEW_WORKDIR = {"mesh-indivisible", "mesh-too-big", "prompts-too-long", "prompts-too-long-no-skip",
               "gguf-prompts-too-long"}


def _refuses_on_a_copy(trained, tmp_path, overrides, message, new_workdir=False):
    """launch.train's `run` on a copy of the trained workdir (or a new one, which it must not leave
    behind): one `error:` line holding ``message``, and the workdir exactly as it was."""
    workdir = tmp_path / "runs" / "workdir"
    if not new_workdir:
        shutil.copytree(trained, workdir)
    before = _snapshot(workdir) if not new_workdir else None
    config = tiny_config(dict(max_steps=4), overrides(tmp_path) if callable(overrides) else overrides)
    with pytest.raises(SystemExit) as exit_:
        train_cli.run(config, str(workdir))
    line = exit_.value.code
    assert isinstance(line, str), line            # SystemExit(str): printed, exit status 1
    assert line.startswith("error: ") and "\n" not in line, line
    assert message in line, line
    if new_workdir:   # nothing created: not the workdir, not the folder above it
        assert not (tmp_path / "runs").exists(), list((tmp_path / "runs").rglob("*"))
    else:
        assert _snapshot(workdir) == before


@pytest.mark.parametrize("overrides, message", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_config_is_one_line_and_loses_nothing(overrides, message, trained, tmp_path, monkeypatch,
                                                  request):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the bad value was refused")
    monkeypatch.setattr(build, "build_model", refuse)
    _refuses_on_a_copy(trained, tmp_path, overrides, message,
                       new_workdir=request.node.callspec.id in NEW_WORKDIR)


@pytest.mark.parametrize("overrides, message", [r[1:] for r in MODEL_ROWS],
                         ids=[r[0] for r in MODEL_ROWS])
def test_bad_input_found_with_the_model_is_one_line_and_loses_nothing(overrides, message, trained,
                                                                      tmp_path):
    _refuses_on_a_copy(trained, tmp_path, overrides, message, new_workdir=True)


def test_fresh_moves_nothing_when_the_model_cannot_be_built(trained, tmp_path):
    """--fresh moves the earlier run aside only once the new one is built: weights cut short (or
    any error found with the model) leave the earlier run where it was."""
    workdir = tmp_path / "workdir"
    shutil.copytree(trained, workdir)
    before = _snapshot(workdir)
    config = tiny_config(dict(model=dict(source=_cut_hf_folder(tmp_path))))
    with pytest.raises(SystemExit, match="^error: .*model.safetensors is cut short: tensor"):
        train_cli.run(config, str(workdir), fresh=True)
    assert _snapshot(workdir) == before


def test_every_key_of_the_base_config_has_a_rule():
    """A key added to configs/base.py without a rule here would go unchecked until it broke a run."""
    keys = config_lib.flatten(base.get_config().to_dict())
    rules = config_lib.value_rules()
    missing = [k for k in keys if k not in rules and not k.startswith(config_lib.CHECKED_ELSEWHERE)]
    assert not missing, f"configs/base.py keys without a rule in logra_jax/config/: {missing}"
    assert not set(rules) - set(keys), "rules for keys configs/base.py lacks"
    for path in sorted((ROOT / "configs").glob("*.py")):   # every shipped config passes them
        if path.name != "__init__.py":
            config_lib.check_values(config_lib.load_config_file(path))


def test_a_key_the_base_config_lacks_is_refused_by_every_path():
    """A typo inside a config built in code (not a file) is refused by the value check too, naming
    the nearest real key; the config files' own check names the file (test_config_files.py)."""
    config = tiny_config()
    config.rl.num_generation = 4
    with pytest.raises(ValueError, match=r"^unknown config key: rl.num_generation is not a key of "
                                         r"configs/base.py \(nearest: rl.num_generations\)$"):
        config_lib.check_values(config)
    config = tiny_config()
    config.optimizer.logra.rnak = 4
    with pytest.raises(ValueError, match=r"optimizer.logra.rnak is not a key .*nearest: "
                                         r"optimizer.logra.rank"):
        config_lib.check_values(config)


def test_the_rules_choices_are_the_librarys():
    """logra_jax/config/rules.py sits below the library and spells its choices out; they must agree."""
    from logra_jax.models.config import DTYPES
    from logra_jax.optim.galore import PROJECTORS
    from logra_jax.optim.rounding import ROUNDINGS
    from logra_jax.projections import DISTRIBUTIONS
    from logra_jax.rl import losses, sync
    from logra_jax.rl.sampler import Sampler
    assert config_lib.KL_ESTIMATORS == losses.KL_ESTIMATORS
    assert config_lib.LOSS_AGG_MODES == losses.LOSS_AGG_MODES
    assert config_lib.ADVANTAGE_BASELINES == losses.ADVANTAGE_BASELINES
    assert config_lib.DECODE_WEIGHTS == Sampler.DECODE_WEIGHTS
    assert config_lib.ROLLOUT_ENGINES == Sampler.ENGINES
    assert config_lib.IMPORTANCE_CORRECTIONS == losses.IMPORTANCE_CORRECTIONS
    assert config_lib.SYNC_MODES == ("off",) + sync.MODES
    assert set(config_lib.MODEL_DTYPES) == set(DTYPES)
    assert config_lib.DISTRIBUTIONS == DISTRIBUTIONS
    assert set(config_lib.ROUNDINGS) == set(ROUNDINGS)
    assert config_lib.GALORE_PROJECTORS == PROJECTORS


@pytest.mark.parametrize("overrides, ignored", [
    (dict(), []),                                                    # tiny.py: REINFORCE, defaults
    (dict(rl=dict(beta=0.04, kl_estimator="k1")), ["rl.beta", "rl.kl_estimator"]),
    (dict(rl=dict(algorithm="grpo", num_generations=2, failure_reward=-1.0)), ["rl.failure_reward"]),
    (dict(rl=dict(algorithm="grpo", beta=0.04)), []),
    (dict(rl=dict(algorithm="ppo", beta=0.04)), []),                 # refused by its rule instead
])
def test_options_the_algorithm_ignores_are_named(overrides, ignored, capsys):
    config = tiny_config(overrides)
    assert config_lib.ignored_options(config, base.get_config()) == ignored
    train_cli.warn_ignored_options(config)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == ignored
    assert all(line.startswith("warning: ") and "is not used by rl.algorithm=" in line
               for line in lines)


def test_a_workdir_that_is_a_file_is_one_line(tmp_path):
    workdir = tmp_path / "notes.txt"
    workdir.write_text("keep me")
    with pytest.raises(SystemExit) as exit_:
        train_cli.run(tiny.get_config(), str(workdir))
    assert exit_.value.code == f"error: workdir {workdir} is a file, not a folder; pass a folder " \
                               "for metrics and checkpoints"
    assert workdir.read_text() == "keep me"


def test_a_workdir_that_cannot_be_created_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_:
        train_cli.run(tiny.get_config(), str(blocker / "run"))
    assert exit_.value.code.startswith(f"error: workdir {blocker / 'run'} cannot be created")


@pytest.mark.parametrize("fresh", [False, True], ids=["new-workdir", "fresh"])
def test_a_bad_value_creates_and_moves_nothing(fresh, trained, tmp_path):
    """A value refused by its rule (a negative seed: numpy's data order refuses it, 14 s in) leaves
    a new workdir uncreated, and --fresh moves the earlier run aside only once the values pass."""
    workdir = tmp_path / "workdir"
    if fresh:
        shutil.copytree(trained, workdir)
    before = _snapshot(workdir) if fresh else None
    with pytest.raises(SystemExit, match="^error: seed must be an integer ≥ 0, got -1$"):
        train_cli.run(tiny_config(dict(seed=-1)), str(workdir), fresh=fresh)
    assert (_snapshot(workdir) == before) if fresh else not workdir.exists()


def test_a_dangling_symlink_workdir_is_called_one(tmp_path):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(SystemExit) as exit_:
        train_cli.run(tiny.get_config(), str(link / "sub"))
    assert exit_.value.code == (f"error: workdir {link / 'sub'}: {link} is a symbolic link to "
                                f"{tmp_path / 'gone'}, which does not exist; create its target or "
                                f"pass another --workdir")
    assert not (tmp_path / "gone").exists()


# The command line itself, checked before jax is imported: real processes, well under a second.
# {w}: a copy of the trained workdir; {new}: a workdir that does not exist (and must not after).
CLI_ROWS = [
    ("config-file-missing", ["--config", "configs/nope.py", "--workdir", "{w}"],
     "error: config file 'configs/nope.py' does not exist"),
    ("config-without-get-config", ["--config", "{bad_config}", "--workdir", "{w}"],
     "has no get_config() function"),
    ("config-syntax-error", ["--config", "{syntax_error}", "--workdir", "{w}"],
     "bad_syntax.py:1: SyntaxError: invalid syntax"),
    ("unknown-key", ["--config", "configs/tiny.py", "--workdir", "{w}", "--config.optimizer.rnak=4"],
     "error: unknown config key 'optimizer.rnak'"),
    ("value-of-wrong-type", ["--config", "configs/tiny.py", "--workdir", "{w}", "--config.max_steps=abc"],
     "error: --config.max_steps=abc: expected an integer (its default is 3)"),
    ("bool-of-wrong-type", ["--config", "configs/tiny.py", "--workdir", "{w}", "--config.log.progress=maybe"],
     "expected true or false"),
    ("value-missing", ["--config", "configs/tiny.py", "--workdir", "{w}", "--config.rl.temperature"],
     "error: --config.rl.temperature needs a value"),
    ("workdir-missing", ["--config", "configs/tiny.py"], "error: --workdir is required"),
    ("config-missing", ["--workdir", "{w}"], "error: --config is required"),
    # A key configs/base.py does not define, set inside a config file (the command line's own
    # overrides are refused above): named with the file's line and the nearest keys, no workdir.
    ("config-file-typo", ["--config", "{typo}", "--workdir", "{new}"],
     "error: config file {typo}:6: rl.num_generation is not a key of configs/base.py (nearest: "
     "rl.num_generations)"),
    ("config-file-nested-typo", ["--config", "{nested_typo}", "--workdir", "{new}"],
     "error: config file {nested_typo}:6: optimizer.logra.rnak is not a key of configs/base.py "
     "(nearest: optimizer.logra.rank)"),
    ("config-json-typo", ["--config", "{json_typo}", "--workdir", "{new}"],
     "error: config file {json_typo}: rl.num_generation is not a key of configs/base.py"),
    # file.py:arg passes arg to get_config (the seed it sets is then refused by its rule).
    ("config-file-argument", ["--config", "{with_argument}:-1", "--workdir", "{new}"],
     "error: seed must be an integer ≥ 0, got -1"),
    ("workdir-tilde", ["--config", "configs/tiny.py", "--workdir=~/logra_runs/x"],
     "error: --workdir ~/logra_runs/x starts with '~', which the shell did not expand (it does so "
     "only at the start of a word, not after '='): pass --workdir "
     + os.path.expanduser("~/logra_runs/x") + " instead"),
]

TYPO = """from configs import tiny


def get_config():
    c = tiny.get_config()
    c.rl.num_generation = 4
    return c
"""


def _command_line_files(tmp_path: pathlib.Path, trained: pathlib.Path) -> dict[str, str]:
    files = {"bad_config.py": "x = 1\n", "bad_syntax.py": "def get_config(:\n", "typo.py": TYPO,
             "nested_typo.py": TYPO.replace("c.rl.num_generation = 4", "c.optimizer.logra.rnak = 4"),
             "with_argument.py": "from configs import tiny\n\n\ndef get_config(seed):\n"
                                 "    c = tiny.get_config()\n    c.seed = int(seed)\n    return c\n"}
    paths = {}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        paths[name.removesuffix(".py")] = str(tmp_path / name)
    paths["syntax_error"] = paths.pop("bad_syntax")
    recorded = json.loads((trained / "config.json").read_text())
    recorded["rl"]["num_generation"] = 4
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    paths["json_typo"] = str(tmp_path / "config.json")
    return paths


@pytest.mark.parametrize("argv, message", [r[1:] for r in CLI_ROWS], ids=[r[0] for r in CLI_ROWS])
def test_bad_command_line_is_one_line(argv, message, trained, tmp_path):
    """A real process each, run from an empty folder (a literal ``~`` folder would appear there)."""
    workdir = tmp_path / "workdir"
    shutil.copytree(trained, workdir)
    before = _snapshot(workdir)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    paths = dict(_command_line_files(tmp_path, trained), w=workdir, new=tmp_path / "new" / "run")
    argv = [a.format(**paths).replace("configs/tiny.py", str(ROOT / "configs" / "tiny.py"))
            for a in argv]
    done = subprocess.run([sys.executable, "-m", "launch.train", *argv], cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    message = message.format(**paths)
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert _snapshot(workdir) == before
    assert not (tmp_path / "new").exists() and list(cwd.iterdir()) == []


def test_a_bad_value_is_refused_before_jax_is_imported(tmp_path):
    """"Well under a second": the value checks need no jax (importing it alone takes seconds)."""
    script = ("import runpy, sys\n"
              "sys.argv = ['launch.train', '--config', sys.argv[1], '--workdir', sys.argv[2], "
              "'--config.seed=-1']\n"
              "try:\n    runpy.run_module('launch.train', run_name='__main__')\n"
              "except SystemExit as e:\n    print(e.code, '|', 'jax' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script, str(ROOT / "configs" / "tiny.py"),
                           str(tmp_path / "w")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "error: seed must be an integer ≥ 0, got -1 | False", done
    assert not (tmp_path / "w").exists()


@pytest.mark.skipif(bool(__import__("glob").glob("/dev/nvidia[0-9]*")), reason="a GPU is here")
def test_a_platform_that_cannot_start_is_one_line(tmp_path):
    """JAX_PLATFORMS=cuda on a machine without a GPU: JAX logs the CUDA plugin's traceback and
    fails with a bare AssertionError; the run says what is wrong in one line, creating nothing."""
    done = subprocess.run([sys.executable, "-m", "launch.train", "--config", "configs/tiny.py",
                           "--workdir", str(tmp_path / "w")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cuda"))
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: JAX_PLATFORMS=cuda asks for a CUDA device, but jax cannot start it on this "
        "machine ("), lines
    assert not (tmp_path / "w").exists()


# A config file that cannot give a config: (row id, file text or None for a folder, the line).
CONFIG_FILE_ROWS = [
    ("a-folder", None, "error: config file '{path}' is a folder; pass a configs/*.py file"),
    ("syntax-error", "def get_config(:\n", "error: config file {path}:1: SyntaxError: invalid syntax"),
    ("undefined-name", "x = 1\ny = undefined_name\n",
     "error: config file {path}:2: NameError: name 'undefined_name' is not defined"),
    ("get-config-raises", "def get_config():\n    raise RuntimeError('boom')\n",
     "error: config file {path}:2: get_config() raised RuntimeError: boom"),
    ("not-a-config-dict", "def get_config():\n    return 42\n",
     "error: config file '{path}': get_config() returned int 42, not an ml_collections.ConfigDict"),
]


def _parse(argv: list[str]) -> flags.FlagValues:
    """launch.train's command line parsed as its ``main`` gets it (`cli.parse`), on flags of its
    own (absl's FLAGS hold launch.train's, parsed once per process)."""
    values = flags.FlagValues()
    cli.define_config(help_string="", flag_values=values, sys_argv=["prog", *argv])
    flags.DEFINE_string("workdir", None, "", flag_values=values)
    flags.DEFINE_bool("verbose", False, "", flag_values=values)
    cli.parse(["prog", *argv], required=("config", "workdir"), flag_values=values)
    return values


@pytest.mark.parametrize("text, message", [r[1:] for r in CONFIG_FILE_ROWS],
                         ids=[r[0] for r in CONFIG_FILE_ROWS])
def test_a_config_file_that_cannot_be_loaded_is_one_line_naming_it(text, message, tmp_path):
    """What absl's parse of launch.train's flags reports (the config file is loaded then): one
    line naming the file and its line; --verbose keeps the file's own traceback."""
    path = tmp_path / "my_config.py"
    if text is None:
        path.mkdir()
    else:
        path.write_text(text)
    argv = ["--config", str(path), "--workdir", str(tmp_path / "w"), "--config.max_steps=2"]
    with pytest.raises(SystemExit) as exit_:
        _parse(argv)
    assert exit_.value.code == message.format(path=path)
    if "Error:" in message:   # the file raised: --verbose shows where
        with pytest.raises(config_lib.ConfigFileError) as raised:   # a traceback, not a line
            _parse(argv + ["--verbose"])
        assert f"{type(raised.value.__cause__).__name__}" in message   # chained: the file's own


def test_a_config_file_changing_the_bases_presets_changes_its_own_config_only(tmp_path):
    """A file that edits configs/base.py's module-level presets (REFERENCE_BATCH, LOGRA_VARIANTS)
    or rebinds one (DEFAULT_TARGETS) gets what it asked for, and the configs loaded after it in
    the same process (launch.sync_bench --configs a.py,b.py) and this process's configs.base are
    as before: each file runs with its own copy of the configs package."""
    import copy
    mutating, plain = tmp_path / "a.py", tmp_path / "b.py"
    # Both files build their config the same way from the presets; one first changes them.
    get_config = ("def get_config():\n"
                  "    c = base.get_config()\n"
                  "    base.use_reference_batch(c, 8)\n"
                  "    base.use_logra_variant(c, 'kl')\n"
                  "    c.optimizer.logra.targets = base.DEFAULT_TARGETS\n"
                  "    return c\n")
    mutating.write_text("from configs import base\n"
                        "base.REFERENCE_BATCH[0]['prompts_per_step'] = 4\n"
                        "base.LOGRA_VARIANTS['kl'][0]['kl_control'] = False\n"
                        "base.DEFAULT_TARGETS = r'q_proj/kernel$'\n" + get_config)
    plain.write_text("from configs import base\n" + get_config)
    presets = copy.deepcopy((base.REFERENCE_BATCH, base.LOGRA_VARIANTS, base.DEFAULT_TARGETS))
    before = config_lib.as_json(config_lib.load_config_file(plain))
    mutated = config_lib.load_config_file(mutating)
    assert (mutated.data.prompts_per_step, mutated.optimizer.logra.kl_control,
            mutated.optimizer.logra.targets) == (4, False, "q_proj/kernel$")   # its own change
    assert config_lib.as_json(config_lib.load_config_file(plain)) == before
    assert (base.REFERENCE_BATCH, base.LOGRA_VARIANTS, base.DEFAULT_TARGETS) == presets


def test_a_runs_config_json_gives_its_config_back(trained, tmp_path):
    """--config run/config.json repeats a run: the config it records, every value with its type."""
    recorded = json.loads((trained / "config.json").read_text())
    config = _parse(["--config", str(trained / "config.json"), "--workdir", str(tmp_path)])["config"].value
    assert config_lib.as_json(config) == recorded
    assert config.rl.decode_weights in ("stacked", "per_layer")   # the program the run resolved


@pytest.mark.parametrize("flag", ["--help", "--helpfull"])
def test_help_is_left_to_absl_even_without_the_required_flags(flag):
    done = subprocess.run([sys.executable, "-m", "launch.train", flag], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert "--workdir" in done.stdout + done.stderr and "error:" not in done.stderr, done
    with pytest.raises(SystemExit, match="error: --config is required"):
        _parse(["--workdir=w"])


def test_an_error_after_setup_reaches_the_shell_as_one_line(tmp_path):
    """The real process end to end for an error found once the model is built (prompt window)."""
    done = subprocess.run(
        [sys.executable, "-m", "launch.train", "--workdir", str(tmp_path), "--config",
         "configs/tiny.py", "--config.rl.max_prompt_length=8", "--config.data.skip_long_prompts=False"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "raise rl.max_prompt_length to 46" in last, last
    assert "Traceback" not in done.stderr
