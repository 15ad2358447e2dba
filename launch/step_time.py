"""Real policy updates, LoGRA vs dense AdamW: wall time per update, and peak device memory.

Step time (CPU by default, any backend):

    python -m launch.step_time [--widths 512,1024,2048] [--layers 2] [--rows 8] \
        [--prompt_length 64] [--completion_length 192] [--repeats 5] [--rank 256] [--micro_steps 1]

builds, per width d, a decoder with d-wide layers (launch/update_bench.py) (head_dim 64, GQA 2:1, MLP 3d, vocabulary
``--vocab`` = 8192, fp32, per-layer remat), runs the trainer's jitted update (`PolicyUpdate`, as configs/base.py sets
it up, GRPO loss, same batch and sequence for both optimizers) on a random batch, and times it:
one warm-up (compile) call each, then ``repeats`` rounds in which the two optimizers alternate
(their order flips every round, so background load hits both alike). It prints the median
milliseconds of each, their ratio LoGRA / AdamW, the median (and range) of the per-round ratios —
the paired estimate, which a slow spell of a shared machine moves least — and the matrix-product
operations of each compiled update (logra_jax/perf/matmul_count.py: every dot of the optimized HLO, times
the trip counts of the loops it runs in), which shared or busy machines cannot disturb. XLA's own
``cost_analysis()["flops"]`` counts a loop's body once: one micro-step of one layer, not the update.

The default update holds 8 × 256 = 2048 tokens: what one device trains on per micro-step in
configs/qwen2_5_7b_gsm8k.py. LoGRA's fixed cost per update (merging ΔW = −η·D·A: 2·r·in·out
operations per target, what a dense weight gradient of r tokens costs) is shared by every token of
the update, so fewer tokens favour AdamW, and an RL update of many micro-batches favours LoGRA more
than this single micro-batch does. ``--micro_steps K`` makes one update K micro-batches of
``rows`` (configs/qwen2_5_7b_gsm8k.py: K = 32 per training device, one 2048-token sequence each):
the sketches are paid every micro-step, the merge once. The table starts with the CPU model
(XLA picks other kernels on AVX2 and AVX-512 machines).

A 7B-proportioned stand-in at width 512 scales what sets the ratio with the width: the rank
(r/in = 256/3584 = 0.07 at 7B: ``--rank 32``) and the head (the 7B head is 8 % of its layers'
weights, the default 8192-entry vocabulary at width 512 with 2 layers 67 %: ``--vocab 1024``),
with the 7B config's 32 micro-steps: ``--widths 512 --rank 32 --vocab 1024 --micro_steps 32``.
Width 512 leaves more of an update to work that is not a product (norms, attention's softmax,
SiLU, copies: per token ∝ d, the products ∝ d²) than the 7B model has; the same proportions at
width 2048 are ``--widths 2048 --rank 144 --vocab 4096`` (a few micro-steps: each takes seconds).

LoGRA's merge is one plain fp32 dot here, as in any run whose merges no rollout engine replays
(rl/build.py: replays_merge). ``--exact_merge`` also times LoGRA with the order-free merge that a
factors receiver needs (optim/order_free.py: two exact dots per layer), in the same interleaved
rounds, as two more columns.

The merge alone (``--merge``, launch/merge_time.py): per width, ``LowRankUpdate.merge_into`` of a
stack of ``layers`` (d × 3d) MLP kernels — the order-free product of optim/order_free.py — against
the same merge with one plain fp32 dot (``exact=False``), interleaved medians of ``repeats`` runs
each.

Where the time goes (``--profile``, launch/update_profile.py): per width, one update of each optimizer (after two warm-up
calls) runs under ``jax.profiler`` and logra_jax/perf/profiling.py splits its wall time into
categories (the model's matmuls and other operations, LoGRA's sketch products, A's generation,
the merge, the optimizer); the table gives both optimizers' milliseconds side by side.

The operations of a real config's update, from shapes alone (no weights, no run):

    python -m launch.step_time --config configs/qwen2_5_7b_gsm8k.py --count_ops

(launch/op_counts.py) compiles the config's update for LoGRA and for AdamW and prints their matrix-product operations
(matmul_count, every loop iteration counted) and the ratio: what the two updates' arithmetic
allows, which the stand-in above scales down. The whole batch sits on one device here (FSDP
splits only rows, so the ratio is the config's layout's).

Peak memory (for an accelerator; one optimizer per process, because the high-water mark of a
device cannot be reset):

    python -m launch.step_time --config configs/qwen2_5_1_5b.py --peak_memory --optimizer logra

(launch/peak_memory.py) runs one update of the config's model shape with random weights and prints one JSON line with the
device's ``peak_bytes_in_use`` next to XLA's ahead-of-time prediction for the same program. The
update is compiled first: when XLA's plan needs more than the device may hold (its allocator's
``bytes_limit``, or ``--memory_budget_gib``: on a CPU, which has no limit of its own, XLA:CPU's
plan is judged against that budget) the update is not run and the line before the JSON says
``<optimizer>: does not fit: needs X GiB (...)``, X being XLA's figure; so does a
RESOURCE_EXHAUSTED from XLA itself, with the figure its message or log states.
"""

import dataclasses
import json
import statistics
import sys
import time

from absl import flags

from launch import cli
from launch.bench_stats import cpu_model, paired_ratio
from launch.merge_time import print_merge, time_merge
from launch.op_counts import count_ops, print_counts, ratio
from launch.peak_memory import peak_memory
from launch.update_bench import random_update, width_configs
from launch.update_profile import print_profiles, profile_widths

_CONFIG = cli.define_config(help_string="configs/*.py for --peak_memory or --count_ops.",
                            lock_config=False)
_PEAK = flags.DEFINE_bool("peak_memory", False, "Measure one update's peak device memory.")
_COUNT = flags.DEFINE_bool("count_ops", False, "Print the matmul operations of --config's update, "
                           "LoGRA vs AdamW, from shapes alone.")
_OPTIMIZER = flags.DEFINE_enum("optimizer", "logra", ["logra", "adamw"], "For --peak_memory.")
_BUDGET = flags.DEFINE_float("memory_budget_gib", None, "For --peak_memory: the GiB one device may "
                             "hold (default: the device's own limit; a CPU has none). An update "
                             "whose compiled plan needs more is reported as `does not fit` and "
                             "not run.")
_WIDTHS = flags.DEFINE_list("widths", ["512", "1024", "2048"], "Model widths d to time.")
_LAYERS = flags.DEFINE_integer("layers", 2, "Decoder layers.")
_ROWS = flags.DEFINE_integer("rows", 8, "Sequences per update (one micro-batch).")
_PROMPT = flags.DEFINE_integer("prompt_length", 64, "Prompt tokens per sequence.")
_COMPLETION = flags.DEFINE_integer("completion_length", 192, "Completion tokens per sequence.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed updates per optimizer (after one warm-up); "
                                "0: only the operation counts (compile, no run).")
_RANK = flags.DEFINE_integer("rank", 256, "LoGRA rank r.")
_MERGE = flags.DEFINE_bool("merge", False, "Time the low-rank merge alone: order-free vs a plain dot.")
_EXACT = flags.DEFINE_bool("exact_merge", False, "Also time LoGRA with the order-free merge a "
                           "factors receiver needs (optimizer.logra.exact_merge=True).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_MICRO = flags.DEFINE_integer("micro_steps", 1, "Micro-batches of --rows per update.")
_VOCAB = flags.DEFINE_integer("vocab", 8192, "Vocabulary size (the head's width).")
_JSON = flags.DEFINE_string("json", None, "Also write the timing table (one entry per width) to "
                            "this JSON file.")
_PROFILE = flags.DEFINE_bool("profile", False, "Profile one update of each optimizer per width "
                             "and print where its wall time goes (instead of timing).")


EXACT = "logra exact merge"   # LoGRA with the order-free merge (--exact_merge)


@dataclasses.dataclass(frozen=True)
class WidthTiming:
    """One width's timing: the model's parameter count; per run ("logra", "adamw", ``EXACT``) the
    median milliseconds of an update, its compiled matmul FLOPs (loops as they run), and — for
    every run but AdamW — the paired ratio to AdamW (median, min, max over rounds)."""

    width: int
    params: int
    ms: dict
    flops: dict
    paired: dict


def time_widths(widths, layers, rows, prompt_length, completion_length, rank, dtype, repeats,
                micro_steps=1, vocab=8192, exact_merge=False) -> list[WidthTiming]:
    """A `WidthTiming` per width (see the module docstring). Runs are "logra" and "adamw", and
    ``EXACT`` with ``exact_merge``."""
    import jax
    from logra_jax.perf import matmul_count

    mesh, setups = width_configs(widths, layers, rows, prompt_length, completion_length, rank,
                                 dtype, micro_steps, vocab)
    names = ("logra", "adamw") + ((EXACT,) if exact_merge else ())
    results = []
    for width, config, model_config in setups:
        runs, times, flops = {}, {name: [] for name in names}, {}
        for name in times:
            config.optimizer.name = "adamw" if name == "adamw" else "logra"
            config.optimizer.logra.exact_merge = True if name == EXACT else None
            update, params, opt_state, batch = random_update(config, model_config, mesh)
            # The program's matmul operations, loops counted as they run: a noise-free companion
            # to the clock.
            compiled = update.jitted(params, opt_state).lower(params, opt_state, batch).compile()
            flops[name] = matmul_count.of_compiled(compiled).flops
            if repeats:
                params, opt_state, metrics = update(params, opt_state, batch)   # warm-up
                jax.block_until_ready(metrics)
            runs[name] = [update, params, opt_state, batch]
        n_params = sum(x.size for x in jax.tree.leaves(runs["logra"][1]))
        for i in range(repeats):
            for name in (names if i % 2 == 0 else names[::-1]):
                update, params, opt_state, batch = runs[name]
                tic = time.perf_counter()
                params, opt_state, metrics = update(params, opt_state, batch)
                jax.block_until_ready((params, opt_state, metrics))
                times[name].append(1e3 * (time.perf_counter() - tic))
                runs[name][1:3] = params, opt_state
        results.append(WidthTiming(width, n_params, {k: statistics.median(v) if v else float("nan")
                                                     for k, v in times.items()}, flops,
                                   {k: paired_ratio(times, k, "adamw") for k in names if k != "adamw"}))
        del runs
    return results


def print_timing(results: list[WidthTiming], exact_merge: bool) -> None:
    """The timing table, one row per width, and the last width's ratios in one line."""
    import jax
    print(cpu_model())
    print(f"one update, {_MICRO.value} micro-step(s) of {_ROWS.value} × "
          f"{_PROMPT.value + _COMPLETION.value} tokens, {_LAYERS.value} layers, vocabulary "
          f"{_VOCAB.value}, rank {_RANK.value}, {_DTYPE.value}, remat, {jax.default_backend()} × {jax.device_count()}; "
          + (f"median of {_REPEATS.value} interleaved runs" if _REPEATS.value else "operation counts only"))
    # time ratio: of the two medians; paired: the median of per-round ratios, with their range.
    exact = f" {'exact ms':>9} {'exact paired':>13}" if exact_merge else ""
    print(f"{'width':>6} {'params':>8} {'logra ms':>9} {'adamw ms':>9} {'time ratio':>11} "
          f"{'paired':>7} {'range':>11} {'logra GFLOP':>12} {'adamw GFLOP':>12} "
          f"{'FLOP ratio':>11}" + exact)
    for r in results:
        exact = (f" {r.ms[EXACT]:>9.1f} {r.paired[EXACT][0]:>13.3f}" if EXACT in r.ms else "")
        median, low, high = r.paired["logra"]
        print(f"{r.width:>6} {r.params / 1e6:>7.1f}M {r.ms['logra']:>9.1f} {r.ms['adamw']:>9.1f} "
              f"{r.ms['logra'] / r.ms['adamw']:>11.3f} {median:>7.3f} {f'{low:.3f}–{high:.3f}':>11} "
              f"{r.flops['logra'] / 1e9:>12.1f} {r.flops['adamw'] / 1e9:>12.1f} "
              f"{ratio(r.flops['logra'], r.flops['adamw']):>11.3f}" + exact)
    last = results[-1]
    print(f"at width {last.width}: logra/adamw time ratio {last.ms['logra'] / last.ms['adamw']:.3f} "
          f"(paired {last.paired['logra'][0]:.3f}), FLOP ratio "
          f"{ratio(last.flops['logra'], last.flops['adamw']):.3f} (matrix products, every loop "
          f"iteration counted)")


def write_timing_json(path: str, results: list[WidthTiming]) -> None:
    import jax
    with open(path, "w") as f:
        json.dump({"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
                   "dtype": _DTYPE.value, "layers": _LAYERS.value, "rows": _ROWS.value,
                   "tokens": _PROMPT.value + _COMPLETION.value, "micro_steps": _MICRO.value,
                   "rank": _RANK.value, "vocab": _VOCAB.value, "repeats": _REPEATS.value,
                   "widths": [{"width": r.width, "params": r.params, "ms": r.ms, "flops": r.flops,
                               "paired": {k: list(v) for k, v in r.paired.items()}}
                              for r in results]}, f, indent=1)


def _count_ops_main() -> None:
    if _CONFIG.value is None:
        sys.exit("error: --count_ops needs --config")
    try:
        counts = count_ops(_CONFIG.value)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print_counts(_CONFIG.value, counts)


def _peak_memory_main() -> None:
    if _CONFIG.value is None:
        sys.exit("error: --peak_memory needs --config")
    if _BUDGET.value is not None and not _BUDGET.value > 0:
        sys.exit(f"error: --memory_budget_gib must be > 0, got {_BUDGET.value}")
    try:
        result = peak_memory(_CONFIG.value, _OPTIMIZER.value, _BUDGET.value)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    if not result["fits"]:
        print(f"{result['optimizer']}: {result['message']}")
    print(json.dumps(result))   # the last line: one JSON object


def _widths() -> list[int]:
    """--widths, after the checks every width-based mode needs (one line each on bad input)."""
    try:
        widths = [int(w) for w in _WIDTHS.value]
    except ValueError:
        sys.exit(f"error: --widths must be integers, got {_WIDTHS.value}")
    bad = [w for w in widths if w <= 0 or w % 128]
    if bad:
        sys.exit(f"error: widths must be positive multiples of 128 (head_dim 64, GQA 2:1), got {bad}")
    if min(widths) <= _RANK.value:
        sys.exit(f"error: every width must exceed --rank {_RANK.value} (a sketch as wide as the "
                 f"weight compresses nothing), got {min(widths)}")
    if _REPEATS.value < 0:
        sys.exit(f"error: --repeats must be ≥ 0, got {_REPEATS.value}")
    if _ROWS.value < 2 or _ROWS.value % 2:
        sys.exit(f"error: --rows must be an even number ≥ 2 (GRPO groups of 2), got {_ROWS.value}")
    if _MICRO.value < 1:
        sys.exit(f"error: --micro_steps must be ≥ 1, got {_MICRO.value}")
    if _VOCAB.value < 2:
        sys.exit(f"error: --vocab must be ≥ 2, got {_VOCAB.value}")
    return widths


def _merge_main(widths: list[int]) -> None:
    if _REPEATS.value < 1:
        sys.exit("error: --merge times the merge: it needs --repeats ≥ 1")
    print(cpu_model())
    print_merge(time_merge(widths, _LAYERS.value, _RANK.value, _REPEATS.value), _LAYERS.value,
                _RANK.value, _REPEATS.value)


def _profile_main(widths: list[int]) -> None:
    import jax
    print(cpu_model())
    print(f"one update, {_MICRO.value} micro-step(s) of {_ROWS.value} × "
          f"{_PROMPT.value + _COMPLETION.value} tokens, {_LAYERS.value} layers, vocabulary "
          f"{_VOCAB.value}, rank "
          f"{_RANK.value}, {_DTYPE.value}, remat, {jax.default_backend()} × {jax.device_count()}")
    print_profiles(profile_widths(widths, _LAYERS.value, _ROWS.value, _PROMPT.value,
                                  _COMPLETION.value, _RANK.value, _DTYPE.value, _MICRO.value,
                                  _VOCAB.value))


def main(argv):
    del argv
    from launch import process
    # The timing compares the two optimizers on one device (8 simulated CPU devices would only
    # split the same cores 8 ways); LOGRA_HOST_DEVICES gives more.
    process.setup(1)
    if _COUNT.value:
        return _count_ops_main()
    if _PEAK.value:
        return _peak_memory_main()
    widths = _widths()
    if _MERGE.value:
        return _merge_main(widths)
    if _PROFILE.value:
        return _profile_main(widths)
    results = time_widths(widths, _LAYERS.value, _ROWS.value, _PROMPT.value, _COMPLETION.value,
                          _RANK.value, _DTYPE.value, _REPEATS.value, _MICRO.value, _VOCAB.value,
                          _EXACT.value)
    print_timing(results, _EXACT.value)
    if _JSON.value:
        write_timing_json(_JSON.value, results)


if __name__ == "__main__":
    cli.run(main)
