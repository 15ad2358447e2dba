"""Rollout speed: the sampler's tokens/s and how close it comes to this machine's limit.

    python -m launch.sampler_bench [--batches 1,16,64] [--meshes 1,8] [--prompt_length 64] \
        [--completion_length 32] [--repeats 3] [--config.model.source=...]

Times `Sampler.generate` on the default job's model (SmolLM2-135M-Instruct, fp32) with random
prompt tokens and an end-of-sequence id no row can draw (every row runs all
``completion_length`` steps), at temperature 1, per batch size and mesh size, median of
``repeats`` calls after one that compiles. The roofline of one call is

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
"""

import sys

from launch import cpu_model, simulate_host_devices

simulate_host_devices(8)  # before jax is imported; --meshes picks how many a row uses

import statistics  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "The model's config.",
                                          lock_config=False)
_BATCHES = flags.DEFINE_list("batches", ["1", "16", "64"], "Rows per generate call.")
_MESHES = flags.DEFINE_list("meshes", ["1", "8"], "Devices the batch is split over (fsdp).")
_PROMPT = flags.DEFINE_integer("prompt_length", 64, "Prompt tokens per row.")
_COMPLETION = flags.DEFINE_integer("completion_length", 32, "Sampled tokens per row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per cell, after one warm-up.")
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
    import jax
    import numpy as np
    from logra_jax import sharding as sharding_lib
    from logra_jax.rl import build
    from logra_jax.rl.policy import Policy
    from logra_jax.rl.sampler import Sampler

    if max(meshes) > jax.device_count():
        sys.exit(f"error: --meshes {max(meshes)} needs that many devices, this process has "
                 f"{jax.device_count()} (LOGRA_HOST_DEVICES)")
    config = _CONFIG.value
    config.model.update(dtype=_DTYPE.value, param_dtype=_DTYPE.value)
    flops, bandwidth = machine_rates(_DTYPE.value)
    print(f"{cpu_model()}; {jax.default_backend()} ({jax.devices()[0].device_kind}); one device: "
          f"{_DTYPE.value} matmul {flops / 1e9:.1f} GFLOP/s, copy {bandwidth / 2**30:.1f} GiB/s")
    print(f"model {config.model.source} ({config.model.dtype}); prompt {_PROMPT.value} + "
          f"{_COMPLETION.value} sampled tokens per row; median of {_REPEATS.value} calls")
    print(f"{'devices':>7} {'batch':>5} {'seconds':>8} {'tokens/s':>9} {'roofline s':>10} "
          f"{'achieved/roofline':>17}")
    for devices in meshes:
        mesh = build.build_mesh({"fsdp": devices, "tensor": 1}, jax.devices()[:devices])
        model, _ = build.build_model(config.model, mesh)
        policy = Policy(model)
        params = Policy.params_of(model)
        del model
        entries, nbytes = matmul_weights(params)
        never = 2**30                                 # an id outside the vocabulary: no row stops
        sampler = Sampler(policy, max_prompt_length=_PROMPT.value,
                          max_completion_length=_COMPLETION.value, eos_ids=[never], pad_id=0)
        for batch in batches:
            tokens = np.random.default_rng(0).integers(1, 1000, (batch, _PROMPT.value), np.int32)
            mask = np.ones_like(tokens, bool)
            sharded = jax.device_put((tokens, mask), sharding_lib.batch_sharding(mesh, batch))
            key = jax.random.PRNGKey(0)
            seconds = _median_seconds(lambda: sampler.generate(params, *sharded, key).tokens,
                                      _REPEATS.value)
            limit = roofline_seconds(entries, nbytes, batch, _PROMPT.value, _COMPLETION.value,
                                     devices, flops, bandwidth,
                                     shared_host=jax.default_backend() == "cpu")
            print(f"{devices:>7} {batch:>5} {seconds:>8.2f} {batch * _COMPLETION.value / seconds:>9.1f} "
                  f"{limit:>10.2f} {limit / seconds:>17.2f}", flush=True)


if __name__ == "__main__":
    from logra_jax import config as config_lib
    config_lib.check_argv(sys.argv[1:])
    app.run(main)
