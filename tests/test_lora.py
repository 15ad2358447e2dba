"""LoRA (optim/lora.py) as a baseline in the same loop: zero-B adapters are the base model, only
adapters learn, merged weights equal base + adapters, the sampler runs base + adapters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models.config import tiny
from logra_jax.models.llama import Decoder
from logra_jax.optim.lora import LORA_KEY, init_adapters, merge_adapters
from logra_jax.rl.policy import Policy, Sequences
from logra_jax.rl.sampler import Sampler
from logra_jax.tree_paths import leaves_with_paths

SCALE = 2.0


@pytest.fixture(scope="module")
def setup():
    model = Decoder(tiny(), rngs=nnx.Rngs(0))
    params = Policy.params_of(model)
    adapters = init_adapters(params, r"layers/(self_attn|mlp)/\w+_proj/kernel", rank=4, seed=1)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, 96)
    seqs = Sequences(tokens=tokens, segment_mask=jnp.ones((2, 12), bool),
                     positions=jnp.broadcast_to(jnp.arange(12), (2, 12)),
                     completion_mask=jnp.ones((2, 6), bool), prompt_length=6)
    return Policy(model, lora_scale=SCALE), params, adapters, seqs


def _trained(adapters, seed=3):
    """Adapters with nonzero B (as after training)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 2 * len(adapters)))
    return {k: {"a": v["a"], "b": 0.3 * jax.random.normal(next(keys), v["b"].shape)}
            for k, v in adapters.items()}


def test_zero_b_is_the_base_model(setup):
    policy, params, adapters, seqs = setup
    assert {v["b"].shape[-1] for v in adapters.values()} == {4} and len(adapters) == 7
    base = policy.completion_logits(params, seqs)
    with_adapters = policy.completion_logits(dict(params, **{LORA_KEY: adapters}), seqs)
    np.testing.assert_array_equal(with_adapters, base)


def test_gradient_reaches_only_the_adapters(setup):
    """d loss / d(base, adapters) through the Policy: the adapters' B gets a gradient (A's is 0 at
    B = 0, as in LoRA), and the loss the trainer differentiates never sees the base as an input."""
    policy, params, adapters, seqs = setup

    def loss(adapters_):
        logp, _ = policy.completion_logprobs(dict(params, **{LORA_KEY: adapters_}), seqs)
        return -jnp.mean(logp)
    gradient = jax.jit(jax.grad(loss))   # one compile for both calls (eager: op by op, 33 s)
    grads = gradient(adapters)
    for key, g in grads.items():
        assert float(jnp.abs(g["b"]).max()) > 0, key
        assert float(jnp.abs(g["a"]).max()) == 0, key
    grads = gradient(_trained(adapters))
    assert all(float(jnp.abs(g["a"]).max()) > 0 for g in grads.values())


def test_merged_weights_equal_base_plus_adapters_in_the_model_and_the_sampler(setup):
    policy, params, adapters, seqs = setup
    lora = dict(params, **{LORA_KEY: _trained(adapters)})
    merged = merge_adapters(lora, SCALE)
    assert LORA_KEY not in merged
    ours = policy.completion_logits(lora, seqs)
    assert float(jnp.abs(ours - policy.completion_logits(params, seqs)).max()) > 0.1
    np.testing.assert_allclose(policy.completion_logits(merged, seqs), ours, atol=2e-5, rtol=0)

    sampler = Sampler(policy, max_prompt_length=6, max_completion_length=5, eos_ids=[1], pad_id=0)
    prompt, mask = seqs.tokens[:, :6], jnp.ones((2, 6), bool)
    a = sampler.generate(lora, prompt, mask, jax.random.PRNGKey(0), greedy=True)
    b = sampler.generate(merged, prompt, mask, jax.random.PRNGKey(0), greedy=True)
    base = sampler.generate(params, prompt, mask, jax.random.PRNGKey(0), greedy=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert not np.array_equal(np.asarray(a.logprobs), np.asarray(base.logprobs))
    # The slot engine applies the adapters in its decode step too: the static engine's tokens.
    slots = Sampler(policy, max_prompt_length=6, max_completion_length=5, eos_ids=[1], pad_id=0,
                    engine="slots", group_size=1, slots=2)
    c = slots.generate(lora, prompt, mask, jax.random.PRNGKey(0), greedy=True)
    np.testing.assert_array_equal(c.tokens, a.tokens)
    np.testing.assert_allclose(c.logprobs, a.logprobs, atol=1e-5, rtol=0)


def test_merge_leaves_non_targets_alone(setup):
    _, params, adapters, _ = setup
    merged = dict(leaves_with_paths(merge_adapters(dict(params, **{LORA_KEY: _trained(adapters)}), SCALE)))
    for path, value in leaves_with_paths(params):
        same = np.array_equal(np.asarray(merged[path]), np.asarray(value))
        assert same == ("_proj/kernel" not in path), path
