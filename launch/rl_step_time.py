"""Seconds per RL step of the whole loop, split by phase: the figure to compare with other RL
frameworks.

    python -m launch.rl_step_time --config configs/qwen2_5_1_5b.py [--steps 3] [--json out.json] \
        [--reference_batch] [--prompts sums|config] [--config.…=…]

runs `launch.train`'s loop (logra_jax/rl/trainer.py: rollout → reward → reference log-probs →
update → sync) for ``--steps`` steps in a temporary workdir and prints the per-phase seconds the
trainer itself logs each step (``time/rollout``, ``time/reward``, ``time/reference``,
``time/update``, ``time/sync`` in metrics.jsonl): the first step (it compiles) apart, then the
median of the others, with generated tokens per second per device.

The model: a config whose source is ``shape:<name>`` runs as ``random:<name>`` (that published
shape with seeded random weights and SmolLM2's tokenizer; nothing is downloaded), so
configs/qwen2_5_1_5b.py measures Qwen2.5-1.5B's size. A random model almost never draws the
end-of-sequence token: every completion runs to ``rl.max_completion_length``, the slowest case.
The prompts: ``--prompts sums`` (default) are seeded two-number sums that need no package
(``data.source="sums"``); ``--prompts config`` keeps the config's data source.
``--reference_batch``: the reference's GRPO batch (configs/base.py REFERENCE_BATCH: 16 prompts × 8
completions of 512 + 1536 tokens), one row per device per micro-step.

The run ends with the trainer's checkpoint of the last step (its seconds are not in any phase);
the workdir is deleted afterwards unless ``--workdir`` names one.
"""

import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

from absl import flags

from launch import cli

_CONFIG = cli.define_config(help_string="A configs/*.py file (or a run's config.json).",
                            lock_config=False)
_STEPS = flags.DEFINE_integer("steps", 3, "Steps to run; the first compiles and is reported apart.")
_JSON = flags.DEFINE_string("json", None, "Also write the result to this JSON file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Keep the run here (default: a temporary folder, "
                               "deleted afterwards).")
_PROMPTS = flags.DEFINE_enum("prompts", "sums", ["sums", "config"], "sums: seeded two-number sums "
                             "(no package); config: the config's data source.")
_REFERENCE = flags.DEFINE_bool("reference_batch", False, "The reference GRPO batch (16 × 8 rows of "
                               "512 + 1536 tokens).")

PHASES = ("rollout", "reward", "reference", "update", "sync")


def prepare(config, steps: int, prompts: str, reference_batch: bool):
    """``config`` as this benchmark runs it (see the module docstring)."""
    import jax
    from configs import base
    from logra_jax import model_shapes
    config.max_steps = steps
    if model_shapes.is_shape_source(config.model.source):
        config.model.source = (model_shapes.RANDOM_PREFIX
                               + config.model.source[len(model_shapes.SHAPE_PREFIX):])
    if reference_batch:   # before the prompts: the reference batch names its data (GSM8K)
        base.use_reference_batch(config, micro_batch_size=jax.device_count())
    if prompts == "sums":
        config.data.source = "sums"
    config.checkpoint.every = steps
    config.log.update(progress=False, tensorboard=False, sample_every=0)
    return config


def summarize(rows: list[dict], config, devices: int) -> dict:
    """The per-phase split of metrics.jsonl's ``rows``: the first step and the median of the rest."""
    from logra_jax.rl.assembly import rows_per_step
    rl = config.rl
    batch = rows_per_step(config)

    def split(step_rows):
        if not step_rows:
            return None
        phases = {p: statistics.median(r[f"time/{p}"] for r in step_rows) for p in PHASES}
        step = statistics.median(r["time/step"] for r in step_rows)
        generated = statistics.median(r["completions/mean_length"] for r in step_rows) * batch
        return dict(seconds=phases, step_seconds=step, generated_tokens=generated,
                    generated_tokens_per_second_per_device=generated / step / devices,
                    window_tokens_per_second_per_device=(
                        batch * rl.max_prompt_length + generated) / step / devices)

    return dict(model=config.model.source, optimizer=config.optimizer.name, devices=devices,
                rows=batch, prompt_window=rl.max_prompt_length,
                max_completion_length=rl.max_completion_length,
                micro_batch_size=rl.micro_batch_size, steps=len(rows),
                first=split(rows[:1]), steady=split(rows[1:]))


def print_summary(s: dict, backend: str, device_kind: str) -> None:
    print(f"{s['model']}, {s['optimizer']}: {s['rows']} rows of {s['prompt_window']} + ≤ "
          f"{s['max_completion_length']} tokens per step, micro-batches of {s['micro_batch_size']}; "
          f"{s['devices']} × {backend} ({device_kind})")
    print(f"{'':22} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'step s':>8} {'gen tok/s/dev':>14}")
    for label, part in (("first step (compiles)", s["first"]),
                        (f"median of {s['steps'] - 1} more", s["steady"])):
        if part is None:
            continue
        print(f"{label:22} " + " ".join(f"{part['seconds'][p]:>9.2f}" for p in PHASES)
              + f" {part['step_seconds']:>8.2f} "
              f"{part['generated_tokens_per_second_per_device']:>14.1f}")


def main(argv):
    del argv
    if _STEPS.value < 2:
        sys.exit(f"error: --steps must be ≥ 2 (the first compiles), got {_STEPS.value}")
    from launch import process
    process.setup(1)   # one CPU device unless LOGRA_HOST_DEVICES says more
    import jax
    from logra_jax import metrics as metrics_lib
    from logra_jax.rl import trainer

    config = prepare(_CONFIG.value, _STEPS.value, _PROMPTS.value, _REFERENCE.value)
    workdir = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp(prefix="rl_step_time_"))
    tic = time.perf_counter()
    try:
        trainer.train(config, workdir, fresh=True)
        rows = metrics_lib.read_jsonl(workdir / "metrics.jsonl")
    except ValueError as e:
        sys.exit(f"error: {e}")
    finally:
        if _WORKDIR.value is None:
            shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(rows, config, jax.device_count())
    summary.update(wall_seconds=time.perf_counter() - tic, backend=jax.default_backend(),
                   device_kind=jax.devices()[0].device_kind)
    print_summary(summary, summary["backend"], summary["device_kind"])
    if _JSON.value:
        pathlib.Path(_JSON.value).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    cli.run(main, required=("config",))
