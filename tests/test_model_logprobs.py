"""token_logprobs (vocab-chunked) against the full log_softmax, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.models.logprobs import token_logprobs

B, T, D, V = 2, 5, 16, 37


@pytest.fixture(scope="module")
def data():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    hidden = jax.random.normal(k[0], (B, T, D))
    head = 2.0 * jax.random.normal(k[1], (D, V))
    targets = jax.random.randint(k[2], (B, T), 0, V)
    return hidden, head, targets


def full(hidden, head, targets, temperature):
    logp = jax.nn.log_softmax(hidden @ head / temperature)
    return (jnp.take_along_axis(logp, targets[..., None], -1)[..., 0],
            -(jnp.exp(logp) * logp).sum(-1))


def total(fn):
    return lambda h, w: sum(x.sum() for x in fn(h, w))


@pytest.mark.parametrize("chunk_size,temperature", [(5, 1.0), (8, 0.7), (37, 1.3), (1000, 1.0)])
def test_equals_full_log_softmax_and_its_gradient(data, chunk_size, temperature):
    hidden, head, targets = data
    chunked = lambda h, w: token_logprobs(h, w, targets, temperature=temperature,  # noqa: E731
                                          chunk_size=chunk_size)
    reference = lambda h, w: full(h, w, targets, temperature)  # noqa: E731
    logp, entropy = chunked(hidden, head)
    ref_logp, ref_entropy = reference(hidden, head)
    assert logp.dtype == entropy.dtype == jnp.float32 and logp.shape == (B, T)
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    grads = jax.grad(total(chunked), (0, 1))(hidden, head)
    ref_grads = jax.grad(total(reference), (0, 1))(hidden, head)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_extreme_logits_stay_finite(data):
    hidden, head, targets = data
    logp, entropy = token_logprobs(100.0 * hidden, head, targets, chunk_size=8)
    ref_logp, ref_entropy = full(100.0 * hidden, head, targets, 1.0)
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-2)
    np.testing.assert_allclose(entropy, ref_entropy, atol=1e-3)


def test_bf16_hidden_matches_bf16_matmul_with_fp32_accumulation(data):
    hidden, head, targets = data
    h16 = hidden.astype(jnp.bfloat16)
    logp, _ = token_logprobs(h16, head, targets, chunk_size=8)
    logits = jnp.einsum("btd,dv->btv", h16, head.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    ref = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp, ref, atol=1e-4)


def _shapes(jaxpr):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(getattr(var.aval, "shape", ()))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _shapes(inner)


def test_never_builds_full_logits_forward_or_backward(data):
    hidden, head, targets = data
    fn = total(lambda h, w: token_logprobs(h, w, targets, chunk_size=8))
    shapes = set(_shapes(jax.make_jaxpr(jax.grad(fn, (0, 1)))(hidden, head).jaxpr))
    assert (B, T, 8) in shapes  # one chunk of logits at a time ...
    assert not any(len(s) >= 1 and s[-1] == V and s != (D, V) for s in shapes), shapes  # ... never [b, t, V]
    full_shapes = set(_shapes(jax.make_jaxpr(jax.grad(total(lambda h, w: full(h, w, targets, 1.0)),
                                                      (0, 1)))(hidden, head).jaxpr))
    assert (B, T, V) in full_shapes  # the check above can fail


def test_validation(data):
    hidden, head, targets = data
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(hidden, head, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size must be > 0"):
        token_logprobs(hidden, head, targets, chunk_size=0)
    with pytest.raises(ValueError, match=r"hidden \[b, t, d\] and head \[d, V\]"):
        token_logprobs(hidden, head.T, targets)
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(hidden, head, targets[:, :2])
