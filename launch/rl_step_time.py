"""Seconds per RL step of the whole loop, split by phase: the figure to compare with other RL
frameworks.

    python -m launch.rl_step_time --config configs/qwen2_5_1_5b.py [--steps 3] [--json out.json] \
        [--reference_batch] [--prompts sums|config] [--lag 0,1] [--config.…=…]

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

``--lag 0,1``: one run per ``rl.max_lag`` value, in this process, printed side by side. A
pipelined run (η ≥ 1, logra_jax/rl/pipeline.py) splits its step differently: ``rollout`` is the
queuing of the next rollout's sampling, ``overlap_host`` the decode and grading of it while the
devices sample and update, ``update_wait`` the wait for the update's results after that host
work. ``overlap`` is the overlap achieved: the steady step's seconds saved against the η = 0 run
of the same invocation (what the pipeline hid of the sequential step; negative: it cost time). On XLA:CPU the simulated devices share the host's cores (LOGRA_HOST_DEVICES=8 makes
8 of them; ``--config.sync.rollout_devices=4`` gives the sampler 4 of its own), so what overlaps
there is the host work, not the devices': it is no prediction of a GPU's gain.

The run ends with the trainer's checkpoint of the last step (its seconds are not in any phase);
the workdir is deleted afterwards unless ``--workdir`` names one.
"""

import copy
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
_LAG = flags.DEFINE_list("lag", [], "rl.max_lag values to run one after another and print side "
                         "by side (default: the config's own).")
_REFERENCE = flags.DEFINE_bool("reference_batch", False, "The reference GRPO batch (16 × 8 rows of "
                               "512 + 1536 tokens).")

PHASES = ("rollout", "reward", "reference", "update", "overlap_host", "update_wait", "sync")


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
        # A sequential run has no overlap_host / update_wait: 0 s.
        phases = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in step_rows) for p in PHASES}
        step = statistics.median(r["time/step"] for r in step_rows)
        generated = statistics.median(r["completions/mean_length"] for r in step_rows) * batch
        return dict(seconds=phases, step_seconds=step, generated_tokens=generated,
                    generated_tokens_per_second_per_device=generated / step / devices,
                    window_tokens_per_second_per_device=(
                        batch * rl.max_prompt_length + generated) / step / devices)

    return dict(model=config.model.source, optimizer=config.optimizer.name, devices=devices,
                lag=config.rl.max_lag, rollout_devices=config.sync.rollout_devices,
                rows=batch, prompt_window=rl.max_prompt_length,
                max_completion_length=rl.max_completion_length,
                micro_batch_size=rl.micro_batch_size, steps=len(rows),
                first=split(rows[:1]), steady=split(rows[1:]))


def print_summary(summaries: list[dict], backend: str, device_kind: str) -> None:
    """One table: per run (one per lag) its first step and the median of the others."""
    s = summaries[0]
    print(f"{s['model']}, {s['optimizer']}: {s['rows']} rows of {s['prompt_window']} + ≤ "
          f"{s['max_completion_length']} tokens per step, micro-batches of {s['micro_batch_size']}; "
          f"{s['devices']} × {backend} ({device_kind}), {s['rollout_devices']} of them the "
          f"sampler's own")
    names = [p if len(p) <= 9 else p.replace("_", " ")[:9] for p in PHASES]
    print(f"{'':26} " + " ".join(f"{p:>9}" for p in names) + f" {'step s':>8} "
          f"{'gen tok/s/dev':>14} {'overlap':>9}")
    base = next((x["steady"] for x in summaries if x["lag"] == 0 and x["steady"]), None)
    for s in summaries:
        for label, part in ((f"lag {s['lag']}: first (compiles)", s["first"]),
                            (f"lag {s['lag']}: median of {s['steps'] - 1}", s["steady"])):
            if part is None:
                continue
            saved = (f"{base['step_seconds'] - part['step_seconds']:>+9.2f}"
                     if base is not None and part is s["steady"] else f"{'':>9}")
            print(f"{label:26} " + " ".join(f"{part['seconds'][p]:>9.2f}" for p in PHASES)
                  + f" {part['step_seconds']:>8.2f} "
                  f"{part['generated_tokens_per_second_per_device']:>14.1f} {saved}")


def main(argv):
    del argv
    if _STEPS.value < 2:
        sys.exit(f"error: --steps must be ≥ 2 (the first compiles), got {_STEPS.value}")
    lags = [v.strip() for v in _LAG.value]
    if not all(v.isdigit() for v in lags):   # before jax is imported: a refusal in a moment
        sys.exit(f"error: --lag takes integers ≥ 0 separated by commas (rl.max_lag values), "
                 f"got {','.join(_LAG.value)}")
    lags = [int(v) for v in lags]
    from launch import process
    process.setup(1)   # one CPU device unless LOGRA_HOST_DEVICES says more
    import jax
    from logra_jax import metrics as metrics_lib
    from logra_jax.rl import trainer

    config = prepare(_CONFIG.value, _STEPS.value, _PROMPTS.value, _REFERENCE.value)
    summaries = []
    for lag in lags or [config.rl.max_lag]:
        run_config = copy.deepcopy(config)
        run_config.rl.max_lag = lag
        workdir = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp(prefix="rl_step_time_"))
        if _WORKDIR.value and len(lags) > 1:
            workdir = workdir / f"lag{lag}"
        tic = time.perf_counter()
        try:
            trainer.train(run_config, workdir, fresh=True)
            rows = metrics_lib.read_jsonl(workdir / "metrics.jsonl")
        except ValueError as e:
            sys.exit(f"error: {e}")
        finally:
            if _WORKDIR.value is None:
                shutil.rmtree(workdir, ignore_errors=True)
        summary = summarize(rows, run_config, jax.device_count())
        summary.update(wall_seconds=time.perf_counter() - tic, backend=jax.default_backend(),
                       device_kind=jax.devices()[0].device_kind)
        summaries.append(summary)
    print_summary(summaries, summaries[0]["backend"], summaries[0]["device_kind"])
    if _JSON.value:
        result = summaries[0] if len(summaries) == 1 else summaries
        pathlib.Path(_JSON.value).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    cli.run(main, required=("config",))
