"""The LoGRA optimizer as each compiler gets it: batched over the layer stack for XLA:GPU, one layer
per loop iteration for XLA:CPU and the TPU compiler (low_rank.layers_per_step).

XLA:GPU launches every operation of a loop body once per iteration: a loop over the layers of each
target made Qwen2.5-1.5B's update 10,140 kernels against 6,217 batched (docs/results/step_time.md).
Here the optimizer's update and merge, compiled deviceless for an H100 on a stack of 2 and of 10
layers, must launch the same number of kernels, up to XLA's fusion choices for other shapes (fewer
than one more per added layer; a loop over layers adds dozens): nothing in it may run once per
layer. The count reads the program as XLA:GPU runs it (perf/gpu_cost.py: each thunk one launch, a
loop's body once per trip). And the batched form is the same arithmetic: every step size merges
the same bits, and the GPU's norm is the sum of each target's.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from logra_jax.optim import (LowRankUpdate, apply_updates_counting_changes, logra, low_rank,
                             predicted_kl, projection_keys)
from logra_jax.optim.targets import SketchSpec
from logra_jax.perf import gpu_cost, machines
from logra_jax.tree_paths import map_with_paths

def _params(layers: int):
    f32 = jnp.float32
    return {"embed": jax.ShapeDtypeStruct((64, 32), f32),
            "layers": {"norm": jax.ShapeDtypeStruct((layers, 32), f32),
                       "q_proj": {"kernel": jax.ShapeDtypeStruct((layers, 32, 48), f32)},
                       "up_proj": {"kernel": jax.ShapeDtypeStruct((layers, 32, 96), jnp.bfloat16)},
                       "down_proj": {"kernel": jax.ShapeDtypeStruct((layers, 96, 32), f32)}}}


def _optimizer_step(devices, layers: int, variant: str, exact: bool):
    """The optimizer's update and merge of a ``layers``-deep stack, lowered for ``devices[0]``."""
    mesh = Mesh(devices[:1], ("fsdp",))
    placed = NamedSharding(mesh, P())
    tx = logra(variant=variant, rank=8, exact_merge=exact)
    spec = SketchSpec(rank=8)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed),
                          _params(layers))

    def gradient(path, x):   # sketches at the targets, dense gradients elsewhere
        shape = spec.info(path, x.shape).sketch_shape if spec.is_target(path) else x.shape
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=placed)
    grads = map_with_paths(gradient, params)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed),
                         jax.eval_shape(tx.init, params))

    def step(params, state, grads):
        kwargs = {"predict_kl": lambda *_: jnp.float32(1e-4)} if variant == "kl" else {}
        updates, state = tx.update(grads, state, params, **kwargs)
        return (*apply_updates_counting_changes(params, updates), state)
    with predicted_kl.host_checks_left_out():   # its host callback lowers for no deviceless target
        return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads)


# CI installs the gpu-plan extra: there a missing plugin fails these tests instead of skipping them.
_NO_XLA_GPU = machines.plugin_version() is None and os.environ.get("CI") != "true"
_NO_XLA_GPU_REASON = "the CUDA plugin (the 'gpu-plan' extra) is not installed: no XLA:GPU"
needs_xla_gpu = pytest.mark.skipif(_NO_XLA_GPU, reason=_NO_XLA_GPU_REASON)


@needs_xla_gpu
@pytest.mark.parametrize("variant, exact", [("learning_rate", False), ("kl", True)])
def test_on_a_gpu_the_optimizer_launches_no_kernel_per_layer(variant, exact):
    """GRPO with the plain merge (clipping's reconstructed norm, the merge) and the KL variant
    with the order-free merge (also the update ratio's norm): 8 more layers, not 8 more kernels
    (a loop over layers adds some 50 to 100 a layer here)."""
    h100 = machines.machine("h100-8")
    counts = {}
    for layers in (2, 10):
        compiled = _optimizer_step(h100.jax_devices(), layers, variant, exact).compile(
            compiler_options=h100.compiler_options())
        counts[layers] = gpu_cost.of_compiled(compiled).kernels
    print(f"\n{variant}, exact={exact}: kernels launched by 2 / 10 layers: {counts}")
    assert abs(counts[10] - counts[2]) < 8, counts


def _loops_over_the_stack(hlo: str, layers: int) -> int:
    """While loops that carry a ``layers``-deep stack (a layer loop rewrites or maps it)."""
    return sum(1 for line in hlo.splitlines()
               if re.search(r" = \(.*\) while\(", line) and re.search(rf"\[{layers},", line.split(" while(")[0]))


@pytest.mark.parametrize("compiler", ["XLA:GPU", "XLA:CPU", "TPU"])
def test_only_xla_gpu_gets_the_batched_form(compiler):
    """The plain merge (no loop over slice pairs): no loop over the 5-layer stack for XLA:GPU; the
    loops over layers (the norm's, the merge's: 3 targets each) for XLA:CPU and the TPU compiler,
    which launch nothing per iteration and hold one layer's temporaries at a time."""
    if compiler == "XLA:GPU":
        if _NO_XLA_GPU:
            pytest.skip(_NO_XLA_GPU_REASON)
        h100 = machines.machine("h100-8")
        devices, options = h100.jax_devices(), h100.compiler_options()
    elif compiler == "TPU":
        if machines.libtpu_version() is None:
            pytest.skip("libtpu (the 'tpu' extra) is not installed: no TPU compiler")
        devices, options = machines.machine("v5e-8").jax_devices(), None
    else:
        devices, options = jax.devices(), None
    hlo = _optimizer_step(devices, 5, "learning_rate", False).compile(compiler_options=options).as_text()
    assert _loops_over_the_stack(hlo, 5) == (0 if compiler == "XLA:GPU" else 6), compiler


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_every_step_size_merges_the_same_bits(monkeypatch, param_dtype):
    """The batched form is the per-layer arithmetic, by construction: the order-free merge of a
    7-layer stack (into bf16 with stochastic rounding too) gives the same bits one layer a step,
    3 a step (two steps and a 1-layer tail) and 7 at once, and the same count of changed entries;
    the reconstructed norm agrees to fp32 rounding (plain fp32 dots, summed over layers)."""
    kernel = (0.02 * jax.random.normal(jax.random.PRNGKey(0), (7, 48, 40))).astype(param_dtype)
    update = LowRankUpdate(factor=1e-4 * jax.random.normal(jax.random.PRNGKey(1), (7, 40, 8)),
                           key=projection_keys(5, "layers/mlp/up_proj/kernel", 3, (7,)),
                           weight_scale=jnp.float32(0.999), rounding="stochastic")
    merged, norms = {}, {}
    for chunk in (1, 3, 7):
        monkeypatch.setattr(low_rank, "layers_per_step", lambda n, layer_bytes, platform: chunk)
        merged[chunk] = jax.jit(lambda k, u: u.merge_counting_changes(k))(kernel, update)
        norms[chunk] = jax.jit(lambda f, k: low_rank.reconstructed_sq_norm(
            f, k, 48, "rademacher", (7,)))(update.factor, update.key)
    assert float(merged[1][1]) > 0.01                   # the update changed entries
    for chunk in (3, 7):
        np.testing.assert_array_equal(np.asarray(merged[chunk][0]), np.asarray(merged[1][0]))
        assert float(merged[chunk][1]) == pytest.approx(float(merged[1][1]), rel=1e-6)
        assert float(norms[chunk]) == pytest.approx(float(norms[1]), rel=1e-6)


def test_the_gpu_form_of_the_norm_is_the_sum_of_each_targets(monkeypatch):
    """XLA:GPU's reconstructed norm (the Gram matrices of all targets with one A shape in one
    batched program, Σ G ∘ SᵀS over all of them) is, to fp32 rounding, the sum of each target's
    own Σ trace(S G Sᵀ): three targets, two sharing A's shape, one unstacked. The GPU form runs
    here on XLA:CPU, named a batched platform."""
    shapes = [("layers/q_proj/kernel", (4,), 24, 40), ("layers/up_proj/kernel", (4,), 56, 40),
              ("o_proj/kernel", (), 40, 24)]
    sketches = [jax.random.normal(jax.random.PRNGKey(i), stack + (out, 8))
                for i, (_, stack, out, _) in enumerate(shapes)]
    keys = [projection_keys(3, path, 2, stack) for path, stack, _, _ in shapes]

    def norm(sketches, keys):
        return low_rank.reconstructed_sq_norm_sum(
            [(s, k, in_dim, stack) for s, k, (_, stack, _, in_dim) in zip(sketches, keys, shapes)],
            "rademacher")
    separately = float(jax.jit(lambda s, k: norm(s, k))(sketches, keys))
    assert separately == pytest.approx(sum(
        float(low_rank.reconstructed_sq_norm(s, k, in_dim, "rademacher", stack))
        for s, k, (_, stack, _, in_dim) in zip(sketches, keys, shapes)), rel=1e-6)
    monkeypatch.setattr(low_rank, "_BATCHED_PLATFORMS", ("cpu",))
    assert float(jax.jit(lambda s, k: norm(s, k))(sketches, keys)) == pytest.approx(separately, rel=1e-5)
