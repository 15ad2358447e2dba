"""A GPU decode step's kernels (models/decode_kernels.py), run on this CPU by Pallas' interpreter:
each computes its layer's numbers, and a decoder's steps with them compute the decoder's."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models import Decoder, decode_kernels, llama
from logra_jax.models.config import tiny
from logra_jax.models.rope import apply_rotary, inverse_frequencies, rotary_cos_sin
from logra_jax.projections import SketchProbe, projection_keys
from tolerance import assert_close_up_to_order

def as_f32(a):
    return np.asarray(a, np.float32)


def _attention_inputs(slots: int, slot: int, dtype=jnp.bfloat16):
    """A step of 3 rows, 6 query heads over 2 key/value heads of 16 dims, ``slots`` slots; row 1
    has every slot masked (a finished row's padding step)."""
    b, heads, kv_heads, d = 3, 6, 2, 16
    keys = jax.random.split(jax.random.PRNGKey(0), 7)
    qkv = jax.random.normal(keys[0], (b, (heads + 2 * kv_heads) * d)).astype(dtype)
    bias = (0.5 * jax.random.normal(keys[1], (qkv.shape[1],))).astype(dtype)
    cache_k = jax.random.normal(keys[2], (b, kv_heads, d, slots)).astype(dtype)
    cache_v = jax.random.normal(keys[3], (b, kv_heads, slots, d)).astype(dtype)
    positions = jnp.array([[slot], [4], [slot - 1]], jnp.int32)
    cos, sin = rotary_cos_sin(positions, inverse_frequencies(d, 10000.0), dtype)
    mask = (jnp.arange(slots)[None] <= slot) & (jax.random.uniform(keys[4], (b, slots)) > 0.3)
    mask = mask.at[:, min(slot, slots - 1)].set(True).at[1].set(False)
    return dict(qkv=qkv, bias=bias, cache_k=cache_k, cache_v=cache_v, cos=cos, sin=sin, mask=mask,
                heads=heads)


def _layers_attention(x, slot):
    """What Attention computes from the same inputs (llama.py's own functions)."""
    b, heads, (kv_heads, d) = x["qkv"].shape[0], x["heads"], x["cache_k"].shape[1:3]
    qkv = x["qkv"] + x["bias"]
    q, k, v = jnp.split(qkv, (heads * d, (heads + kv_heads) * d), axis=-1)
    q = apply_rotary(q.reshape(b, 1, heads, d), x["cos"], x["sin"])
    k = apply_rotary(k.reshape(b, 1, kv_heads, d), x["cos"], x["sin"])
    cache = llama.write_kv((x["cache_k"], x["cache_v"]), k.transpose(0, 2, 3, 1),
                           v.reshape(b, 1, kv_heads, d).swapaxes(1, 2), slot)
    out = llama.grouped_query_attention(q, *cache, x["mask"][:, None])
    return out.reshape(b, heads, d), cache


def _kernels_attention(x, slot):
    return jax.jit(functools.partial(decode_kernels.decode_attention, heads=x["heads"]))(
        x["qkv"], x["cos"][:, 0], x["sin"][:, 0], x["cache_k"], x["cache_v"], x["mask"],
        jnp.int32(slot), bias=x["bias"])


# bf16: XLA:CPU may keep an fp32 intermediate unrounded where the program rounds it to bf16 (its
# excess precision), differently in the interpreted kernel and the layer's ops; one bf16 step at
# the scale of the operands (|x| < 4) bounds that. fp32: the same numbers up to summing order.
TOLERANCE = {jnp.bfloat16: dict(rtol=2.0 ** -7, atol=2.0 ** -6), jnp.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("slots, slot", [(300, 260), (40, 45)])
def test_attention_writes_the_slot_and_attends_as_the_layer_does(slots, slot, dtype):
    """300 slots: two whole blocks of 128 and a part; groups of 3 query heads; a bias; a row with
    every slot masked. The cache after the step is the layer's (k rotated, both at the slot), the
    output the layer's (whose softmax weights are rounded to the cache's dtype before they
    multiply V, which the kernel's are not). Slot 45 of 40: a chunked decode's steps after the
    last draw write past the cache, to its last slot as `jax.lax.dynamic_update_slice` clamps,
    never outside the buffer."""
    x = _attention_inputs(slots, slot, dtype)
    out, cache_k, cache_v = _kernels_attention(x, slot)
    want, (want_k, want_v) = _layers_attention(x, slot)
    exact = dict(rtol=0, atol=0) if dtype == jnp.float32 else TOLERANCE[dtype]
    np.testing.assert_allclose(as_f32(cache_k), as_f32(want_k), **exact)
    np.testing.assert_allclose(as_f32(cache_v), as_f32(want_v), **exact)
    np.testing.assert_allclose(as_f32(out), as_f32(want), **TOLERANCE[dtype])


@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_in_one_kernel_is_the_layers_norm(unit_offset):
    """A width of 1,100 (a whole block of 1,024 and a part), in fp32, with the residual sum."""
    norm = llama.RMSNorm(1100, eps=1e-6, dtype=jnp.float32, param_dtype=jnp.float32,
                         unit_offset=unit_offset)
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    norm.scale[...] = 0.3 * jax.random.normal(keys[0], (1100,)) + (0 if unit_offset else 1)
    x, residual = (jax.random.normal(k, (2, 1, 1100)) for k in keys[1:])
    # The kernel sums the 1,100 squares in another order than XLA's reduction.
    assert_close_up_to_order(norm.in_one_kernel(x), norm(x), (1100,))
    h, normed = norm.in_one_kernel(x, residual=residual)
    np.testing.assert_array_equal(h, x + residual)
    assert_close_up_to_order(normed, norm(x + residual), (1100,))


def _probes(model, rank=4):
    """Live probes (random factors, as LoRA adapters are while sampling) on q, k and v."""
    out = {}
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        path = f"layers/self_attn/{name}/kernel"
        out_features = getattr(model.layers.self_attn, name).out_features
        factor = 0.5 * jax.random.normal(jax.random.PRNGKey(20 + i),
                                         (model.config.num_layers, out_features, rank))
        out[path] = SketchProbe(key=projection_keys(42, path, 0, (model.config.num_layers,)),
                                factor=factor)
    return out



def _tiny_with_qkv_biases():
    """(config, model): the tiny decoder with Qwen's q, k and v biases, each random (a bias the
    kernels drop or add twice changes every value)."""
    config = dataclasses.replace(tiny(), qkv_bias=True)
    model = Decoder(config, rngs=nnx.Rngs(0))
    attention = model.layers.self_attn
    for i, proj in enumerate((attention.q_proj, attention.k_proj, attention.v_proj)):
        proj.bias[...] = jax.random.normal(jax.random.PRNGKey(10 + i), proj.bias.shape)
    return config, model


@pytest.mark.parametrize("probes", [False, True])
def test_decode_steps_with_the_kernels_give_the_layers_logits(probes):
    """Three decode steps of two left-padded rows (the second masked in the last step, as a
    finished row is), Qwen's q, k and v biases, per-layer weights with q, k and v as one: with
    the kernels, the logits and the cache of the same steps without them. With probes on q, k
    and v (LoRA while sampling) the biases come with the projections; without, the attention
    kernel adds them."""
    config, model = _tiny_with_qkv_biases()
    graphdef, state = nnx.split(model)
    adapters = _probes(model) if probes else None
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 8), 0, config.vocab_size)
    prompt_mask = jnp.arange(5)[None] >= jnp.array([[0], [2]])
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0).astype(jnp.int32)

    @functools.partial(jax.jit, static_argnames="kernels")
    def decode(state, kernels):
        m = nnx.merge(graphdef, state)
        _, cache = m(tokens[:, :5], positions=positions, segment_mask=prompt_mask,
                     cache=m.init_cache(2, 9), probes=adapters, prefill=True)
        cache, layers = cache.unstacked(), m.unstacked_layers(fuse_qkv=True)
        steps = []
        for i in range(3):
            valid = jnp.array([True, i < 2])
            logits, cache = m(tokens[:, 5 + i:6 + i], positions=positions[:, -1:] + 1 + i,
                              segment_mask=valid[:, None], cache=cache, layers=layers,
                              probes=adapters, kernels=kernels)
            steps.append(logits)
        return jnp.concatenate(steps, axis=1), cache

    logits, cache = decode(state, True)
    want_logits, want_cache = decode(state, False)
    # The same fp32 arithmetic up to the order of its sums (the kernels' attention sums its
    # slots block by block, their norm its squares in one pass). Every value, a cache entry of
    # the last layer or a logit, lies at the end of at most this chain of sums: per layer the
    # norm, the q/k/v product, q·k, the softmax's sum and weights·V over the slots, the output
    # product, the second norm, gate/up and down; then the final norm and the head.
    c, slots = config, 5 + 3
    per_layer = (c.hidden_size, c.hidden_size, c.head_dim, slots, slots, c.num_heads * c.head_dim,
                 c.hidden_size, c.hidden_size, c.intermediate_size)
    chain = per_layer * c.num_layers + (c.hidden_size, c.hidden_size)
    assert_close_up_to_order(logits, want_logits, chain)
    for got, want in zip(jax.tree.leaves((cache.k, cache.v)), jax.tree.leaves((want_cache.k, want_cache.v))):
        assert_close_up_to_order(got, want, chain)


def test_kernels_refuse_a_model_they_do_not_fit():
    """Gemma 3's per-head q and k norms sit between the projection and the rotation."""
    config = dataclasses.replace(tiny(), qk_norm=True)
    assert not decode_kernels.fits(config) and decode_kernels.fits(tiny())
    model = Decoder(config, rngs=nnx.Rngs(0))
    cache = model.init_cache(1, 4).unstacked()
    with pytest.raises(ValueError, match="kernels=True"):
        model(jnp.zeros((1, 1), jnp.int32), cache=cache, layers=model.unstacked_layers(),
              kernels=True)


def test_the_slot_engine_with_the_kernels_draws_the_same_tokens():
    """The slot engine (`slots.generate_in_slots`) with each step's norms and attention as the
    kernels (`segmented_decode_attention`: rotations, the completion write and both segments'
    attention; per-layer weights with q, k and v as one, Qwen's biases added in the kernel)
    against XLA's ops: 4 groups of 2 rows through 4 slots, refilled as rows end. The same
    tokens, and log-probs to the chain of sums each passes through."""
    from logra_jax.rl.sampler import pad_prompts
    from logra_jax.rl.sampler.slots import generate_in_slots
    config, model = _tiny_with_qkv_biases()
    graphdef, state = nnx.split(model)
    prompts = [[5, 6, 7], [9, 10, 11, 12], [3], [40, 41]]
    tokens, mask = pad_prompts([p for p in prompts for _ in range(2)], 6, 0)
    columns = 12
    limits = jnp.array([1, 12, 5, 9, 12, 2, 7, 12], jnp.int32)   # rows end far apart

    @functools.partial(jax.jit, static_argnames="kernels")
    def sample(state, kernels):
        m = nnx.merge(graphdef, state)
        return generate_in_slots(
            m, {}, tokens, mask, jax.random.key(3), jnp.float32(1.0), group_size=2, slots=4,
            prompt_slots=4, max_completion_length=columns, eos_ids=(2,), pad_id=0, top_k=0,
            top_p=1.0, greedy=False, limits=limits,
            layers=m.unstacked_layers(fuse_qkv=kernels), kernels=kernels)

    got, want = sample(state, True), sample(state, False)
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.token_steps, want.token_steps)
    c, keys = config, 6 + columns
    per_layer = (c.hidden_size, c.hidden_size, c.head_dim, keys, keys, c.num_heads * c.head_dim,
                 c.hidden_size, c.hidden_size, c.intermediate_size)
    chain = per_layer * c.num_layers + (c.hidden_size, c.hidden_size, c.vocab_size)
    assert_close_up_to_order(got.logprobs, want.logprobs, chain)
