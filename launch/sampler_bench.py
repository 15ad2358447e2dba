"""Rollout speed: the sampler's tokens/s and how close it comes to this machine's limit.

    python -m launch.sampler_bench [--batches 1,16,64] [--meshes 1,8] [--prompt_length 64] \
        [--completion_length 32] [--repeats 3] [--decode_weights auto|per_layer,stacked] \
        [--config.model.source=...]

Times `Sampler.generate` on the default job's model (SmolLM2-135M-Instruct, fp32) with random
prompt tokens and an end-of-sequence id no row can draw (every row runs all
``completion_length`` steps), at temperature 1, per batch size and mesh size, median of
``repeats`` calls after one that compiles. With several ``--decode_weights`` (the Sampler's
option: how decode steps read the layer stack) each cell times them alternately, call by call,
and prints each one's time over the first one's. The roofline of one call is

    prefill:  2 · N · b · p  operations at the machine's sgemm rate
    decode:   completion_length steps, each max(2 · N · b / sgemm rate, weight bytes / bandwidth)

where N counts the matmul weights a token passes (every layer's projections and the output
head; the embedding lookup is a gather), b the batch, p the prompt length. On a mesh of m
accelerators (FSDP) each computes b/m rows with the whole, gathered weights, so b becomes b/m and
the bytes stay (a batch that does not divide over the devices is replicated). m simulated CPU
devices share one machine's cores and memory, so their limit is the one-device limit of the whole
batch, and the ratio shows what splitting the batch over simulated devices costs. The machine's rates are measured
here first: an fp32 (2048 × 2048) · (2048 × 2048) product on one device, and a copy of 256 MiB
(bandwidth = bytes read and written / time, the faster of numpy's copy and XLA's). ``achieved/roofline`` = roofline time / measured
time; 1.0 is the limit. The CPU model is printed with the table.

What this backend's matrix products allow (one-device rows): ``dots ms`` is one decode step's
products alone, timed at the row's batch — every layer's seven projections chained as in the
layer and the output head, with nothing else (no norms, attention, cache writes or draw) — and
``best`` = roofline / (prefill roofline + completion_length · dots), the highest
achieved/roofline a sampler could reach if everything but those products were free and the
prefill ran at the sgemm rate. A gap between ``best`` and 1 is the matmul kernels' (small-batch
products run below the sgemm rate); the gap between achieved/roofline and ``best`` is the
sampler's own.
"""

import json
import statistics
import sys
import time

from absl import flags

from launch import cli
from launch.bench_stats import cpu_model, interleaved_medians

_CONFIG = cli.define_config(default="configs/default.py", help_string="The model's config.",
                            lock_config=False)
_BATCHES = flags.DEFINE_list("batches", ["1", "16", "64"], "Rows per generate call.")
_MESHES = flags.DEFINE_list("meshes", ["1", "8"], "Devices the batch is split over (fsdp).")
_PROMPT = flags.DEFINE_integer("prompt_length", 64, "Prompt tokens per row.")
_COMPLETION = flags.DEFINE_integer("completion_length", 32, "Sampled tokens per row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per cell, after one warm-up.")
_DECODE = flags.DEFINE_list("decode_weights", ["auto"],
                            "Sampler decode_weights to compare: auto, per_layer, stacked.")
_JSONL = flags.DEFINE_string("jsonl", None, "Also append each row, as soon as it is measured, to "
                             "this file (one JSON object per line: a run cut short keeps its rows).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Weights, compute and the measured matmul rate (bf16 on a GPU).")


def _median_seconds(fn, repeats: int) -> float:
    import jax
    jax.block_until_ready(fn())                      # compile
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def machine_rates(dtype: str = "float32", repeats: int = 5) -> tuple[float, float]:
    """(matmul FLOP/s in ``dtype``, copy bytes/s) of one device, measured."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    n = 2048
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    dot = jax.jit(lambda x: x @ x)
    flops = 2 * n**3 / _median_seconds(lambda: dot(a), repeats)
    # Memory bandwidth: the faster of a numpy copy (memcpy) and XLA's own elementwise pass over
    # 256 MiB, counting bytes read and written.
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    numpy_copy = 2 * src.nbytes / _median_seconds(lambda: np.copyto(dst, src), repeats)
    x = jnp.asarray(src)
    xla_copy = 2 * src.nbytes / _median_seconds(jax.jit(lambda: x + 1.0), repeats)
    return flops, max(numpy_copy, xla_copy)


def matmul_weights(params) -> tuple[int, int]:
    """(entries, bytes) of the weights a token's forward pass multiplies by: every kernel (the
    layers' projections and an output head) and, when there is no head kernel, the tied embedding
    that serves as the head (the embedding lookup itself is a gather)."""
    from logra_jax.tree_paths import leaves_with_paths
    leaves = dict(leaves_with_paths(params))
    kernels = [x for path, x in leaves.items() if path.endswith("kernel")]
    tied = not any("head" in path for path in leaves)
    head = [x for path, x in leaves.items() if tied and path.endswith("embedding")]
    return (sum(x.size for x in kernels + head),
            sum(x.size * x.dtype.itemsize for x in kernels + head))


def roofline_seconds(entries: int, nbytes: int, batch: int, prompt: int, steps: int, devices: int,
                     flops: float, bandwidth: float, *, shared_host: bool) -> float:
    """The module docstring's limit for one generate call on ``devices`` (FSDP: each device
    computes its rows with the whole, gathered weights)."""
    if shared_host:   # simulated CPU devices share one machine: its whole-batch limit
        rows = batch
    else:
        rows = batch // devices if batch % devices == 0 else batch  # per device (else replicated)
    prefill = 2 * entries * rows * prompt / flops
    decode_step = max(2 * entries * rows / flops, nbytes / bandwidth)
    return prefill + steps * decode_step


def decode_dots_seconds(params, batch: int, repeats: int) -> float:
    """Median seconds of one decode step's matrix products alone at ``batch`` rows (see the module
    docstring), on one device, written as the sampler's per-layer decode runs them: each layer's
    kernels stored transposed and multiplied weights-major, and the head as vocabulary-major
    logits (`linear.weights_major_product`; an untied head as hidden·W_head)."""
    import jax
    import jax.numpy as jnp
    from logra_jax.models.linear import weights_major_matmul, weights_major_product
    from logra_jax.models.llama import LAYER_LINEARS
    from logra_jax.tree_paths import leaves_with_paths
    device = jax.devices()[0]
    leaves = dict(leaves_with_paths(params))
    stacks = {path.split("/")[-2]: leaves[path] for path in LAYER_LINEARS}
    layers = jax.device_put([{name: w[i].T for name, w in stacks.items()}
                             for i in range(stacks["q_proj"].shape[0])], device)
    tied = "lm_head/kernel" not in leaves
    head = jax.device_put(leaves["embed_tokens/embedding" if tied else "lm_head/kernel"], device)

    @jax.jit
    def products(layers, head, x):
        def mm(x, name):
            return weights_major_matmul(x, w[name])
        for w in layers:
            q, k, v = mm(x, "q_proj"), mm(x, "k_proj"), mm(x, "v_proj")
            # k and v only have to stay alive: two row sums are all that is added for them.
            h = x + mm(q, "o_proj") + jnp.sum(k, -1, keepdims=True) + jnp.sum(v, -1, keepdims=True)
            x = h + mm(mm(h, "gate_proj") * mm(h, "up_proj"), "down_proj")
        return weights_major_product(head, x) if tied else x @ head

    x = jax.device_put(jnp.ones((batch, stacks["q_proj"].shape[1]), head.dtype), device)
    return _median_seconds(lambda: products(layers, head, x), max(repeats, 5))


def main(argv):
    del argv
    try:
        batches = [int(b) for b in _BATCHES.value]
        meshes = [int(m) for m in _MESHES.value]
    except ValueError:
        sys.exit(f"error: --batches and --meshes must be integers, got {_BATCHES.value} and "
                 f"{_MESHES.value}")
    if min(batches) < 1 or min(meshes) < 1 or _REPEATS.value < 1:
        sys.exit("error: --batches, --meshes and --repeats must be ≥ 1")
    from launch import process
    # As many simulated devices as the largest mesh: a process with 8 simulated CPU devices runs
    # even a one-device program slower (SmolLM2 at batch 16 on one device: 4.82 s in an 8-device
    # process, 3.91 s in a 1-device one, same minute), so `--meshes 1` measures one device alone.
    process.setup(max(meshes))
    import jax
    import numpy as np
    from logra_jax import sharding as sharding_lib
    from logra_jax.rl import build
    from logra_jax.rl.policy import Policy
    from logra_jax.rl import decode_mode
    from logra_jax.rl.sampler import Sampler

    if max(meshes) > jax.device_count():
        sys.exit(f"error: --meshes {max(meshes)} needs that many devices, this process has "
                 f"{jax.device_count()} (LOGRA_HOST_DEVICES)")
    modes = list(dict.fromkeys(_DECODE.value))
    bad = [m for m in modes if m not in Sampler.DECODE_WEIGHTS]
    if bad:   # before the seconds of measuring the machine's rates
        sys.exit(f"error: --decode_weights {bad}: choose from {Sampler.DECODE_WEIGHTS}")
    config = _CONFIG.value
    config.model.update(dtype=_DTYPE.value, param_dtype=_DTYPE.value)
    flops, bandwidth = machine_rates(_DTYPE.value)
    print(f"{cpu_model()}; {jax.default_backend()} ({jax.devices()[0].device_kind}); one device: "
          f"{_DTYPE.value} matmul {flops / 1e9:.1f} GFLOP/s, copy {bandwidth / 2**30:.1f} GiB/s")
    print(f"model {config.model.source} ({config.model.dtype}); prompt {_PROMPT.value} + "
          f"{_COMPLETION.value} sampled tokens per row; median of {_REPEATS.value} calls")
    print(f"{'devices':>7} {'batch':>5} {'decode':>9} {'seconds':>8} {'tokens/s':>9} "
          f"{'roofline s':>10} {'achieved/roofline':>17} {'dots ms':>8} {'best':>5}"
          + (f" {'time/first':>10}" if len(modes) > 1 else ""))
    for devices in meshes:
        mesh = build.build_mesh({"fsdp": devices, "tensor": 1}, jax.devices()[:devices])
        model, _ = build.build_model(config.model, mesh)
        policy = Policy(model)
        params = Policy.params_of(model)
        del model
        entries, nbytes = matmul_weights(params)
        never = 2**30                                 # an id outside the vocabulary: no row stops
        samplers = {mode: Sampler(policy, max_prompt_length=_PROMPT.value,
                                  max_completion_length=_COMPLETION.value, eos_ids=[never],
                                  pad_id=0, decode_weights=mode) for mode in modes}
        for batch in batches:
            tokens = np.random.default_rng(0).integers(1, 1000, (batch, _PROMPT.value), np.int32)
            mask = np.ones_like(tokens, bool)
            sharded = jax.device_put((tokens, mask), sharding_lib.batch_sharding(mesh, batch))
            key = jax.random.PRNGKey(0)
            seconds = interleaved_medians(
                {mode: (lambda s=s: s.generate(params, *sharded, key).tokens)
                 for mode, s in samplers.items()}, _REPEATS.value)
            limit = roofline_seconds(entries, nbytes, batch, _PROMPT.value, _COMPLETION.value,
                                     devices, flops, bandwidth,
                                     shared_host=jax.default_backend() == "cpu")
            floor = f"{'-':>8} {'-':>5}"
            if devices == 1:
                dots = decode_dots_seconds(params, batch, _REPEATS.value)
                prefill = roofline_seconds(entries, nbytes, batch, _PROMPT.value, 0, 1, flops,
                                           bandwidth, shared_host=True)
                floor = f"{1e3 * dots:>8.1f} {limit / (prefill + _COMPLETION.value * dots):>5.2f}"
            for mode in modes:
                if _JSONL.value:
                    with open(_JSONL.value, "a") as f:
                        f.write(json.dumps(dict(
                            devices=devices, batch=batch, decode_weights=mode, seconds=seconds[mode],
                            tokens_per_second=batch * _COMPLETION.value / seconds[mode],
                            roofline_seconds=limit, achieved_over_roofline=limit / seconds[mode],
                            time_over_first=seconds[mode] / seconds[modes[0]],
                            model=config.model.source, dtype=_DTYPE.value,
                            prompt_length=_PROMPT.value, completion_length=_COMPLETION.value,
                            matmul_flops_per_second=flops, copy_bytes_per_second=bandwidth,
                            backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind))
                                + "\n")
                ratio = f" {seconds[mode] / seconds[modes[0]]:>10.3f}" if len(modes) > 1 else ""
                print(f"{devices:>7} {batch:>5} {mode:>9} {seconds[mode]:>8.2f} "
                      f"{batch * _COMPLETION.value / seconds[mode]:>9.1f} {limit:>10.2f} "
                      f"{limit / seconds[mode]:>17.2f} {floor}{ratio}", flush=True)
            if set(decode_mode.MODES) <= set(modes):
                print(recommendation(seconds, jax.default_backend(), devices), flush=True)


def recommendation(seconds: dict[str, float], platform: str, devices: int) -> str:
    """One line: the decode program ``decode_weights=auto``'s rule runs here and the one these
    timings found faster (evidence to revise the rule with; a run never times)."""
    from logra_jax.rl import decode_mode
    rule = decode_mode.rule(platform, devices)
    faster = min(decode_mode.MODES, key=lambda m: seconds[m])
    verdict = "agrees" if faster == rule else "the rule's is slower here: evidence to revise it"
    return (f"  auto's rule on {devices} {platform} device(s): {rule}; faster here: {faster} "
            f"({seconds['stacked'] / seconds['per_layer']:.2f}x stacked/per_layer; {verdict})")


if __name__ == "__main__":
    cli.run(main)
