"""logra_jax/perf/profiling.py: wall-time attribution of a compiled program's operations."""

import jax
import jax.numpy as jnp
import pytest

from logra_jax.perf import hlo_module, profiling
from process_env import without_device_count


def _op(name, ts, dur):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "args": {"hlo_op": name}}


def _end(name, ts):
    return {"ph": "X", "name": f"end: {name}", "ts": ts, "dur": 0.1, "args": {}}


CATEGORIES = {   # a merge inside the optimizer's scope counts as the merge; a loop as nothing
    "dot.1": profiling.category("dot", "jit(f)/dot_general", multiplies=True),
    "fusion.2": profiling.category("fusion", "jit(f)/optimizer/logra_merge/mul", multiplies=False),
    "add.3": profiling.category("add", "jit(f)/add", multiplies=False),
    "while.4": profiling.category("while", "jit(f)/while", multiplies=False),
}


def test_overlapping_operations_share_the_wall_clock():
    # dot 0–4 ms, merge fusion 2–6 ms: 2 ms alone each, 2 ms together (1 ms each); a gap 6–7 ms;
    # add 7–8 ms; the while around all of it is a container and counts nothing itself.
    events = [_op("while.4", 0, 8000), _op("dot.1", 0, 4000), _op("fusion.2", 2000, 4000),
              _op("add.3", 7000, 1000)]
    got = profiling.attribute(events, CATEGORIES)
    assert got == pytest.approx({profiling.MATMULS: 3.0, "merge W += U·A": 3.0,
                                 profiling.IDLE: 1.0, profiling.OTHER: 1.0})
    assert sum(got.values()) == pytest.approx(8.0)


def test_an_asynchronous_operation_runs_until_its_end_mark():
    # The dot's event covers its 0.5 ms launch; its "end:" mark comes at 5 ms. Run twice (a loop):
    # each run ends at the first mark after it.
    events = [_op("dot.1", 0, 500), _end("dot.1", 5000), _op("add.3", 5000, 1000),
              _op("dot.1", 6000, 500), _end("dot.1", 9000)]
    got = profiling.attribute(events, CATEGORIES)
    assert got == pytest.approx({profiling.MATMULS: 8.0, profiling.OTHER: 1.0})


def test_a_real_program_is_split_by_named_scope():
    def f(x, y, n):
        with jax.named_scope("logra_sketch"):
            s = x @ y
        with jax.named_scope("logra_projection"):
            bits = jax.lax.fori_loop(0, n, lambda i, b: b * 3 + 1, jnp.ones((256, 256), jnp.uint32))
        return jnp.tanh(x @ s) + bits.astype(jnp.float32)

    x = jnp.ones((256, 256), jnp.float32)
    compiled = jax.jit(f).lower(x, x, 8).compile()
    categories = set(profiling.categories(hlo_module.parse(compiled.as_text())).values())
    assert {"sketch products x·Aᵀ, Hᵀ(x·Aᵀ)", "A regenerated (random bits)", profiling.MATMULS,
            profiling.OTHER} <= categories

    jax.block_until_ready(compiled(x, x, 8))
    profile, out = profiling.profile_call(compiled, (x, x, 8))
    assert jnp.allclose(out, f(x, x, 8))
    assert profile.categories["sketch products x·Aᵀ, Hᵀ(x·Aᵀ)"] > 0
    assert profile.categories[profiling.MATMULS] > 0
    assert 0 < sum(profile.categories.values()) <= profile.wall_ms * 1.01


# The shape of what XLA prints: a loop whose body copies its carried state (a copy XLA inserted,
# without op_name), the loop in a named scope, and a fusion around a dot.
HLO = """HloModule jit_f, is_scheduled=true

%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.0 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general"}
}

%body (arg: (s32[], u32[4,4])) -> (s32[], u32[4,4]) {
  %arg = (s32[], u32[4,4]{1,0}) parameter(0)
  %gte.1 = u32[4,4]{1,0} get-tuple-element(%arg), index=1
  %copy.7 = u32[4,4]{1,0} copy(%gte.1)
  %gte.0 = s32[] get-tuple-element(%arg), index=0
  ROOT %tuple.2 = (s32[], u32[4,4]{1,0}) tuple(%gte.0, %copy.7)
}

ENTRY %main (x: f32[4,4], init: (s32[], u32[4,4])) -> f32[4,4] {
  %x = f32[4,4]{1,0} parameter(0), metadata={op_name="x"}
  %init = (s32[], u32[4,4]{1,0}) parameter(1)
  %while.3 = (s32[], u32[4,4]{1,0}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(f)/logra_projection/while"}
  ROOT %ynn_fusion = f32[4,4]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(f)/dot_general"}
}
"""


def test_categories_read_dots_in_fusions_and_inherited_scopes():
    module = hlo_module.parse(HLO)
    categories, op_names = profiling.categories(module), profiling.op_names(module)
    assert profiling.multiplies(module, module.instruction("main", "ynn_fusion"))   # a dot inside
    assert op_names["ynn_fusion"] == "jit(f)/dot_general"
    assert categories["ynn_fusion"] == profiling.MATMULS
    assert categories["while.3"] is None            # a container
    # The copy in the loop body has no op_name: it takes the loop's, and the loop's scope.
    assert op_names["copy.7"] == "jit(f)/logra_projection/while"
    assert categories["copy.7"] == "A regenerated (random bits)"
    assert categories["gte.0"] == "A regenerated (random bits)"
    assert categories["x"] == profiling.OTHER


def test_step_time_profile_prints_both_optimizers_split():
    """`launch.step_time --profile` end to end, on a tiny model (one device). Two layers: with
    one, XLA:CPU folds the merge's one-iteration loop into the dense updates' fused kernels, whose
    time the profile can only give to the kernel's own op (the optimizer's)."""
    import os
    import subprocess
    import sys
    env = without_device_count(JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-m", "launch.step_time", "--profile", "--widths", "128", "--rank", "16",
         "--layers", "2", "--rows", "2", "--prompt_length", "8", "--completion_length", "8"],
        capture_output=True, text=True, env=env, timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {line.split("  ")[0]: line for line in out.stdout.splitlines()}
    for name in (profiling.MATMULS, "sketch products x·Aᵀ, Hᵀ(x·Aᵀ)", "merge W += U·A"):
        assert name in lines, out.stdout
    logra, adamw = (float(v) for v in lines["sketch products x·Aᵀ, Hᵀ(x·Aᵀ)"].split()[-3:-1])
    assert logra > 0 and adamw == 0          # only LoGRA sketches
    assert "ratio" in lines["total (traced)"]


def test_paired_ratio_is_blind_to_a_slow_spell_that_the_ratio_of_medians_sees():
    """Benchmarks alternate the runs they compare, so a slow spell of the machine scales both runs
    of a round. The median of per-round ratios ignores it; the ratio of the two medians does not."""
    import statistics

    import numpy as np
    from launch.bench_stats import paired_ratio

    rng = np.random.default_rng(0)
    base = rng.uniform(0.8, 0.95, size=7)                 # LoGRA / AdamW in each round
    adamw = rng.uniform(12.0, 13.0, size=7)
    spell = np.array([1.0, 1.0, 1.3, 1.3, 1.3, 1.0, 1.3])  # rounds run 30 % slower
    steady = {"logra": list(base * adamw), "adamw": list(adamw)}
    slow = {"logra": list(base * adamw * spell), "adamw": list(adamw * spell)}

    median, low, high = paired_ratio(steady, "logra", "adamw")
    assert (median, low, high) == pytest.approx((np.median(base), base.min(), base.max()))
    assert paired_ratio(slow, "logra", "adamw") == pytest.approx((median, low, high))
    moved = statistics.median(slow["logra"]) / statistics.median(slow["adamw"])
    assert abs(moved - median) > 0.01, (moved, median)
    with pytest.raises(ValueError):                      # unpaired rounds are a bug, not a ratio
        paired_ratio({"logra": [1.0, 2.0], "adamw": [1.0]}, "logra", "adamw")
    assert all(np.isnan(paired_ratio({"logra": [], "adamw": []}, "logra", "adamw")))


def test_step_time_count_ops_without_a_config_says_what_it_needs():
    import os
    import subprocess
    import sys
    env = without_device_count(JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "launch.step_time", "--count_ops"],
                         capture_output=True, text=True, env=env, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == "error: --count_ops needs --config"
