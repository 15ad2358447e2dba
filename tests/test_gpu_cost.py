"""logra_jax/perf/gpu_cost.py: kernels, host syncs and bytes of XLA:GPU programs, compiled deviceless.

Each program is small and compiled by XLA:GPU for one H200 on this CPU machine (the CUDA plugin of
the 'gpu-plan' extra, as tests/test_gpu_compile.py); what it launches and moves is known by hand.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from logra_jax.perf import gpu, gpu_cost, targets

pytestmark = pytest.mark.skipif(
    gpu.plugin_version() is None and os.environ.get("CI") != "true",
    reason="the CUDA plugin (the 'gpu-plan' extra) is not installed: no XLA:GPU")

BF16 = 2   # bytes


@pytest.fixture(scope="module")
def one_gpu():
    return NamedSharding(Mesh(np.array(targets.target("h200-8").jax_devices()[:1]), ("x",)), P())


def _compile(one_gpu, fn, *shapes, donate=(), options=None):
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=one_gpu) for shape, dtype in shapes]
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile(
        compiler_options={**gpu.COMPILER_OPTIONS, **(options or {})})


def _text(one_gpu, fn, *shapes, donate=()):
    return _compile(one_gpu, fn, *shapes, donate=donate).as_text()


@pytest.mark.parametrize("form", ["product", "reduction"])
def test_a_gemv_reads_its_weight_once(one_gpu, form):
    """A batch-one product as a Triton GEMM split over the contraction (8 partial f32 vectors, then
    their sum: 0.8 % of the weight's bytes more), or written as the reduction XLA makes of small
    decode products (one fusion: multiply by the broadcast vector, reduce): either reads the
    weight once; the weight-sized product inside the fusion never reaches memory."""
    n = 4096
    gemv = (lambda w, x: w @ x) if form == "product" else (lambda w, x: jnp.sum(w * x[None, :], axis=1))
    cost = gpu_cost.Program(_text(one_gpu, gemv, ((n, n), jnp.bfloat16), ((n,), jnp.bfloat16))).cost()
    weight = n * n * BF16
    assert weight <= cost.bytes <= 1.02 * weight, cost.largest(5)
    assert cost.kernels <= 2


def test_an_in_place_cache_write_moves_only_the_slot(one_gpu):
    slots, width = 2048, 1024

    def write_all(cache, rows):
        def step(i, cache):   # a decode step's cache write: one row, at a position known at run time
            return jax.lax.dynamic_update_slice(cache, (rows[i] * 2)[None], (i, 0))
        return jax.lax.fori_loop(0, slots, step, cache)

    program = gpu_cost.Program(_text(one_gpu, write_all, ((slots, width), jnp.bfloat16),
                                     ((slots, width), jnp.bfloat16), donate=(0,)))
    (loop,) = program.loops()
    trip = program.trip(loop)
    row = width * BF16
    # Per trip: the row read from `rows` (a dynamic slice of it, not all of it) and written into
    # the cache's slot; the loop's counter; nothing of the cache's other slots.
    assert loop.trip_count == slots
    assert trip.bytes <= 2 * row + 256, trip.largest(5)
    assert "in-place dynamic-update-slice" in trip.kernels_by_kind()
    assert program.cost().bytes <= slots * (2 * row + 256)


def test_a_dynamic_loop_syncs_the_host_every_trip_and_a_fori_loop_never(one_gpu):
    def until(x, n):   # a trip count known only at run time, as the sampler's token loop
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (jnp.sin(c[0]) * 1.5, c[1] + 1),
                                  (x, jnp.int32(0)))[0]

    def fixed(x, n):
        return jax.lax.fori_loop(0, 7, lambda i, y: jnp.sin(y) * 1.5, x) + n

    dynamic = gpu_cost.Program(_text(one_gpu, until, ((1024,), jnp.float32), ((), jnp.int32)))
    (loop,) = dynamic.loops()
    assert loop.trip_count is None
    assert dynamic.trip(loop).host_syncs == 1
    whole = dynamic.cost()   # one trip counted, then the check that ends the loop
    assert whole.host_syncs == 2 and whole.dynamic_loops == 1

    static = gpu_cost.Program(_text(one_gpu, fixed, ((1024,), jnp.float32), ((), jnp.int32)))
    (loop,) = static.loops()
    assert loop.trip_count == 7
    assert static.trip(loop).host_syncs == 0 and static.cost().host_syncs == 0


def test_nested_loop_trips_multiply(one_gpu):
    def nested(x):
        inner = lambda i, y: jnp.sin(y) * 1.5 + i
        return jax.lax.fori_loop(0, 3, lambda j, y: jax.lax.fori_loop(0, 5, inner, y) * 0.5, x)

    program = gpu_cost.Program(_text(one_gpu, nested, ((4096,), jnp.float32)))
    outer, inner = program.loops()
    assert (outer.trip_count, inner.trip_count, inner.parents) == (3, 5, (outer.name,))
    body = program.cost(inner.body)
    whole = program.cost()
    for key, (_, times) in body.launches.items():
        assert whole.launches[key][1] == 15, key   # each inner kernel runs 3 × 5 times
    assert whole.kernels >= 15 * body.kernels


def test_decode_step_of_a_chunked_token_loop(one_gpu):
    """A token loop of fixed 16-token chunks inside a loop that runs until the rows end: one host
    sync per chunk, so 1/16 per token; every figure per token is the chunk's over 16."""
    vocab, width, chunk = 8192, 512, 16

    def generate(head, h, n):
        def token(i, carry):
            h, done = carry
            logits = head @ h
            return jnp.tanh(h + logits[:width] * 1e-3), done + (jnp.argmax(logits) == 0)
        def chunk_of_tokens(carry):
            h, done, step = carry
            h, done = jax.lax.fori_loop(0, chunk, token, (h, done))
            return h, done, step + chunk
        return jax.lax.while_loop(lambda c: (c[2] < n) & (c[1] == 0), chunk_of_tokens,
                                  (h, jnp.int32(0), jnp.int32(0)))

    text = _text(one_gpu, generate, ((vocab, width), jnp.bfloat16), ((width,), jnp.bfloat16),
                 ((), jnp.int32))
    step = gpu_cost.decode_step(text, vocab_size=vocab, hidden_size=width)
    assert step.dynamic and step.tokens_per_trip == chunk
    assert step.host_syncs == pytest.approx(1 / chunk)
    head = vocab * width * BF16
    assert head <= step.bytes <= 1.05 * head   # the head once per token, little else
    program = gpu_cost.Program(text)
    (outer, inner) = program.loops()
    assert step.loop == outer.name and step.kernels == pytest.approx(program.trip(outer).kernels / chunk)


def test_decode_step_needs_a_loop_that_reads_the_head(one_gpu):
    text = _text(one_gpu, lambda x: jax.lax.fori_loop(0, 3, lambda i, y: y * 2, x), ((64,), jnp.float32))
    with pytest.raises(ValueError, match="no loop of the program reads a 1000 × 64 head"):
        gpu_cost.decode_step(text, vocab_size=1000, hidden_size=64)


def test_bitonic_sort_kernels_follow_xlas_grouping():
    # A tile of 4096 elements (1024 threads × 4) holds every stage of a 4096-long sort: one kernel.
    assert gpu_cost._bitonic_kernels(4096, 4) == 1
    # 2^15 f32 keys: stages 0..14; masks ≥ the 4096 tile run alone (stage s has s - 11 of them for
    # s ≥ 12), the smaller ones of each stage as one tiled kernel.
    assert gpu_cost._bitonic_kernels(1 << 15, 4) == 1 + sum((s - 11) + 1 for s in range(12, 15))


# ----------------------------------------------------------------------------------------------
# The kernel rule against XLA's own thunk sequence
# ----------------------------------------------------------------------------------------------
_THUNK = re.compile(r"^(\s*)\d+: (k[A-Za-z0-9]+)")
# Control flow and its waits; an async start lists the collective it starts beneath it.
_NOT_A_LAUNCH = {"kWhile", "kConditional", "kCommandBuffer", "kSequential", "kWaitForStreams",
                 "kAsyncStart"}


def thunk_launches(sequence: str) -> int:
    """Launches in XLA:GPU's dumped thunk sequence (before its thunk passes form command
    buffers), each listed thunk once: kernels, memcpys, library calls, collectives. A
    dynamic-slice fusion lists the memcpy it wraps beneath it: one launch. A "Done" thunk
    waits."""
    launches, wrapper_indent = 0, None
    for line in sequence.splitlines():
        match = _THUNK.match(line)
        if match is None:
            continue
        indent, kind = len(match.group(1)), match.group(2)
        if wrapper_indent is not None and indent > wrapper_indent:
            continue
        wrapper_indent = indent if kind == "kDynamicSliceFusion" else None
        launches += kind not in _NOT_A_LAUNCH and not kind.endswith("Done")
    return launches


@pytest.mark.parametrize("top_p, gpus", [(1.0, 1), (0.9, 1), (1.0, 8)])
def test_kernels_match_xlas_thunk_sequence_for_the_tiny_sampler(top_p, gpus, tmp_path):
    """The sampler's generate for the tiny config (prefill, the token loop, the layer scans; with
    top_p < 1 a full-vocabulary sort per token; over 8 GPUs, FSDP's collectives, some async):
    every launch XLA:GPU emitted, one by one."""
    from configs import tiny
    from logra_jax.perf import memory
    from logra_jax.rl.build import build_mesh

    config = tiny.get_config()
    config.rl.top_p = top_p
    mesh = build_mesh({"fsdp": gpus, "tensor": 1}, targets.target("h200-8").jax_devices()[:gpus])
    lowered = memory.lower_generate(config, mesh, rows=8, decode_weights="stacked").lowered
    compiled = lowered.compile(compiler_options={
        **gpu.COMPILER_OPTIONS, "xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True,
        "xla_dump_hlo_module_re": ".*generate.*"})
    (sequence,) = tmp_path.glob("*generate*thunk_sequence.txt")
    program = gpu_cost.Program(compiled.as_text())
    assert program.launch_sites() == thunk_launches(sequence.read_text())
    # Per token, the nucleus filter sorts the vocabulary (the prompt's argsort runs once, before).
    step = gpu_cost.decode_step(program, vocab_size=49152, hidden_size=config.model.tiny.hidden_size)
    assert ("sort (bitonic)" in step.kernels_by_kind()) == (top_p < 1)
