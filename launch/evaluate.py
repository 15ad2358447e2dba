"""Greedy accuracy before and after training, on the same fixed questions.

    python -m launch.evaluate --config configs/default.py --gsm8k_dir /path/to/gsm8k \
        [--run logra=runs/sweep/logra-0 --run adamw=runs/sweep/adamw-0 ...] \
        [--data gsm8k|task] [--num_examples 64] [--max_completion_length 256] [--out eval.json]

Evaluates the config's initial weights ("initial") and the latest checkpoint of every ``--run``
(workdirs trained with this config's model; a LoRA run's adapters are merged into its base) on the
first ``num_examples`` questions of GSM8K test (``--data gsm8k``, prompt: the question +
DEFAULT_INSTRUCTION) or on held-out questions of the config's reasoning-gym task (``--data task``,
a task seed the training did not use, the config's own prompt). One greedy completion per
question, graded like a rollout. Prints a table and, with ``--out``, writes every completion and
grade as JSON. One process compiles the sampler once.
"""

import json
import pathlib
import sys

from absl import flags

from launch import cli

_CONFIG = cli.define_config(help_string="The runs' configs/*.py file (or a run's config.json).")
_RUNS = flags.DEFINE_multi_string("run", [], "label=workdir of a training run (latest checkpoint).")
_INITIAL = flags.DEFINE_bool("initial", True, "Also evaluate the config's initial weights.")
_DATA = flags.DEFINE_enum("data", "gsm8k", ["gsm8k", "task"], "Which questions.")
_GSM8K_DIR = flags.DEFINE_string("gsm8k_dir", None, "Folder with test.jsonl (default: the "
                                 "config's data.gsm8k_dir).")
_NUM = flags.DEFINE_integer("num_examples", 64, "The first N questions.")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Questions per sampler call.")
_PROMPT_LEN = flags.DEFINE_integer("max_prompt_length", 320, "Prompt tokens (left-padded).")
_COMPLETION_LEN = flags.DEFINE_integer("max_completion_length", 256, "Completion tokens.")
_TASK_SEED = flags.DEFINE_integer("task_seed", None, "--data task: the held-out seed (default: "
                                  "the config's data.task_seed + 1).")
_OUT = flags.DEFINE_string("out", None, "JSON file for every completion and grade.")


def questions(config, data: str):
    """(name, examples, instruction) of the evaluation set."""
    from logra_jax.data import DEFAULT_INSTRUCTION
    d = config.data
    if data == "gsm8k":
        folder = _GSM8K_DIR.value or d.gsm8k_dir
        if not folder:
            raise ValueError("--data gsm8k needs --gsm8k_dir (a folder with test.jsonl) or "
                             "data.gsm8k_dir in the config")
        from logra_jax.data.gsm8k import load_gsm8k   # tensorflow_datasets: GSM8K's alone
        source = load_gsm8k(folder, "test", cache_dir=d.gsm8k_cache_dir or None)
        name, instruction = "gsm8k test", DEFAULT_INSTRUCTION
    else:
        seed = _TASK_SEED.value if _TASK_SEED.value is not None else d.task_seed + 1
        from logra_jax.data.tasks import make_task_source   # reasoning_gym: the tasks' alone
        source = make_task_source(d.task, size=_NUM.value, seed=seed, **dict(d.task_kwargs))
        name, instruction = f"{d.task} seed {seed}", d.instruction or None
    if _NUM.value > len(source):
        raise ValueError(f"--num_examples={_NUM.value} but {name} has {len(source)} questions")
    return f"{name}[:{_NUM.value}]", [source[i] for i in range(_NUM.value)], instruction


def main(argv):
    del argv
    from launch import process
    process.setup(8)   # the mesh of launch.train's runs (LOGRA_HOST_DEVICES: another count)
    process.start_backend()
    from logra_jax import sharding as sharding_lib
    from logra_jax.export import restore_policy
    from logra_jax.rl import build
    from logra_jax.rl.evaluation import greedy_accuracy
    from logra_jax.rl.policy import Policy
    from logra_jax.rl.sampler import Sampler

    config = _CONFIG.value
    try:
        runs = cli.parse_labelled(_RUNS.value, "run")
        for label, workdir in runs.items():
            if not (workdir / "checkpoints").is_dir():
                raise FileNotFoundError(f"--run {label}={workdir}: no checkpoints folder there")
            if not (workdir / "config.json").is_file():
                raise FileNotFoundError(f"--run {label}={workdir}: no config.json there")
        name, examples, instruction = questions(config, _DATA.value)
        # Only what sampling needs: the mesh and the model (its initial weights are the template
        # every checkpoint's params are restored into); no optimizer, no reference copy.
        mesh = build.build_mesh(config.mesh)
        model, tokenizer = build.build_model(config.model, mesh)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    policy = Policy(model)
    params = Policy.params_of(model)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    sampler = Sampler(policy, max_prompt_length=_PROMPT_LEN.value,
                      max_completion_length=_COMPLETION_LEN.value, eos_ids=[tokenizer.eos_id],
                      pad_id=pad_id, decode_weights=config.rl.decode_weights)
    sharding = sharding_lib.batch_sharding(mesh, _BATCH.value)
    weights = {"initial": (0, params)} if _INITIAL.value else {}
    for label, workdir in runs.items():
        try:   # a LoRA run's adapters come back merged into the base: one sampler for every run
            weights[label] = restore_policy(workdir, params)
        except (ValueError, FileNotFoundError) as e:
            sys.exit(f"error: --run {label}: {e}")

    print(f"{name}, greedy, {_COMPLETION_LEN.value} completion tokens")
    print(f"{'weights':>12} {'step':>5} {'correct':>8} {'accuracy':>9} {'clipped':>8}")
    report = {}
    for label, (step, p) in weights.items():
        try:
            result = greedy_accuracy(sampler, p, tokenizer, examples, batch_size=_BATCH.value,
                                     instruction=instruction,
                                     system_prompt=config.data.system_prompt or None,
                                     batch_sharding=sharding)
        except ValueError as e:
            sys.exit(f"error: {e}")
        s = result.summary()
        print(f"{label:>12} {step:>5} {s['num_correct']:>4}/{s['num_questions']:<3} "
              f"{s['accuracy']:>9.3f} {s['clipped_ratio']:>8.2f}", flush=True)
        report[label] = dict(s, step=step, completions=result.completions,
                             answers=result.answers, correct=result.correct)
    if _OUT.value:
        out = pathlib.Path(_OUT.value)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(questions=name, results=report), indent=1))


if __name__ == "__main__":
    cli.run(main, required=("config",))
