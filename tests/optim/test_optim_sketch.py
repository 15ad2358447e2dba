"""§3: the probe gradient is the sketch S = G·Aᵀ, and the dense target gradient is never formed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models.linear import Linear
from logra_jax.optim import (SketchSpec, make_probes, merge_targets, probe_factors, projection,
                             split_targets, with_factors)
from logra_jax.optim.low_rank import sketch_dense
from optim_tiny_lm import abstract_build, build, next_token_loss

RANK = 4
SPEC = SketchSpec(rank=RANK, seed=7)


def _probe_grad_fn(loss):
    """grad of the loss w.r.t. (non-target params, probe factors): the trainer's sketch path."""
    def grads(target_kernels, others, probes, tokens):
        def of(others, factors):
            return loss(merge_targets(others, target_kernels), tokens, with_factors(probes, factors))
        return jax.grad(of, argnums=(0, 1))(others, probe_factors(probes))
    return grads


@pytest.fixture(scope="module")
def tiny():
    _, params, logits_fn = build(vocab=40, d=12, f=20, num_layers=3, seed=1)
    return params, next_token_loss(logits_fn)


def _expected_sketch(dense_kernel_grad, keys, rank):
    """S = G·Aᵀ per layer, in numpy, from the dense kernel gradient Gᵀ (*stack, in, out)."""
    g = np.asarray(dense_kernel_grad, np.float64)
    keys = np.asarray(keys)
    stack = g.shape[:-2]
    g = g.reshape((-1,) + g.shape[-2:])
    keys = keys.reshape((-1,) + keys.shape[len(stack):])
    out = [g_l.T @ np.asarray(projection(jnp.asarray(k), rank, g_l.shape[0]), np.float64).T
           for g_l, k in zip(g, keys)]
    return np.stack(out).reshape(stack + out[0].shape)


def test_probe_gradient_is_the_sketch_over_accumulated_microbatches(tiny):
    params, loss = tiny
    probes = make_probes(params, 3, SPEC)
    target_kernels, others = split_targets(params, SPEC)
    probe_grads = jax.jit(_probe_grad_fn(loss))
    dense_grads = jax.jit(jax.grad(loss))
    micro_batches = jax.random.randint(jax.random.PRNGKey(0), (3, 2, 7), 0, 40)

    sketches = other_grads = dense = None
    for tokens in micro_batches:   # micro-batch sketches simply add up, like gradients
        g_other, g_factor = probe_grads(target_kernels, others, probes, tokens)
        g_dense = dense_grads(params, tokens)
        add = lambda acc, x: x if acc is None else jax.tree.map(jnp.add, acc, x)  # noqa: E731
        sketches, other_grads, dense = add(sketches, g_factor), add(other_grads, g_other), add(dense, g_dense)

    assert set(sketches) == {"layers/q_proj/kernel", "layers/up_proj/kernel",
                             "layers/down_proj/kernel", "gate_proj/kernel"}
    dense_targets, dense_others = split_targets(dense, SPEC)
    for path, s in sketches.items():
        expected = _expected_sketch(dense_targets[path], probes[path].key, RANK)
        assert s.shape == expected.shape
        np.testing.assert_allclose(np.asarray(s), expected, rtol=1e-5,
                                   atol=1e-5 * np.abs(expected).max(), err_msg=path)
        # the optimizer's drop-in path (dense → sketch) agrees too
        info = SPEC.info(path, dense_targets[path].shape)
        ours = sketch_dense(dense_targets[path], probes[path].key, RANK, SPEC.distribution,
                            info.stack_shape)
        np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-5,
                                   atol=1e-5 * np.abs(expected).max(), err_msg=path)
    # non-target (input-side) gradients do not see the probe at all
    for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(dense_others)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_linear_probe_keeps_input_gradient_and_value():
    layer = Linear(6, 5, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 6))
    probe = make_probes({"q_proj": {"kernel": layer.kernel[...]}}, 0, SketchSpec(rank=3))
    probe = probe["q_proj/kernel"]
    weights = jax.random.normal(jax.random.PRNGKey(2), (3, 5))

    def f(x, p):
        return jnp.sum(jnp.sin(layer(x, p)) * weights)
    np.testing.assert_array_equal(layer(x, probe), layer(x))
    np.testing.assert_allclose(jax.grad(f)(x, probe), jax.grad(f)(x, None), rtol=1e-6)


def _eqn_output_shapes(jaxpr) -> set:
    """Shapes of every value an equation computes, inside scans/remat/pjit too.

    ``stop_gradient`` is skipped: it is the identity on the forward weight (Linear's
    stop_gradient(kernel)), not a gradient, and lowers to no HLO op.
    """
    shapes = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "stop_gradient":
            shapes.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (tuple, list)) else (param,)):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    shapes |= _eqn_output_shapes(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    shapes |= _eqn_output_shapes(sub)
    return shapes


def test_no_dense_target_gradient_in_the_jaxpr(tiny):
    params, loss = tiny
    probes = make_probes(params, 0, SPEC)
    target_kernels, others = split_targets(params, SPEC)
    # 2 × 5 = 10 flat tokens (Linear flattens them): no activation shape equals a kernel's.
    tokens = jnp.zeros((2, 6), jnp.int32)
    dense_shapes = set()
    for kernel in target_kernels.values():      # (in, out), its transpose, and the stacked forms
        *stack, i, o = kernel.shape
        dense_shapes |= {(i, o), (o, i), tuple(stack) + (i, o), tuple(stack) + (o, i)}

    sketch_jaxpr = jax.make_jaxpr(_probe_grad_fn(loss))(target_kernels, others, probes, tokens)
    dense_jaxpr = jax.make_jaxpr(jax.grad(loss))(params, tokens)
    assert dense_shapes & _eqn_output_shapes(dense_jaxpr.jaxpr)   # the check can see them
    assert not dense_shapes & _eqn_output_shapes(sketch_jaxpr.jaxpr)


def test_backward_memory_is_smaller_than_dense_at_width_1024():
    params, logits_fn = abstract_build(vocab=64, d=1024, f=2048, num_layers=2)
    loss = next_token_loss(logits_fn)
    spec = SketchSpec(rank=16)
    probes = make_probes(params, 0, spec)
    target_kernels, others = split_targets(params, spec)
    tokens = jax.ShapeDtypeStruct((2, 65), jnp.int32)

    def total(compiled):
        m = compiled.memory_analysis()
        return m.temp_size_in_bytes + m.output_size_in_bytes

    sketch_bytes = total(jax.jit(_probe_grad_fn(loss)).lower(target_kernels, others, probes,
                                                             tokens).compile())
    dense_bytes = total(jax.jit(jax.grad(loss)).lower(params, tokens).compile())
    target_bytes = sum(np.prod(k.shape) * 4 for k in target_kernels.values())
    print(f"backward temp+output bytes: sketch {sketch_bytes / 2**20:.1f} MiB, "
          f"dense {dense_bytes / 2**20:.1f} MiB, target weights {target_bytes / 2**20:.1f} MiB")
    # The dense backward must write a gradient as large as every target kernel; the sketch one not.
    assert dense_bytes >= target_bytes
    assert sketch_bytes < dense_bytes - 0.9 * target_bytes
