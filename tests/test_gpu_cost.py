"""logra_jax/perf/gpu_cost.py: kernels, host syncs and bytes of XLA:GPU programs, compiled deviceless.

Each program is small and compiled by XLA:GPU for one H200 on this CPU machine (the CUDA plugin of
the 'gpu-plan' extra, as tests/test_gpu_compile.py); what it launches and moves is known by hand.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from logra_jax.perf import gpu_cost, machines

pytestmark = pytest.mark.skipif(
    machines.plugin_version() is None and os.environ.get("CI") != "true",
    reason="the CUDA plugin (the 'gpu-plan' extra) is not installed: no XLA:GPU")

BF16 = 2   # bytes


@pytest.fixture(scope="module")
def one_gpu():
    return NamedSharding(Mesh(np.array(machines.machine("h200-8").jax_devices()[:1]), ("x",)), P())


def _compile(one_gpu, fn, *shapes, donate=(), options=None):
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=one_gpu) for shape, dtype in shapes]
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile(
        compiler_options={**machines.XLA_GPU_OPTIONS, **(options or {})})


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


_VALUE = re.compile(r"^\s*value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(\w+\))? @\d+> \(size=\d+,offset=(\d+)\)")


def buffer_slices(assignment: str) -> dict[str, tuple[int, int]]:
    """Each value's (allocation, offset) in XLA's dumped buffer assignment, by "name{index}"."""
    slices, allocation = {}, None
    for line in assignment.splitlines():
        if line.startswith("allocation "):
            allocation = int(line.split()[1].rstrip(":"))
        match = _VALUE.match(line)
        if match and allocation is not None:
            slices.setdefault(match.group(1) + (match.group(2) or "{}"), (allocation, int(match.group(3))))
    return slices


def in_place_claims(program: gpu_cost.Program, slices) -> list[bool]:
    """For each update the reader counts as in place: whether XLA gave the fusion's output the
    buffer of the operand it updates (so the emitter writes the update alone)."""
    out = []
    for computation, fusion, number, name in program.in_place_updates():
        index = []   # the operand's value: a get-tuple-element names its tuple's value at an index
        while (operand := program.module.instruction(computation, name)).opcode in (
                "get-tuple-element", "bitcast"):
            if operand.opcode == "get-tuple-element":
                index.insert(0, re.search(r"index=(\d+)", operand.attributes).group(1))
            name = operand.operands[0]
        roots = program.module.instruction(computation, fusion).shape
        output = slices[fusion + (f"{{{number}}}" if len(roots) > 1 else "{}")]
        out.append(output == slices[f"{name}{{{','.join(index)}}}"])
    return out


@pytest.mark.parametrize("top_p, gpus", [(1.0, 1), (0.9, 1), (1.0, 8)])
def test_kernels_match_xlas_thunk_sequence_for_the_tiny_sampler(top_p, gpus, tmp_path):
    """The sampler's generate for the tiny config (prefill, the token loop, the layer scans; with
    top_p < 1 a top-k candidate set per token; over 8 GPUs, FSDP's collectives, some async):
    every launch XLA:GPU emitted, one by one."""
    from configs import tiny
    from logra_jax.perf import memory
    from logra_jax.rl.build import build_mesh

    config = tiny.get_config()
    config.rl.top_p = top_p
    mesh = build_mesh({"fsdp": gpus, "tensor": 1}, machines.machine("h200-8").jax_devices()[:gpus])
    lowered = memory.lower_generate(config, mesh, rows=8, decode_weights="stacked").lowered
    compiled = lowered.compile(compiler_options={
        **machines.XLA_GPU_OPTIONS, "xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True,
        "xla_dump_hlo_module_re": ".*generate.*"})
    (sequence,) = tmp_path.glob("*generate*thunk_sequence.txt")
    program = gpu_cost.Program(compiled.as_text())
    assert program.launch_sites() == thunk_launches(sequence.read_text())
    # The KV-cache writes (and the token buffers') counted as in place are: XLA's buffer
    # assignment gives each the buffer of the array it updates.
    (assignment,) = tmp_path.glob("*generate*after_optimizations-buffer-assignment.txt")
    claims = in_place_claims(program, buffer_slices(assignment.read_text()))
    assert len(claims) >= 4 and all(claims)
    # No token sorts the vocabulary, top-p or not: the nucleus is taken among the top-k
    # candidates (the prompt's argsort runs once, before the token loop).
    step = gpu_cost.decode_step(program, vocab_size=49152, hidden_size=config.model.tiny.hidden_size,
                                shards=gpus)
    assert "sort (bitonic)" not in step.kernels_by_kind()


# ----------------------------------------------------------------------------------------------
# The seconds per kernel and the program they were measured on
# ----------------------------------------------------------------------------------------------
def test_seconds_per_kernel_come_from_the_measured_programs_kernel_counts():
    """gpu_cost.CALIBRATION's kernel counts are this reader's count of the H200 run's program
    (SmolLM2-135M's shape, 30 layers, batch 1), the sampler of main at 2259830 that the run
    executed, a token loop synced every token. Today's sampler compiles a different program for
    that run (16-token chunks, the cache written in place); it must launch no more than that
    one in either mode, or the calibration's per-kernel time would no longer bound it. It is
    compiled at 3 and 4 layers and extended to 30 by the per-layer difference (from 3 layers
    on, XLA's count grows by the same amount per layer)."""
    from configs import default
    from logra_jax.perf import gpu_programs
    from logra_jax.rl.build import build_mesh

    config = default.get_config()
    config.model.update(source="tiny", dtype="bfloat16", param_dtype="bfloat16")
    config.model.tiny.update(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                             intermediate_size=1536, max_position_embeddings=2048)
    config.rl.update(max_prompt_length=64, max_completion_length=128, rollout_micro_batch=0)
    mesh = build_mesh({"fsdp": 1, "tensor": 1}, machines.machine("h200-8").jax_devices()[:1])
    for mode, kernels in gpu_cost.CALIBRATION["kernels_per_token"].items():
        three, four = (gpu_programs.decode_step(gpu_programs.with_layers(config, n), mesh, 1, mode)[0].kernels
                       for n in (3, 4))
        assert three + 27 * (four - three) <= kernels, mode
    tokens_per_s = gpu_cost.CALIBRATION["measured_tokens_per_s"]
    per_kernel = [1 / (tokens_per_s[m] * k) for m, k in gpu_cost.CALIBRATION["kernels_per_token"].items()]
    assert gpu_cost.SECONDS_PER_KERNEL == pytest.approx(sum(per_kernel) / 2)
    assert 1.7e-6 < gpu_cost.SECONDS_PER_KERNEL < 2.0e-6


def test_the_kernel_calibration_is_the_run_its_evidence_page_records():
    """The calibration is data copied from a results page (machines.KERNEL_CALIBRATIONS): the
    page it names holds its command, its date and each measured tokens/s, so neither changes
    without the other."""
    calibration = machines.KERNEL_CALIBRATIONS["H200"]
    assert gpu_cost.CALIBRATION is calibration
    page = (REPO / calibration["evidence"]).read_text()
    assert calibration["command"] in page
    assert calibration["date"] in page
    for tokens_per_s in calibration["measured_tokens_per_s"].values():
        assert f"{tokens_per_s:,} tokens/s" in page, tokens_per_s


# ----------------------------------------------------------------------------------------------
# launch.cost, and the bounds at a small layer count
# ----------------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
# Qwen2.5-1.5B's layer shape (configs/qwen2_5_1_5b.py's model) at 3 layers, on the tiny source
# (tiny's vocabulary of 49,152 instead of 151,936), one GPU. Per layer, launch.cost reads the step
# at 4 layers less the step at 3.
QWEN_3_LAYERS = ("--config.model.source=tiny", "--config.model.tiny.num_layers=3",
                 "--config.model.tiny.hidden_size=1536", "--config.model.tiny.num_heads=12",
                 "--config.model.tiny.num_kv_heads=2", "--config.model.tiny.head_dim=128",
                 "--config.model.tiny.intermediate_size=8960", "--config.model.tiny.qkv_bias=true",
                 "--config.model.tiny.rope_theta=1000000.0", "--config.model.tiny.rms_norm_eps=1e-6",
                 "--config.model.tiny.max_position_embeddings=32768")


def _cost_cli(*args, json_path=None):
    command = [sys.executable, "-m", "launch.cost", *args]
    if json_path is not None:
        command += ["--json", str(json_path)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)


# The rollout part's completion lengths for the config's 4 prompts × 2 rows, in passes of 4 rows
# (pass 0: rows 0, 2, 4, 6; pass 1: rows 1, 3, 5, 7): groups that end at different steps, a pass
# whose longest row takes many 16-step trips, another that ends within its third, a row of one token.
ROLLOUT_LENGTHS = (700, 20, 1, 40, 300, 17, 16, 2)
ROLLOUT_ROWS_PER_PASS = 4


@pytest.fixture(scope="module")
def qwen_plan(tmp_path_factory):
    """`launch.cost` on the Qwen2.5-1.5B config at 3 layers, one H200, batches 1 and 64, the
    decode mode a plan compiles; and its rollout part for ``ROLLOUT_LENGTHS`` in passes of 4 rows
    (one more compile: the decode step at 4 rows)."""
    folder = tmp_path_factory.mktemp("cost")
    schedule = folder / "lengths.txt"
    schedule.write_text("".join(f"{n}\n" for n in ROLLOUT_LENGTHS))
    out = folder / "cost.json"
    result = _cost_cli("--config", "configs/qwen2_5_1_5b.py", "--target", "h200-8",
                       "--mesh", "fsdp=1,tensor=1", "--batches", "1,64", "--modes", "default",
                       "--parts", "decode,update,generate,rollout", "--schedule", str(schedule),
                       f"--config.rl.rollout_micro_batch={ROLLOUT_ROWS_PER_PASS}",
                       *QWEN_3_LAYERS, json_path=out)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, json.loads(out.read_text())


def test_launch_cost_reports_every_figure(qwen_plan):
    stdout, plan = qwen_plan
    assert plan["compiler"].startswith(f"XLA:GPU deviceless, jax-cuda12-plugin {machines.plugin_version()} "
                                       f"(jax {jax.__version__}")
    assert stdout.startswith("compiler: XLA:GPU deviceless") and "NVIDIA H200" in stdout.splitlines()[0]
    assert [d["batch"] for d in plan["decode"]] == [1, 64]
    assert all(d["default"] and d["mode"] == plan["decode_weights_plan"] for d in plan["decode"])
    for d in plan["decode"]:
        for field in ("kernels_per_token", "kernels_per_layer", "bytes_per_token",
                      "floor_bytes_per_token", "host_syncs_per_token", "predicted_tokens_per_s"):
            assert d[field] > 0, (d["batch"], d["mode"], field)
        # The whole-cache floor: the bf16 weights, all of them read (the embedding is the tied
        # head), and the rows' KV cache (3 layers × rows × 1,024 slots × 2 KV heads × 128 × K
        # and V × 2 bytes).
        assert d["kv_cache_bytes"] == 3 * d["batch"] * 1024 * 2 * 128 * 2 * 2
        assert d["weight_bytes_read"] == d["weight_bytes"]
        assert d["floor_bytes_per_token"] == d["weight_bytes"] + d["kv_cache_bytes"]
        seconds = max(d["bytes_per_token"] / plan["bandwidth"],
                      d["kernels_per_token"] * plan["seconds_per_kernel"])
        assert d["predicted_tokens_per_s"] == pytest.approx(d["batch"] / seconds)
        assert sum(d["kernels_by_kind"].values()) == pytest.approx(d["kernels_per_token"])
    for name in ("logra", "adamw"):
        update = plan["update"][name]
        assert update["kernels"] > 0 and update["bytes"] > 0 and update["matmul_flops"] > 0
    assert plan["generate"]["temp_bytes"] > 0 and plan["generate"]["kv_cache_bytes"] > 0


def test_the_rollout_part_counts_what_the_static_engine_runs(qwen_plan):
    """The rollout part's figures against the schedule, counted here from the lengths alone:
    each pass (rows j, j + 2, …) runs trips of 16 decode steps until its longest row has ended,
    every row a token step each; the true floor sums, over the steps each row is live, the
    weights once, each live group's 256-token prompt KV once and each live row's completion KV
    so far."""
    stdout, plan = qwen_plan
    rollout = plan["rollout"]
    static, detail = rollout["static"], rollout["static_detail"]
    assert rollout["schedule"]["lengths"] == list(ROLLOUT_LENGTHS)
    assert set(static) == {"bytes_per_kept_token", "floor_bytes_per_kept_token",
                           "kernels_per_kept_token", "efficiency", "decode_steps"}
    lengths, per_pass, trip = np.array(ROLLOUT_LENGTHS), ROLLOUT_ROWS_PER_PASS, 16
    passes = len(lengths) // per_pass
    forward = [trip * -(-(lengths[j::passes].max() - 1) // trip) for j in range(passes)]
    kept = lengths.sum()
    assert detail["tokens_per_loop_trip"] == trip and detail["rows_per_pass"] == per_pass
    assert static["decode_steps"] == sum(1 + f for f in forward)
    assert static["efficiency"] == kept / (per_pass * sum(1 + f for f in forward))
    # Each forward pass costs the decode step of a 4-row pass: more than a 1-row step moves,
    # less than a 64-row one.
    step_bytes = static["bytes_per_kept_token"] * kept / sum(forward)   # a few roundings
    assert step_bytes == pytest.approx(detail["bytes_per_step"], rel=1e-12)
    one, many = (_default_decode(plan, b)["bytes_per_token"] for b in (1, 64))
    assert one < step_bytes < many
    assert static["kernels_per_kept_token"] * kept / sum(forward) == pytest.approx(
        detail["kernels_per_step"], rel=1e-12)
    # The true floor, step by step: weights (the tied embedding among them) once per step.
    weights = _default_decode(plan, 1)["weight_bytes_read"]
    kv_per_token = 3 * 2 * 128 * 2 * 2   # layers × KV heads × head width × K and V × bf16
    floor = 0
    for s in range(1, lengths.max()):
        live = [r for r, n in enumerate(lengths) if n > s]
        groups = {r // 2 for r in live}
        floor += weights + kv_per_token * (256 * len(groups) + s * len(live))
    # The same ~700 terms summed in float64 in another order: 700 × 2⁻⁵³ ≈ 1e-13 relative.
    assert static["floor_bytes_per_kept_token"] == pytest.approx(floor / kept, rel=1e-12)
    assert static["bytes_per_kept_token"] > static["floor_bytes_per_kept_token"]
    assert f"{static['efficiency']:.3f}" in stdout.split("rollout of 8 rows")[1]


def test_the_rollout_part_counts_what_the_slot_engine_runs(qwen_plan):
    """The slot engine on the same schedule, as wide as a static pass (4 slots; 4 prompt slots),
    refilled every 16 steps. Its schedule, walked by hand (groups g0 = rows 0, 1 of lengths
    700, 20; g1 = 1, 40; g2 = 300, 17; g3 = 16, 2):

    - admission trip 1 admits g0 and g1 (row 2 ends at its prefill draw: one slot free, too few
      for g2), trip 2 admits nothing (row 1 ends at step 19, after the check), trip 3 admits g2
      into slots 1, 2, trip 4 g3 into the slots rows 3 and 5 freed: 4 chunks of 4 slots;
    - two rows live (0 and 4): no trips at 4 slots; at 2 slots until row 4 (column 32) reaches
      299: 17 chunks; at 1 slot until row 0 (column 336) reaches 699: 23 chunks.

    So 64 + 272 + 368 decode steps, and 8 prefill draws + 4·64 + 2·272 + 1·368 row-steps."""
    stdout, plan = qwen_plan
    rollout = plan["rollout"]
    new, detail = rollout["new"], rollout["new_detail"]
    assert set(new) == set(rollout["static"])
    assert (detail["slots"], detail["prompt_slots"], detail["tokens_per_chunk"]) == (4, 4, 16)
    assert detail["admission_trips"] == 4 and detail["groups"] == 4
    steps = {size["slots"]: size["steps"] for size in detail["sizes"]}
    assert steps == {4: 4 * 16, 2: 17 * 16, 1: 23 * 16}
    assert new["decode_steps"] == 1 + 64 + 272 + 368
    kept = sum(ROLLOUT_LENGTHS)
    assert new["efficiency"] == kept / (8 + 4 * 64 + 2 * 272 + 1 * 368)
    # Each group prefilled once; the static engine prefills every row.
    assert detail["prefill_tokens"] * 2 == rollout["static_detail"]["prefill_tokens"] == 8 * 256
    # The same floor; the decode steps' own bytes and the loops' and entry's work around them.
    assert new["floor_bytes_per_kept_token"] == rollout["static"]["floor_bytes_per_kept_token"]
    assert new["bytes_per_kept_token"] == pytest.approx(detail["bytes"] / kept, rel=1e-12)
    # The attention kernel (one per layer) takes each slot's completion K and V whole but reads
    # a slot's columns up to its own: the program's whole operands are replaced by the columns
    # the schedule reads, at least each row's 1 + 2 + … + (L − 1) while it decodes.
    kv_per_token = 3 * 2 * 128 * 2 * 2   # layers × KV heads × head width × K and V × bf16
    for size in detail["sizes"]:
        assert size["kernel_whole_completion_bytes_per_step"] == 4 * 768 * kv_per_token
    columns = sum(size["completion_columns_read"] for size in detail["sizes"])
    assert columns >= sum(n * (n - 1) // 2 for n in ROLLOUT_LENGTHS)
    in_steps = sum(size["steps"] * (size["program_bytes_per_step"]
                                    - size["kernel_whole_completion_bytes_per_step"])
                   for size in detail["sizes"]) + columns * kv_per_token
    assert in_steps == pytest.approx(sum(size["steps"] * size["bytes_per_step"]
                                         for size in detail["sizes"]), rel=1e-12)
    assert in_steps < detail["bytes"] and detail["entry_bytes"] > 0
    # A step of fewer slots reads less: the same weights, fewer rows' caches.
    per_step = [size["program_bytes_per_step"] for size in detail["sizes"]]
    assert per_step == sorted(per_step, reverse=True)
    assert "new/static: bytes per kept token" in stdout


def _default_decode(plan, batch):
    (entry,) = [d for d in plan["decode"] if d["batch"] == batch and d["default"]]
    return entry


# What decoding at the floor and a batched optimizer mean on a GPU, in the decode mode a GPU plan
# compiles by default: the bytes a step must read and little more, few kernels per layer, the host
# left alone for 16 tokens at a time; LoGRA's update no costlier in launches or bytes than AdamW's.
# A stacked decode step that rewrites the cache stack and copies weights out of it, a token loop
# that syncs every token, an optimizer that loops over the layers fail them.
def test_decode_at_batch_1_moves_at_most_1_10_times_the_floor(qwen_plan):
    d = _default_decode(qwen_plan[1], 1)
    assert d["bytes_over_floor"] <= 1.10, d["bytes_by_kind"]


def test_decode_launches_at_most_10_kernels_per_layer(qwen_plan):
    """9 with the decode kernels (models/decode_kernels.py: each norm one kernel, attention one):
    the two norms, the qkv and o products, attention, gate|up, the SiLU product, down_proj's
    split-K GEMM and the sum of its parts. XLA:GPU's own fusions reach 15 (q, k and v's kernels
    held as one; 16 with three; the stacked step: 25)."""
    d = _default_decode(qwen_plan[1], 1)
    assert d["kernels_per_layer"] <= 10, d["kernels_by_kind"]


def test_decode_syncs_the_host_at_most_once_per_16_tokens(qwen_plan):
    d = _default_decode(qwen_plan[1], 1)
    assert d["host_syncs_per_token"] <= 1 / 16


def test_decode_at_batch_64_moves_at_most_1_3_times_the_floor(qwen_plan):
    """The bound is 1.25 at the model's 28 layers (1.22 there, `launch.cost` on the config); at 3
    layers the step's fixed bytes, sampling's passes over the fp32 logits, weigh more: 1.28. With
    XLA's attention, which writes the scores and reads them back, 1.36 here (1.31 at 28); the
    stacked step 3.1. What is left over is XLA's default split-K GEMMs writing and re-reading
    fp32 partial sums (~23 MB a layer at batch 64) and those passes over the logits."""
    d = _default_decode(qwen_plan[1], 64)
    assert d["bytes_over_floor"] <= 1.30, d["bytes_by_kind"]


def test_logra_update_launches_at_most_1_2_times_adamws_kernels(qwen_plan):
    update = qwen_plan[1]["update"]
    assert update["logra"]["kernels"] <= 1.2 * update["adamw"]["kernels"], (
        update["logra"]["kernels_by_kind"], update["adamw"]["kernels_by_kind"])


def test_logra_update_moves_no_more_bytes_than_adamw(qwen_plan):
    update = qwen_plan[1]["update"]
    assert update["logra"]["bytes"] <= update["adamw"]["bytes"]


@pytest.mark.parametrize("args, cause", [
    (("--target", "v5p-16"), "launch.cost reads XLA:GPU programs and has no model of what the TPU compiler"),
    (("--target", "cpu"), "no model of what XLA:CPU launches"),
    (("--target", "h300-8"), "unknown target 'h300-8'"),
    (("--target", "h200-8", "--batches", "1,zero"), "--batches 1,zero: expected positive integers"),
    (("--target", "h200-8", "--modes", "fast"), "--modes fast: expected some of"),
    (("--target", "h200-8", "--parts", "rollout", "--schedule", "lognormal:two"),
     "--schedule lognormal:two: expected lognormal:M with a median M ≥ 1"),
])
def test_bad_input_is_one_error_line(args, cause):
    result = _cost_cli("--config", "configs/tiny.py", *args)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert cause in result.stderr.strip().splitlines()[-1], result.stderr[-500:]


def test_a_default_decode_step_writes_its_cache_slot_in_place_and_sorts_nothing():
    """The tiny config's decode step as XLA:GPU compiles it for one H200 in the mode a GPU plan
    compiles by default, with top-p: no launch of the token loop writes as much as one layer's K
    or V cache (the cache is updated in place: a layer scan that stacked every layer's cache as
    its output rewrote it whole every token), and no sort runs (top-p chooses among the top-k
    candidates instead of sorting the vocabulary)."""
    from configs import tiny
    from logra_jax import model_shapes
    from logra_jax.perf import gpu_programs, memory
    from logra_jax.rl.build import build_mesh
    config = tiny.get_config()
    config.rl.top_p, config.rl.rollout_micro_batch = 0.9, 0
    # A cache of 4 rows × 4,096 slots: each layer's K outweighs the step's logits (4 × 49,152 f32).
    config.rl.max_completion_length = 4096 - config.rl.max_prompt_length
    config.model.tiny.max_position_embeddings = 4096
    mesh = build_mesh({"fsdp": 1, "tensor": 1}, machines.machine("h200-8").jax_devices()[:1])
    rows = 4
    mode = gpu_programs.default_decode_mode(config, mesh, rows)
    generate = memory.lower_generate(config, mesh, rows=rows, decode_weights=mode)
    text = generate.lowered.compile(compiler_options=machines.compiler_options_for(mesh)).as_text()
    model = model_shapes.model_config_from(config.model)
    step = gpu_cost.decode_step(text, vocab_size=model.vocab_size, hidden_size=model.hidden_size)
    slots = config.rl.max_prompt_length + config.rl.max_completion_length
    layer_k = memory.kv_cache_bytes(model, rows, slots, mesh) / (2 * model.num_layers)
    written = max(launch.written for launch, _ in step.trip.launches.values())
    assert written < layer_k, (mode, step.trip.largest(3))
    assert not any("sort" in kind for kind in step.kernels_by_kind()), step.kernels_by_kind()


def test_a_decode_steps_attention_reads_the_cache_in_place(one_gpu):
    """Attention for one query per row, Qwen2.5-1.5B's heads at batch 1 over 1,024 slots, as
    XLA:GPU compiles it for one H200: q·K as a product that reads K as the cache lays it out,
    weights·V fused with the softmax: two kernels, each cache read about once. With q·K as a
    multiply-sum XLA wrote an f32 copy of K transposed first: 3 kernels, 3.1 times the bytes."""
    from logra_jax.models.llama import grouped_query_attention
    heads, kv_heads, head_dim, slots = 12, 2, 128, 1024
    cost = _compile(one_gpu, grouped_query_attention, ((1, 1, heads, head_dim), jnp.bfloat16),
                    ((1, kv_heads, head_dim, slots), jnp.bfloat16),
                    ((1, kv_heads, slots, head_dim), jnp.bfloat16), ((1, 1, slots), jnp.bool_))
    cost = gpu_cost.Program(cost.as_text()).cost()
    cache = 2 * kv_heads * slots * head_dim * BF16
    assert cost.kernels <= 2, cost.kernels_by_kind()
    assert cost.bytes <= 1.15 * cache, cost.largest(4)


def test_the_decode_attention_kernel_is_one_launch_that_reads_the_cache_once(one_gpu):
    """`decode_kernels.decode_attention` as XLA:GPU compiles it for one H200 (Triton, deviceless):
    one kernel, and the cache it updates in place (one slot written) counted as read once, not
    written whole: Qwen2.5-1.5B's heads at batch 1 over 1,024 slots."""
    from logra_jax.models import decode_kernels
    heads, kv_heads, head_dim, slots = 12, 2, 128, 1024

    def attention(qkv, cos, sin, cache_k, cache_v, mask, slot):
        return decode_kernels.decode_attention(qkv, cos, sin, cache_k, cache_v, mask, slot,
                                               heads=heads)

    compiled = _compile(one_gpu, attention, ((1, (heads + 2 * kv_heads) * head_dim), jnp.bfloat16),
                        ((1, head_dim), jnp.bfloat16), ((1, head_dim), jnp.bfloat16),
                        ((1, kv_heads, head_dim, slots), jnp.bfloat16),
                        ((1, kv_heads, slots, head_dim), jnp.bfloat16), ((1, slots), jnp.bool_),
                        ((), jnp.int32), donate=(3, 4))
    cost = gpu_cost.Program(compiled.as_text()).cost()
    cache = 2 * kv_heads * slots * head_dim * BF16
    assert cost.kernels_by_kind().get("Pallas kernel") == 1, cost.kernels_by_kind()
    assert cost.kernels <= 2, cost.kernels_by_kind()   # and the mask made int32
    assert cache <= cost.bytes <= 1.05 * cache, cost.largest(4)


def test_peak_breakdown_of_generate_adds_up_to_xlas_memory_analysis(tmp_path):
    """`hlo_dump.peak_breakdown` of the sampler's generate, as XLA:GPU compiles it for one H200:
    its labels add up to the memory analysis (arguments + outputs − aliased + temporaries). Read
    from XLA's list of the values live at its peak (the live-range file), it left out a loop's
    carried values where another copy of them filled an allocation."""
    from configs import tiny
    from logra_jax.perf import hlo_dump, memory
    from logra_jax.rl.build import build_mesh

    config = tiny.get_config()
    config.rl.rollout_micro_batch = 0
    mesh = build_mesh({"fsdp": 1, "tensor": 1}, machines.machine("h200-8").jax_devices()[:1])
    lowered = memory.lower_generate(config, mesh, rows=8, decode_weights="stacked").lowered
    compiled = lowered.compile(compiler_options={
        **machines.XLA_GPU_OPTIONS, "xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True,
        "xla_dump_hlo_module_re": ".*generate.*"})
    total, entries = hlo_dump.peak_breakdown(tmp_path, module="generate")
    m = compiled.memory_analysis()
    assert total == (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                     + m.temp_size_in_bytes)
    assert total == sum(size for _, size in entries)


# ----------------------------------------------------------------------------------------------
# What the floors count, and the rollout part's schedules (no compile)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_a_decode_step_reads_an_untied_input_embedding_only_at_its_rows(tied):
    """A tied table is the head, read whole every step; an untied one is only looked up: a step
    of ``rows`` rows reads rows × one row of it (the tiny config: 49,152 × 64, bf16)."""
    from configs import tiny
    from logra_jax import model_shapes
    from logra_jax.perf import gpu_programs, memory
    from logra_jax.rl.build import build_mesh
    config = tiny.get_config()
    config.model.tiny.tie_embeddings = tied
    mesh = build_mesh({"fsdp": 1, "tensor": 1}, machines.machine("h200-8").jax_devices()[:1])
    rows = 4
    weights = memory.lower_generate(config, mesh, rows=rows).weights
    model = model_shapes.model_config_from(config.model)
    held = memory.device_bytes(weights)
    table = 49152 * 64 * BF16
    read = gpu_programs.weight_bytes_read(weights, model, rows)
    assert read == (held if tied else held - table + rows * 64 * BF16)


def test_the_lognormal_schedule_is_reproducible_and_capped():
    from logra_jax.perf import gpu_programs
    described, lengths = gpu_programs.completion_schedule("lognormal:200", 4096, 1536)
    assert gpu_programs.completion_schedule("lognormal:200", 4096, 1536)[1] == lengths
    assert described["lengths"] == lengths and len(lengths) == 4096
    assert min(lengths) >= 1 and max(lengths) == 1536   # e^Z > 7.68 for 2 % of the rows
    # Its median is M: the sample median of 4,096 draws lies within 4 % of it (the median's
    # standard error is σ·sqrt(π/2)/sqrt(n) = 2 % in log space).
    assert 200 / 1.04 < np.median(lengths) < 200 * 1.04


@pytest.mark.parametrize("text, cause", [
    ("3\n0\n", "line 2: '0' is not a completion length 1 … 8"),
    ("3\nfour\n", "line 2: 'four' is not a completion length"),
    ("3\n9\n", "line 2: '9' is not a completion length 1 … 8"),
    ("3\n\n4\n", "2 lengths for a rollout of 3 rows"),
])
def test_a_schedule_file_holds_one_length_per_row(tmp_path, text, cause):
    from logra_jax.perf import gpu_programs
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=cause):
        gpu_programs.completion_schedule(str(path), 3, 8)
    path.write_text("3\n\n8\n1\n")
    assert gpu_programs.completion_schedule(str(path), 3, 8)[1] == [3, 8, 1]
    with pytest.raises(ValueError, match="neither lognormal:M nor a readable file"):
        gpu_programs.completion_schedule(str(tmp_path / "missing.txt"), 3, 8)
