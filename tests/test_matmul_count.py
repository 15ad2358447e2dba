"""logra_jax/perf/matmul_count.py: a compiled program's matmul operations, loops counted as they run.

Each program is compiled by XLA:CPU and by the TPU compiler (a v5e chip, deviceless): the TPU
compiler writes its products as convolutions and its loops without a recorded trip count, and the
count must come out the same.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from logra_jax.perf import machines, matmul_count

N = 64
ONE_PRODUCT = 2 * N ** 3   # (N × N)·(N × N)


@pytest.fixture(params=["cpu", "tpu"])
def platform(request):
    if request.param == "tpu" and machines.libtpu_version() is None:
        pytest.skip("libtpu (the 'tpu' extra) is not installed: no TPU compiler")
    return request.param


def _compiled(fn, *args, platform="cpu"):
    if platform == "tpu":
        one_chip = NamedSharding(Mesh(np.array(machines.machine("v5e-8").jax_devices()[:1]), ("x",)), P())
        args = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a), sharding=one_chip)
                for a in args]
    return jax.jit(fn).lower(*args).compile()


def _xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.parametrize("trips", [1, 7])
def test_a_loop_body_counts_once_per_trip(trips, platform):
    x = jnp.ones((N, N))
    compiled = _compiled(lambda x: jax.lax.fori_loop(0, trips, lambda i, y: jnp.tanh(y @ x), x), x,
                         platform=platform)
    got = matmul_count.of_compiled(compiled)
    assert got == matmul_count.MatmulCount(flops=trips * ONE_PRODUCT, unknown_loops=0)
    # Why this module exists: XLA's own count sees the body once, whatever the trip count.
    assert _xla_flops(compiled) < 2 * ONE_PRODUCT


def test_nested_loops_multiply_and_fused_dots_count(platform):
    x = jnp.ones((N, N))

    def program(x):
        def outer(carry, _):
            inner = lambda c, _: (jnp.tanh(c @ x) * 2.0 + 1.0, None)   # a dot XLA fuses
            return jax.lax.scan(inner, carry, None, length=3)[0], None
        return jax.lax.scan(outer, x, None, length=4)[0] @ x
    assert matmul_count.of_compiled(_compiled(program, x, platform=platform)).flops == (4 * 3 + 1) * ONE_PRODUCT


def test_batched_and_transposed_contractions_are_sized_from_their_operands(platform):
    a, b = jnp.ones((5, 8, 32)), jnp.ones((5, 32, 16))
    c = jnp.ones((32, 12))

    def program(a, b, c):
        batched = jnp.einsum("bij,bjk->bik", a, b)                # 5 × (8 × 32)·(32 × 16)
        contracted_first = jnp.einsum("tk,tn->kn", a[0].T, c)     # (32 × 8)ᵀ·(32 × 12)
        return batched.sum() + contracted_first.sum()
    expected = 2 * 5 * 8 * 32 * 16 + 2 * 8 * 32 * 12
    assert matmul_count.of_compiled(_compiled(program, a, b, c, platform=platform)).flops == expected


def test_a_loop_without_a_known_trip_count_counts_once_and_says_so(platform):
    x = jnp.ones((N, N))

    def program(x, n):
        return jax.lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, jnp.tanh(s[1] @ x)),
                                  (0, x))[1]
    got = matmul_count.of_compiled(_compiled(program, x, jnp.int32(5), platform=platform))
    assert got == matmul_count.MatmulCount(flops=ONE_PRODUCT, unknown_loops=1)


def test_text_without_an_entry_computation_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        matmul_count.count("HloModule empty\n")


# A GPU backend's optimized HLO (as XLA's GEMM rewriter writes it; no GPU here to compile one):
# a cuBLAS GEMM with a tuple result (product, workspace) in a loop of 3, and a cuBLASLt matmul
# with its operands printed with their types.
GPU_HLO = """HloModule gpu, entry_computation_layout={(f32[32,64]{1,0}, f32[64,16]{1,0})->f32[32,16]{1,0}}

%body (state: (s32[], f32[32,64], f32[64,16])) -> (s32[], f32[32,64], f32[64,16]) {
  %state = (s32[], f32[32,64]{1,0}, f32[64,16]{1,0}) parameter(0)
  %a = f32[32,64]{1,0} get-tuple-element(%state), index=1
  %b = f32[64,16]{1,0} get-tuple-element(%state), index=2
  %gemm = (f32[32,16]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  %i = s32[] get-tuple-element(%state), index=0
  ROOT %next = (s32[], f32[32,64]{1,0}, f32[64,16]{1,0}) tuple(%i, %a, %b)
}

%cond (state.1: (s32[], f32[32,64], f32[64,16])) -> pred[] {
  %state.1 = (s32[], f32[32,64]{1,0}, f32[64,16]{1,0}) parameter(0)
  ROOT %go = pred[] constant(true)
}

ENTRY %main (p0: f32[32,64], p1: f32[64,16]) -> f32[32,16] {
  %p0 = f32[32,64]{1,0} parameter(0)
  %p1 = f32[64,16]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[32,64]{1,0}, f32[64,16]{1,0}) tuple(%zero, %p0, %p1)
  %loop = (s32[], f32[32,64]{1,0}, f32[64,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %lt = (f32[32,16]{1,0}, s8[0]{0}) custom-call(f32[32,64]{1,0} %p0, f32[64,16]{1,0} %p1), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %out = f32[32,16]{1,0} get-tuple-element(%lt), index=0
}
"""


def test_gpu_library_gemms_count_like_dots():
    got = matmul_count.count(GPU_HLO)
    assert got == matmul_count.MatmulCount(flops=(3 + 1) * 2 * 32 * 64 * 16, unknown_loops=0)


@pytest.mark.parametrize("stride, padding, lhs_dilation, rhs_dilation", [
    (1, (0, 0), 1, 1), (2, (3, 2), 1, 2), (1, (2, 3), 3, 1), (2, (1, 1), 2, 2)])
def test_a_convolution_counts_the_taps_that_meet_the_input(platform, stride, padding, lhs_dilation,
                                                           rhs_dilation):
    """A padded, strided, dilated convolution (1-D, 3 → 5 channels): its products are the window
    taps that land on an input point. The oracle is the convolution itself: over all-ones inputs
    each output is the number of its products over one output channel."""
    x, w = jnp.ones((2, 3, 11)), jnp.ones((5, 3, 4))

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (stride,), [padding], (lhs_dilation,),
                                            (rhs_dilation,))
    products = float(jnp.sum(conv(x, w)))
    got = matmul_count.of_compiled(_compiled(conv, x, w, platform=platform))
    assert got == matmul_count.MatmulCount(flops=2 * products, unknown_loops=0)
