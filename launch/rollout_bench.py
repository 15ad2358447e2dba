"""A whole rollout on a completion-length schedule: the static engine against the slot engine.

    python -m launch.rollout_bench [--prompts 4] [--samples 4] [--prompt_length 64] \
        [--completion_length 256] [--schedule lognormal:32] [--slots 16,8] [--repeats 3] \
        [--json out.json] [--config.model.source=...]

Both engines of `rl.sampler.Sampler` sample the same rollout batch (``prompts`` random prompts
× ``samples`` rows each, adjacent rows of a group sharing their prompt) from the default job's
model, in one process, each row forced to end at its length from ``--schedule`` (`launch.cost`'s
schedules: ``lognormal:M`` or a file of lengths; `Sampler.generate`'s ``lengths``), with an
end-of-sequence id no row can draw. Calls alternate engine by engine, round by round, so that
background load hits all alike (one slot engine per ``--slots`` count); the table gives each
engine's median seconds, the row-steps its
decode executed (`SampleOutput.token_steps`), the kept tokens over them (efficiency) and its
seconds over the static engine's. The tokens of the two are compared (they must be equal: the
draw is keyed by row and position, `rl/sampler/draw.py`).
"""

import json
import sys

from absl import flags

from launch import cli
from launch.bench_stats import cpu_model, interleaved_medians

_CONFIG = cli.define_config(default="configs/default.py", help_string="The model's config.",
                            lock_config=False)
_PROMPTS = flags.DEFINE_integer("prompts", 4, "Prompts (groups) in the rollout batch.")
_SAMPLES = flags.DEFINE_integer("samples", 4, "Rows per prompt (rl.num_generations).")
_PROMPT = flags.DEFINE_integer("prompt_length", 64, "Prompt tokens per row.")
_COMPLETION = flags.DEFINE_integer("completion_length", 256, "The completion window (the cap).")
_SCHEDULE = flags.DEFINE_string("schedule", "lognormal:32",
                                "Completion lengths: lognormal:M (median M, σ 1) or a file of "
                                "one length per row.")
_SLOTS = flags.DEFINE_list("slots", ["0"], "The slot engines' decode slots, one engine per count; "
                           "0: every row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per engine, after one warm-up.")
_JSON = flags.DEFINE_string("json", None, "Also write the table to this JSON file.")


def main(argv):
    del argv
    if min(_PROMPTS.value, _SAMPLES.value, _PROMPT.value, _COMPLETION.value, _REPEATS.value) < 1:
        sys.exit("error: --prompts, --samples, --prompt_length, --completion_length and "
                 "--repeats must be ≥ 1")
    rows = _PROMPTS.value * _SAMPLES.value
    try:
        counts = [int(n) or rows for n in _SLOTS.value]
    except ValueError:
        sys.exit(f"error: --slots must be integers, got {_SLOTS.value}")
    bad = [n for n in counts if n < 0 or n % _SAMPLES.value]
    if bad:
        sys.exit(f"error: --slots {bad}: each must be a positive multiple of --samples {_SAMPLES.value}")
    from launch import process
    process.setup(1)
    import jax
    from logra_jax.perf.gpu_programs import completion_schedule
    try:
        schedule, lengths = completion_schedule(_SCHEDULE.value, rows, _COMPLETION.value)
    except ValueError as e:
        sys.exit(f"error: {e}")
    import numpy as np
    from logra_jax.rl import build
    from logra_jax.rl.policy import Policy
    from logra_jax.rl.sampler import Sampler

    config = _CONFIG.value
    mesh = build.build_mesh({"fsdp": 1, "tensor": 1}, jax.devices()[:1])
    model, _ = build.build_model(config.model, mesh)
    policy, params = Policy(model), Policy.params_of(model)
    del model
    never = 2**30                                     # an id outside the vocabulary
    kw = dict(max_prompt_length=_PROMPT.value, max_completion_length=_COMPLETION.value,
              eos_ids=[never], pad_id=0, decode_weights="auto")
    engines = {"static": Sampler(policy, **kw)}
    engines.update({f"slots {n}": Sampler(policy, engine="slots", group_size=_SAMPLES.value,
                                          slots=n, **kw) for n in dict.fromkeys(counts)})
    prompts = np.random.default_rng(0).integers(1, 1000, (_PROMPTS.value, _PROMPT.value), np.int32)
    tokens = np.repeat(prompts, _SAMPLES.value, axis=0)
    mask = np.ones_like(tokens, bool)
    key = jax.random.key(0)
    lengths = np.asarray(lengths, np.int32)
    outputs = {}

    def call(name):
        def run():
            outputs[name] = engines[name].generate(params, tokens, mask, key, lengths=lengths)
            return outputs[name].tokens
        return run

    seconds = interleaved_medians({name: call(name) for name in engines}, _REPEATS.value)
    print(f"{cpu_model()}; {jax.default_backend()} ({jax.devices()[0].device_kind}); model "
          f"{config.model.source} ({config.model.dtype}); {_PROMPTS.value} prompts × "
          f"{_SAMPLES.value} samples, {_PROMPT.value} + {_COMPLETION.value} tokens; schedule "
          f"{schedule['spec']} (kept {int(lengths.sum())} tokens, longest {int(lengths.max())}); "
          f"median of {_REPEATS.value} calls, engines alternated")
    print(f"{'engine':>9} {'seconds':>8} {'row-steps':>9} {'efficiency':>10} {'time/static':>11}")
    rows_out = []
    for name, out in outputs.items():
        steps = int(np.asarray(out.token_steps).sum())
        kept = int(np.asarray(out.mask).sum())
        print(f"{name:>9} {seconds[name]:>8.2f} {steps:>9} {kept / steps:>10.3f} "
              f"{seconds[name] / seconds['static']:>11.3f}")
        rows_out.append(dict(engine=name, seconds=seconds[name], row_steps=steps, kept_tokens=kept,
                             efficiency=kept / steps,
                             time_over_static=seconds[name] / seconds["static"],
                             kept_tokens_per_second=kept / seconds[name]))
    same = all(np.array_equal(outputs["static"].tokens, out.tokens) for out in outputs.values())
    print(f"same tokens from every engine: {'yes' if same else 'NO'}")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(dict(device_kind=jax.devices()[0].device_kind, backend=jax.default_backend(),
                           model=config.model.source, dtype=config.model.dtype,
                           prompts=_PROMPTS.value, samples=_SAMPLES.value,
                           prompt_length=_PROMPT.value, completion_length=_COMPLETION.value,
                           schedule=schedule["spec"], kept_tokens=int(lengths.sum()),
                           longest=int(lengths.max()), repeats=_REPEATS.value, engines=rows_out,
                           same_tokens=same), f, indent=1)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)
