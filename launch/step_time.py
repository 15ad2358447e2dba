"""Real policy updates, LoGRA vs dense AdamW: wall time per update, and peak device memory.

Step time (CPU by default, any backend):

    python -m launch.step_time [--widths 512,1024,2048] [--layers 2] [--rows 8] \
        [--prompt_length 64] [--completion_length 192] [--repeats 5] [--rank 256] [--micro_steps 1]

builds, per width d, a decoder with d-wide layers (head_dim 64, GQA 2:1, MLP 3d, vocabulary
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

The merge alone (``--merge``): per width, ``LowRankUpdate.merge_into`` of a stack of ``layers``
(d × 3d) MLP kernels — the order-free product of optim/order_free.py — against the same merge with
one plain fp32 dot (``exact=False``), interleaved medians of ``repeats`` runs each.

Where the time goes (``--profile``): per width, one update of each optimizer (after two warm-up
calls) runs under ``jax.profiler`` and logra_jax/perf/profiling.py splits its wall time into
categories (the model's matmuls and other operations, LoGRA's sketch products, A's generation,
the merge, the optimizer); the table gives both optimizers' milliseconds side by side.

The operations of a real config's update, from shapes alone (no weights, no run):

    python -m launch.step_time --config configs/qwen2_5_7b_gsm8k.py --count_ops

compiles the config's update for LoGRA and for AdamW and prints their matrix-product operations
(matmul_count, every loop iteration counted) and the ratio: what the two updates' arithmetic
allows, which the stand-in above scales down. The whole batch sits on one device here (FSDP
splits only rows, so the ratio is the config's layout's).

Peak memory (for an accelerator; one optimizer per process, because the high-water mark of a
device cannot be reset):

    python -m launch.step_time --config configs/qwen2_5_1_5b.py --peak_memory --optimizer logra

runs one update of the config's model shape with random weights and prints one JSON line with the
device's ``peak_bytes_in_use`` next to XLA's ahead-of-time prediction for the same program. The
update is compiled first: when XLA's plan needs more than the device may hold (its allocator's
``bytes_limit``, or ``--memory_budget_gib``: on a CPU, which has no limit of its own, XLA:CPU's
plan is judged against that budget) the update is not run and the line before the JSON says
``<optimizer>: does not fit: needs X GiB (...)``, X being XLA's figure; so does a
RESOURCE_EXHAUSTED from XLA itself, with the figure its message or log states.
"""

import contextlib
import dataclasses
import json
import statistics
import sys
import time

from absl import flags

from launch import cli
from launch.bench_stats import cpu_model, paired_ratio
from launch.process import captured_stderr

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


def bench_config(width: int, layers: int, rows: int, prompt_length: int, completion_length: int,
                 rank: int, dtype: str, micro_steps: int = 1):
    """configs/base.py with a ``width``-wide random decoder and ``micro_steps`` micro-batches of
    ``rows`` per update."""
    from configs import base
    c = base.get_config()
    c.model.source = "tiny"
    c.model.dtype = dtype
    c.model.remat = True
    c.model.tiny.update(hidden_size=width, num_layers=layers, num_heads=width // 64,
                        num_kv_heads=max(1, width // 128), head_dim=64, intermediate_size=3 * width,
                        max_position_embeddings=prompt_length + completion_length)
    c.data.prompts_per_step = rows * micro_steps // 2
    c.rl.num_generations = 2
    c.rl.micro_batch_size = rows
    c.rl.max_prompt_length = prompt_length
    c.rl.max_completion_length = completion_length
    c.optimizer.logra.rank = rank
    return c


def build(config, model_config, mesh, seed: int = 0):
    """(PolicyUpdate, params, opt_state, batch) with random weights and a random batch, on ``mesh``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from logra_jax.perf import memory
    from logra_jax import sharding as sharding_lib
    from logra_jax.models import Decoder
    from logra_jax.rl.build import build_policy_update
    from logra_jax.rl.policy import Policy, Sequences
    from logra_jax.rl.update import TrainBatch

    model = memory.abstract_model(model_config)
    policy = Policy(model)
    abstract = memory.abstract_params(model, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, abstract)

    # Initialised directly into its shards: a large model never sits whole on one device.
    def init():
        return Policy.params_of(Decoder(model_config, rngs=nnx.Rngs(seed)))
    params = jax.jit(init, out_shardings=shardings)()
    update = build_policy_update(config, policy)
    opt_shardings = sharding_lib.opt_state_shardings(update.tx, abstract)
    opt_state = jax.jit(update.tx.init, out_shardings=opt_shardings)(params)

    rl = config.rl
    rows = config.data.prompts_per_step * rl.num_generations
    p, c = rl.max_prompt_length, rl.max_completion_length
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), 3)
    tokens = jax.random.randint(keys[0], (rows, p + c), 0, model_config.vocab_size, jnp.int32)
    seqs = Sequences(tokens=tokens, segment_mask=jnp.ones((rows, p + c), bool),
                     positions=jnp.broadcast_to(jnp.arange(p + c, dtype=jnp.int32), (rows, p + c)),
                     completion_mask=jnp.ones((rows, c), bool), prompt_length=p)
    batch = TrainBatch(seqs=seqs, advantages=jax.random.normal(keys[1], (rows,)),
                       rollout_logp=-jax.random.uniform(keys[2], (rows, c)),
                       ref_logp=jnp.zeros((rows, c)), completed=jnp.ones((rows,), bool))
    batch = jax.device_put(batch, sharding_lib.batch_sharding(mesh, rows))
    return update, params, opt_state, batch


def width_configs(widths, layers, rows, prompt_length, completion_length, rank, dtype,
                  micro_steps=1, vocab=8192):
    """(mesh over this process's devices, [(width, config, model config)]) of the benchmark."""
    import jax
    from logra_jax import model_shapes
    from logra_jax.rl.build import build_mesh

    mesh = build_mesh({"fsdp": -1, "tensor": 1}, jax.devices(), spare_devices=True)
    setups = []
    for width in widths:
        config = bench_config(width, layers, rows, prompt_length, completion_length, rank, dtype,
                              micro_steps)
        setups.append((width, config,
                       model_shapes.model_config_from(config.model).replace(vocab_size=vocab)))
    return mesh, setups


EXACT = "logra exact merge"   # LoGRA with the order-free merge (--exact_merge)


def time_widths(widths, layers, rows, prompt_length, completion_length, rank, dtype, repeats,
                micro_steps=1, vocab=8192, exact_merge=False):
    """[(width, params, {run: median ms}, {run: matmul flops}, {run: paired_ratio vs AdamW})] — see
    the module docstring. Runs are "logra" and "adamw", and ``EXACT`` with ``exact_merge``."""
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
            update, params, opt_state, batch = build(config, model_config, mesh)
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
        results.append((width, n_params, {k: statistics.median(v) if v else float("nan")
                                          for k, v in times.items()}, flops,
                        {k: paired_ratio(times, k, "adamw") for k in names if k != "adamw"}))
        del runs
    return results


def profile_widths(widths, layers, rows, prompt_length, completion_length, rank, dtype,
                   micro_steps=1, vocab=8192):
    """[(width, {optimizer: profiling.Profile})]: one profiled update each, after two warm-ups
    (the first calls after a compile run slower: fresh buffers)."""
    import jax
    from logra_jax.perf import profiling

    mesh, setups = width_configs(widths, layers, rows, prompt_length, completion_length, rank,
                                 dtype, micro_steps, vocab)
    results = []
    for width, config, model_config in setups:
        profiles = {}
        for name in ("logra", "adamw"):
            config.optimizer.name = name
            update, params, opt_state, batch = build(config, model_config, mesh)
            compiled = update.jitted(params, opt_state).lower(params, opt_state, batch).compile()
            for _ in range(2):
                params, opt_state, _ = jax.block_until_ready(compiled(params, opt_state, batch))
            profiles[name], _ = profiling.profile_call(compiled, (params, opt_state, batch))
            del update, params, opt_state, batch, compiled
        results.append((width, profiles))
    return results


def print_profiles(results):
    from logra_jax.perf import profiling
    order = ([profiling.MATMULS, profiling.OTHER] + [name for _, name in profiling.SCOPES]
             + [profiling.IDLE])
    for width, profiles in results:
        print(f"width {width}: wall ms of one update, split by logra_jax/perf/profiling.py")
        print(f"{'':38} {'logra ms':>9} {'adamw ms':>9} {'logra − adamw':>14}")
        for name in order:
            ms = {k: p.categories.get(name, 0.0) for k, p in profiles.items()}
            if any(ms.values()):
                print(f"{name:38} {ms['logra']:>9.1f} {ms['adamw']:>9.1f} "
                      f"{ms['logra'] - ms['adamw']:>+14.1f}")
        total = {k: sum(p.categories.values()) for k, p in profiles.items()}
        print(f"{'total (traced)':38} {total['logra']:>9.1f} {total['adamw']:>9.1f} "
              f"{total['logra'] - total['adamw']:>+14.1f}   ratio {total['logra'] / total['adamw']:.3f}")


def time_merge(widths, layers, rank, repeats):
    """[(width, {"order-free": median ms, "plain dot": median ms})] for a (layers, d, 3d) stack."""
    import jax
    import jax.numpy as jnp
    from logra_jax.optim.low_rank import LowRankUpdate
    from logra_jax.projections import projection_keys

    merges = {"order-free": jax.jit(lambda k, u: u.merge_into(k), donate_argnums=0),
              "plain dot": jax.jit(lambda k, u: dataclasses.replace(u, exact=False).merge_into(k),
                                   donate_argnums=0)}
    results = []
    for width in widths:
        shape = (layers, width, 3 * width)
        update = LowRankUpdate(
            factor=jax.random.normal(jax.random.PRNGKey(1), (layers, 3 * width, rank)) * 1e-3,
            key=projection_keys(0, "layers/mlp/up_proj/kernel", 0, (layers,)),
            weight_scale=jnp.float32(1.0))
        kernels = {name: jax.random.normal(jax.random.PRNGKey(0), shape) for name in merges}
        times = {name: [] for name in merges}
        for i in range(repeats + 1):                      # the first round compiles
            for name in (list(merges) if i % 2 == 0 else list(merges)[::-1]):
                tic = time.perf_counter()
                kernels[name] = jax.block_until_ready(merges[name](kernels[name], update))
                if i:
                    times[name].append(1e3 * (time.perf_counter() - tic))
        results.append((width, {name: statistics.median(t) for name, t in times.items()}))
    return results


GIB = 2**30


def device_limit(device, budget_gib: float | None) -> tuple[int | None, str]:
    """(bytes one device may hold, where that figure comes from): ``budget_gib`` when given, else
    the allocator's ``bytes_limit`` (on a GPU: XLA_PYTHON_CLIENT_MEM_FRACTION of its memory); a
    CPU reports none."""
    if budget_gib is not None:
        return int(budget_gib * GIB), f"--memory_budget_gib {budget_gib:g}"
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return (int(limit), "the device's bytes_limit") if limit else (None, "none (this device reports no limit)")


@contextlib.contextmanager
def _stderr_copied(into: list):
    """Runs the block with XLA's C++ log lines (file descriptor 2) captured, then writes them to
    stderr and appends them to ``into``: XLA states what a program needs ("only reduced to
    167.29GiB") in a log line, not in the exception."""
    log = None
    try:
        with captured_stderr() as log:
            yield
    finally:
        if log is not None:
            sys.stderr.write(log.text)
            into.append(log.text)


def _does_not_fit(result: dict, needs: int, why: str) -> dict:
    return dict(result, fits=False, needs_bytes=needs, why=why,
                message=f"does not fit: needs {needs / GIB:.2f} GiB ({why})")


def peak_memory(config, optimizer: str, budget_gib: float | None = None) -> dict:
    """One real update of ``config``'s model: device peak bytes vs XLA's prediction (per device).

    The update is compiled first; when XLA's plan of it needs more than the device may hold
    (`device_limit`) it is not run, and the result says ``does not fit: needs X GiB`` with XLA's
    figure — as it does when XLA itself refuses (RESOURCE_EXHAUSTED, anywhere from building the
    weights to running the update): then the figure is the one XLA states in its message or log."""
    import jax
    from logra_jax import model_shapes
    from logra_jax.perf import oom
    from logra_jax.rl.build import build_mesh

    config.optimizer.name = optimizer
    mesh = build_mesh(dict(config.mesh), jax.devices(), spare_devices=True)
    limit, limit_source = device_limit(mesh.devices.flat[0], budget_gib)
    result = {"optimizer": optimizer, "model": config.model.source, "devices": mesh.size,
              "backend": jax.default_backend(), "device_kind": mesh.devices.flat[0].device_kind,
              "limit_bytes": limit, "limit_source": limit_source}
    logs: list[str] = []
    try:
        model_config = model_shapes.model_config_from(config.model)
        update, params, opt_state, batch = build(config, model_config, mesh)
        result["params"] = sum(x.size for x in jax.tree.leaves(params))
        tic = time.perf_counter()
        with _stderr_copied(logs):
            compiled = update.jitted(params, opt_state).lower(params, opt_state, batch).compile()
        result["compile_seconds"] = time.perf_counter() - tic
        predicted = oom.planned_peak(compiled.memory_analysis())
        result["predicted_peak"] = predicted
        if limit is not None and predicted > limit:
            stated = oom.xla_needs("".join(logs))
            why = (f"XLA:{jax.default_backend().upper()}'s plan of the update, "
                   f"{jax.devices()[0].device_kind}; the limit is {limit / GIB:.2f} GiB, "
                   f"{limit_source}")
            if stated:
                why += f"; XLA's log: {stated[1]}"
            return _does_not_fit(result, predicted, why)
        tic = time.perf_counter()   # the program just compiled (a second compile of 7B: minutes)
        params, opt_state, metrics = compiled(params, opt_state, batch)
        jax.block_until_ready((params, opt_state, metrics))
        result["first_update_seconds"] = time.perf_counter() - tic
    except Exception as e:   # XLA's refusal is a result; anything else is not
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        stated = oom.xla_needs("".join(logs) + "\n" + str(e))
        first = str(e).strip().splitlines()[0]
        if stated is None:
            return dict(result, fits=False, needs_bytes=None, why=first,
                        message=f"does not fit: XLA refused it without a figure ({first})")
        return _does_not_fit(result, stated[0], f"XLA refused it: {stated[1]}")
    stats = [d.memory_stats() or {} for d in mesh.devices.flat]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    # A CPU keeps no allocator statistics: no measured peak there, only XLA's prediction.
    return dict(result, fits=True, peak_bytes_in_use=max(peaks) if peaks else None)


def _ratio(a: float, b: float) -> float:
    # A backend whose products this count does not recognise reports 0: no ratio, not a crash.
    return a / b if b else float("nan")


def count_ops(config) -> dict:
    """{optimizer: matmul_count.MatmulCount} of one update of ``config``, compiled from abstract
    arrays on one device (the config's mesh replaced by one device: FSDP splits only rows)."""
    import jax
    from logra_jax import model_shapes
    from logra_jax.perf import matmul_count, memory
    from logra_jax.rl.build import build_mesh, build_policy_update
    from logra_jax.rl.policy import Policy

    mesh = build_mesh({"fsdp": 1, "tensor": 1}, jax.devices()[:1], spare_devices=True)
    model = memory.abstract_model(model_shapes.model_config_from(config.model))
    params = memory.abstract_params(model, mesh)
    rl = config.rl
    batch = memory.abstract_batch(mesh, config.data.prompts_per_step * rl.num_generations,
                                  rl.max_prompt_length, rl.max_completion_length)
    counts = {}
    for name in ("logra", "adamw"):
        config.optimizer.name = name
        update = build_policy_update(config, Policy(model))
        opt_state = memory.abstract_opt_state(update.tx, params)
        compiled = update.jitted(params, opt_state).lower(params, opt_state, batch).compile()
        counts[name] = matmul_count.of_compiled(compiled)
    return counts


def main(argv):
    del argv
    from launch import process
    # The timing compares the two optimizers on one device (8 simulated CPU devices would only
    # split the same cores 8 ways); LOGRA_HOST_DEVICES gives more.
    process.setup(1)
    if _COUNT.value:
        if _CONFIG.value is None:
            sys.exit("error: --count_ops needs --config")
        try:
            counts = count_ops(_CONFIG.value)
        except (ValueError, FileNotFoundError) as e:
            sys.exit(f"error: {e}")
        c = _CONFIG.value
        print(f"{c.model.source}: one update of {c.data.prompts_per_step * c.rl.num_generations} "
              f"rows × {c.rl.max_prompt_length + c.rl.max_completion_length} tokens in micro-batches "
              f"of {c.rl.micro_batch_size}, rank {c.optimizer.logra.rank}, remat {c.model.remat}")
        for name, n in counts.items():
            unknown = f" ({n.unknown_loops} loops of unknown length counted once)" if n.unknown_loops else ""
            print(f"  {name:6} {n.flops / 1e9:16,.1f} GFLOP of matrix products{unknown}")
        print(f"  logra/adamw {_ratio(counts['logra'].flops, counts['adamw'].flops):.3f}")
        return
    if _PEAK.value:
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
        return
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
    if _MERGE.value:
        if _REPEATS.value < 1:
            sys.exit("error: --merge times the merge: it needs --repeats ≥ 1")
        print(cpu_model())
        print(f"merge of {_LAYERS.value} layers (d × 3d), rank {_RANK.value}, fp32; median of "
              f"{_REPEATS.value} interleaved runs")
        print(f"{'width':>6} {'order-free ms':>14} {'plain dot ms':>13} {'ratio':>6}")
        for width, ms in time_merge(widths, _LAYERS.value, _RANK.value, _REPEATS.value):
            print(f"{width:>6} {ms['order-free']:>14.1f} {ms['plain dot']:>13.1f} "
                  f"{ms['order-free'] / ms['plain dot']:>6.2f}")
        return
    if _PROFILE.value:
        import jax
        print(cpu_model())
        print(f"one update, {_MICRO.value} micro-step(s) of {_ROWS.value} × "
              f"{_PROMPT.value + _COMPLETION.value} tokens, {_LAYERS.value} layers, vocabulary "
              f"{_VOCAB.value}, rank "
              f"{_RANK.value}, {_DTYPE.value}, remat, {jax.default_backend()} × {jax.device_count()}")
        print_profiles(profile_widths(widths, _LAYERS.value, _ROWS.value, _PROMPT.value,
                                      _COMPLETION.value, _RANK.value, _DTYPE.value, _MICRO.value,
                                      _VOCAB.value))
        return
    results = time_widths(widths, _LAYERS.value, _ROWS.value, _PROMPT.value, _COMPLETION.value,
                          _RANK.value, _DTYPE.value, _REPEATS.value, _MICRO.value, _VOCAB.value,
                          _EXACT.value)
    import jax
    print(cpu_model())
    print(f"one update, {_MICRO.value} micro-step(s) of {_ROWS.value} × "
          f"{_PROMPT.value + _COMPLETION.value} tokens, {_LAYERS.value} layers, vocabulary "
          f"{_VOCAB.value}, rank {_RANK.value}, {_DTYPE.value}, remat, {jax.default_backend()} × {jax.device_count()}; "
          + (f"median of {_REPEATS.value} interleaved runs" if _REPEATS.value else "operation counts only"))
    # time ratio: of the two medians; paired: the median of per-round ratios, with their range.
    exact = f" {'exact ms':>9} {'exact paired':>13}" if _EXACT.value else ""
    print(f"{'width':>6} {'params':>8} {'logra ms':>9} {'adamw ms':>9} {'time ratio':>11} "
          f"{'paired':>7} {'range':>11} {'logra GFLOP':>12} {'adamw GFLOP':>12} "
          f"{'FLOP ratio':>11}" + exact)
    for width, n_params, ms, flops, paired in results:
        exact = (f" {ms[EXACT]:>9.1f} {paired[EXACT][0]:>13.3f}" if EXACT in ms else "")
        median, low, high = paired["logra"]
        print(f"{width:>6} {n_params / 1e6:>7.1f}M {ms['logra']:>9.1f} {ms['adamw']:>9.1f} "
              f"{ms['logra'] / ms['adamw']:>11.3f} {median:>7.3f} {f'{low:.3f}–{high:.3f}':>11} "
              f"{flops['logra'] / 1e9:>12.1f} {flops['adamw'] / 1e9:>12.1f} "
              f"{_ratio(flops['logra'], flops['adamw']):>11.3f}" + exact)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump({"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
                       "dtype": _DTYPE.value, "layers": _LAYERS.value, "rows": _ROWS.value,
                       "tokens": _PROMPT.value + _COMPLETION.value, "micro_steps": _MICRO.value,
                       "rank": _RANK.value, "vocab": _VOCAB.value, "repeats": _REPEATS.value,
                       "widths": [{"width": width, "params": n_params, "ms": ms, "flops": flops,
                                   "paired": {k: list(v) for k, v in paired.items()}}
                                  for width, n_params, ms, flops, paired in results]}, f, indent=1)
    width, _, ms, flops, paired = results[-1]
    print(f"at width {width}: logra/adamw time ratio {ms['logra'] / ms['adamw']:.3f} (paired "
          f"{paired['logra'][0]:.3f}), FLOP ratio {_ratio(flops['logra'], flops['adamw']):.3f} "
          f"(matrix products, every loop iteration counted)")


if __name__ == "__main__":
    cli.run(main)
