"""The NNX decoder on a tiny config: cache, padding, probes, remat, bf16, sharding, validation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models import Decoder, KVCache, model_from_weights, token_logprobs
from logra_jax.models.config import tiny
from logra_jax.models.llama import LAYER_LINEARS
from logra_jax.projections import SketchProbe, projection_keys
from logra_jax.sharding import make_mesh
from tolerance import assert_close_up_to_order

CONFIG = tiny()


def weights_of(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="module")
def model():
    return Decoder(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def run(model):
    """Jitted forward with the parameters as arguments (not baked-in constants)."""
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames="prefill")
    def forward(state, tokens, positions=None, segment_mask=None, probes=None, cache=None,
                prefill=False):
        return nnx.merge(graphdef, state)(tokens, positions=positions, segment_mask=segment_mask,
                                          probes=probes, cache=cache, prefill=prefill)

    run = lambda tokens, **kw: forward(state, tokens, **kw)
    run.lower = lambda tokens, **kw: forward.lower(state, tokens, **kw)
    return run


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, CONFIG.vocab_size, dtype=jnp.int32)


def test_config_validation():
    with pytest.raises(ValueError, match="num_heads .* multiple of num_kv_heads"):
        tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        tiny(head_dim=7)
    with pytest.raises(ValueError, match="dtype must be one of"):
        tiny(dtype="float16")
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        tiny(vocab_size=0)
    assert tiny().replace(remat=True).remat


def test_layout_and_stacking(model):
    kernel = model.layers.self_attn.q_proj.kernel[...]
    assert kernel.shape == (CONFIG.num_layers, CONFIG.hidden_size, CONFIG.num_heads * CONFIG.head_dim)
    assert not np.allclose(kernel[0], kernel[1])  # each layer gets its own initialisation
    assert model.head_kernel().shape == (CONFIG.hidden_size, CONFIG.vocab_size)
    tied = Decoder(tiny(tie_embeddings=True), rngs=nnx.Rngs(0))
    assert tied.lm_head is None
    np.testing.assert_array_equal(tied.head_kernel(), tied.embed_tokens.embedding[...].T)


def test_forward_shapes_and_causality(model, run, tokens):
    logits = run(tokens)
    assert logits.shape == (2, 9, CONFIG.vocab_size) and logits.dtype == jnp.float32
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % CONFIG.vocab_size)
    other = run(changed)
    np.testing.assert_allclose(other[:, :6], logits[:, :6], atol=1e-6)  # the past ignores the future
    assert not np.allclose(other[:, 6:], logits[:, 6:])

    @nnx.jit
    def hidden_path(model, tokens):
        hidden = model(tokens, return_hidden=True)
        return hidden, model.logits(hidden), token_logprobs(hidden, model.head_kernel(), tokens, chunk_size=40)

    hidden, from_hidden, (logp, entropy) = hidden_path(model, tokens)
    assert hidden.shape == (2, 9, CONFIG.hidden_size)
    np.testing.assert_allclose(from_hidden, logits, atol=1e-5)
    full = jax.nn.log_softmax(logits)
    np.testing.assert_allclose(logp, jnp.take_along_axis(full, tokens[..., None], -1)[..., 0], atol=1e-5)
    np.testing.assert_allclose(entropy, -(jnp.exp(full) * full).sum(-1), atol=1e-5)


def test_cache_prefill_then_decode_equals_full_forward(model, run, tokens):
    full = run(tokens)
    cache = model.init_cache(2, 12)
    logits, cache = run(tokens[:, :5], cache=cache)
    pieces = [logits]
    for i in range(5, 9):  # one jitted step, index traced
        step, cache = run(tokens[:, i:i + 1], cache=cache)
        pieces.append(step)
    assert int(cache.index) == 9 and cache.mask[:, :9].all() and not cache.mask[:, 9:].any()
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5)


def test_prefill_attends_to_its_own_keys_and_fills_the_cache_alike(model, run, tokens):
    """prefill=True (the sampler's prompt into an empty cache): the same logits and cache as
    attending to all S slots, and the decode after it reads the cache alike, with the scores
    t × t instead of t × S (a 512-token prompt under 2048 slots held 4× the scores before)."""
    outs = [run(tokens[:, :5], cache=model.init_cache(2, 64), prefill=p) for p in (False, True)]
    (slots, slots_cache), (own, own_cache) = outs
    np.testing.assert_allclose(own, slots, atol=1e-5)
    for a, b in zip(jax.tree.leaves(own_cache), jax.tree.leaves(slots_cache)):   # k, v: rounding
        np.testing.assert_allclose(a, b, atol=1e-5)                         # of the layers before
    step, _ = run(tokens[:, 5:6], cache=own_cache)
    np.testing.assert_allclose(step, run(tokens[:, :6])[:, 5:], atol=1e-5)
    temporaries = [run.lower(tokens[:, :5], cache=model.init_cache(2, 64), prefill=p).compile()
                   .memory_analysis().temp_size_in_bytes for p in (False, True)]
    assert temporaries[1] < temporaries[0], temporaries
    with pytest.raises(ValueError, match="prefill=True needs an empty cache, got index 5"):
        model(tokens[:, :2], cache=own_cache, prefill=True)


@pytest.mark.parametrize("tied", [False, True])
def test_per_layer_decode_reads_weights_major_kernels(tied, tokens):
    """`unstacked_layers` stores every layer's linear kernels transposed, (out, in), and tagged
    (linear.weights_major); decoding with them after a scanned prefill gives the full forward's
    logits (a Linear that ignored the tag would multiply the square q and o kernels transposed),
    and the vocabulary-major logits of a decode step are its logits transposed."""
    from logra_jax.models.linear import WEIGHTS_MAJOR
    model = Decoder(dataclasses.replace(CONFIG, tie_embeddings=tied), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    stacked = weights_of(model.layers)
    layers = model.unstacked_layers()
    assert len(layers) == CONFIG.num_layers
    for i, layer in enumerate(layers):
        for path, variable in nnx.to_flat_state(layer):
            name = "/".join(map(str, path))
            is_kernel = path[-1] == "kernel"
            assert bool(variable.get_metadata().get(WEIGHTS_MAJOR)) == is_kernel, name
            expected = stacked[name][i].T if is_kernel else stacked[name][i]
            np.testing.assert_array_equal(np.asarray(variable[...]), expected, err_msg=name)

    @functools.partial(jax.jit, static_argnames="per_layer")
    def forward(state, tokens, cache=None, per_layer=False):
        m = nnx.merge(graphdef, state)
        if not per_layer:
            return m(tokens, cache=cache)
        hidden, cache = m(tokens, cache=cache, layers=m.unstacked_layers(), return_hidden=True)
        return m.logits(hidden), m.vocab_major_logits(hidden[:, -1]), cache

    full = forward(state, tokens)
    logits, cache = forward(state, tokens[:, :5], model.init_cache(2, 12))
    cache = cache.unstacked()
    pieces = [logits]
    for i in range(5, 9):
        step, vocab_major, cache = forward(state, tokens[:, i:i + 1], cache, per_layer=True)
        np.testing.assert_allclose(vocab_major, step[:, -1].T, atol=1e-6)
        pieces.append(step)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5)


@pytest.mark.parametrize("qkv_bias, gemma", [(False, False), (True, False), (False, True)])
def test_per_layer_decode_with_one_qkv_kernel_gives_the_same_logits(qkv_bias, gemma, tokens):
    """`unstacked_layers(fuse_qkv=True)` (a GPU's per-layer decode weights) holds q, k and v's
    kernels and biases as one in q_proj, tagged, k_proj's and v_proj's empty; decoding with them,
    with live probes (LoRA adapters while sampling) on q, k and v, gives the logits of the same
    layers unfused (a split at the wrong offsets, a bias left out or a probe dropped would not);
    also with Gemma 3's per-head q and k norms and sandwich norms."""
    from logra_jax.models.llama import QKV_IN_Q_PROJ
    gemma_parts = dict(qk_norm=True, sandwich_norms=True, norm_unit_offset=True) if gemma else {}
    model = Decoder(dataclasses.replace(CONFIG, qkv_bias=qkv_bias, **gemma_parts), rngs=nnx.Rngs(0))
    if qkv_bias:   # zero at init: give the biases values, so that leaving one out shows
        attention = model.layers.self_attn
        for i, proj in enumerate((attention.q_proj, attention.k_proj, attention.v_proj)):
            proj.bias[...] = jax.random.normal(jax.random.PRNGKey(10 + i), proj.bias.shape)
    graphdef, state = nnx.split(model)
    fused = model.unstacked_layers(fuse_qkv=True)[0]["self_attn"]
    assert fused["q_proj"]["kernel"].get_metadata().get(QKV_IN_Q_PROJ)
    q_dim, kv_dim = CONFIG.num_heads * CONFIG.head_dim, CONFIG.num_kv_heads * CONFIG.head_dim
    assert fused["q_proj"]["kernel"].shape == (q_dim + 2 * kv_dim, CONFIG.hidden_size)
    assert fused["k_proj"]["kernel"].shape[0] == fused["v_proj"]["kernel"].shape[0] == 0
    probes = {path: p for path, p in _probes(model, 4, 0.5).items() if "self_attn" in path}

    @functools.partial(jax.jit, static_argnames="fuse")
    def decode(state, cache, fuse):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(tokens[:, 5:6], cache=cache, layers=m.unstacked_layers(fuse_qkv=fuse),
                      return_hidden=True, probes=probes)
        return m.logits(hidden)

    _, cache = jax.jit(lambda s, c: nnx.merge(graphdef, s)(tokens[:, :5], cache=c, probes=probes))(
        state, model.init_cache(2, 12))
    cache = cache.unstacked()
    np.testing.assert_allclose(decode(state, cache, True), decode(state, cache, False), atol=1e-5)


def test_padding_left_and_right_matches_unpadded(run, tokens):
    seq = tokens[:1, :6]
    ref = run(seq)
    # left padding by 3: positions count real tokens only; right padding by 3: mask only.
    pad = jnp.zeros((1, 3), jnp.int32)
    left = jnp.concatenate([pad, seq], 1)
    left_mask = jnp.arange(9)[None] >= 3
    left_pos = jnp.maximum(jnp.arange(9) - 3, 0)[None]
    right = jnp.concatenate([seq, pad], 1)
    right_mask = jnp.arange(9)[None] < 6
    batch = jnp.concatenate([left, right])
    out = run(batch, segment_mask=jnp.concatenate([left_mask, right_mask]),
              positions=jnp.concatenate([left_pos, jnp.arange(9)[None]]).astype(jnp.int32))
    assert np.isfinite(np.asarray(out)).all()  # padding queries are garbage but finite
    np.testing.assert_allclose(out[0, 3:], ref[0], atol=1e-5)
    np.testing.assert_allclose(out[1, :6], ref[0], atol=1e-5)


def test_left_padded_prompt_with_cache_decodes_like_unpadded(model, run, tokens):
    seq = tokens[:1, :7]
    ref = run(seq)
    prompt = jnp.concatenate([jnp.zeros((1, 2), jnp.int32), seq[:, :5]], 1)
    mask = jnp.arange(7)[None] >= 2
    positions = jnp.maximum(jnp.arange(7) - 2, 0)[None].astype(jnp.int32)
    logits, cache = run(prompt, segment_mask=mask, positions=positions, cache=model.init_cache(1, 10))
    np.testing.assert_allclose(logits[0, 2:], ref[0, :5], atol=1e-5)
    for i in (5, 6):
        step, cache = run(seq[:, i:i + 1], positions=jnp.array([[i]], jnp.int32), cache=cache)
        np.testing.assert_allclose(step[0, 0], ref[0, i], atol=1e-5)


def _probes(model, rank, scale):
    L = CONFIG.num_layers
    probes = {}
    for i, path in enumerate(LAYER_LINEARS):
        layer = model.layers
        for name in path.split("/")[1:-1]:
            layer = getattr(layer, name)
        factor = scale * jax.random.normal(jax.random.PRNGKey(i), (L, layer.out_features, rank))
        probes[path] = SketchProbe(key=projection_keys(42, path, 0, (L,)), factor=factor)
    return probes


def test_zero_probes_leave_logits_unchanged_and_live_probes_do_not(model, run, tokens):
    ref = run(tokens)
    np.testing.assert_allclose(run(tokens, probes=_probes(model, 4, 0.0)), ref, atol=1e-6)
    assert not np.allclose(run(tokens, probes=_probes(model, 4, 0.5)), ref, atol=1e-3)


def test_probe_gradient_is_the_per_layer_sketch(model, tokens):
    """∂L/∂B_l = G_l·A_lᵀ for every stacked layer l: the decoder hands layer l its own probe slice."""
    path = "layers/mlp/down_proj/kernel"
    rank, L = 3, CONFIG.num_layers
    graphdef, params = nnx.split(model)

    def loss(params, probes=None):
        logits = nnx.merge(graphdef, params)(tokens, probes=probes)
        return jnp.sum(jnp.sin(logits))

    dense = jax.jit(jax.grad(loss))(params)["layers"]["mlp"]["down_proj"]["kernel"][...]  # (L, in, out)
    keys = projection_keys(7, path, 3, (L,))
    factor = jnp.zeros((L, CONFIG.hidden_size, rank))
    sketch = jax.jit(jax.grad(lambda f: loss(params, {path: SketchProbe(keys, f)})))(factor)
    for l in range(L):
        a = SketchProbe(keys[l], factor[l]).projection(CONFIG.intermediate_size)  # (r, in)
        np.testing.assert_allclose(sketch[l], dense[l].T @ a.T, rtol=1e-4, atol=1e-5)


def test_zero_factor_probes_match_the_general_probe_branch_and_cost_less(model, tokens):
    """Probes that promise B = 0 (as make_probes builds them) skip the zero branch exactly.

    Same logits, same sketches ∂L/∂B, same gradient of a non-target weight (through ∂L/∂x), and
    the same forward-mode change of the logits in a direction dB = U (the predicted-KL JVP) as the
    general branch x·kernel + (x·Aᵀ)·Bᵀ — with fewer operations in the compiled gradient.
    """
    graphdef, embed, rest = nnx.split(model, nnx.PathContains("embed_tokens"), ...)
    general = _probes(model, 4, 0.0)
    fast = {path: dataclasses.replace(p, factor_is_zero=True) for path, p in general.items()}
    factors = {path: p.factor for path, p in general.items()}

    def logits(embed, factors, probes):
        probes = {path: dataclasses.replace(p, factor=factors[path]) for path, p in probes.items()}
        return nnx.merge(graphdef, embed, rest)(tokens, probes=probes)

    def loss(embed, factors, probes):
        return jnp.sum(jnp.sin(logits(embed, factors, probes)))

    # The two branches are two programs: XLA fuses and orders their sums differently (under
    # XLA:CPU's elemental emitters they differ in the last bits), so they agree up to what
    # reordering every sum a value passes through may change (tests/tolerance.py). Forward, per
    # layer: the norm, the q/k/v products with the probe's (x·Aᵀ)·Bᵀ, q·k, the softmax and
    # weights·V over the sequence, the output product, the second norm, gate/up and down; then
    # the final norm and the head. Backward: the head's transpose, each layer's in reverse, and
    # the sum over the batch's tokens.
    c, seq, rank = CONFIG, tokens.shape[1], 4
    forward = (c.hidden_size, c.hidden_size, rank, c.head_dim, seq, seq,
               c.num_heads * c.head_dim, c.hidden_size, c.hidden_size, c.intermediate_size)
    logits_chain = forward * c.num_layers + (c.hidden_size, c.hidden_size)
    grad_chain = (logits_chain + (c.vocab_size,) + forward[::-1] * c.num_layers
                  + (c.intermediate_size, tokens.size))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    ref, got = grad(embed, factors, general), grad(embed, factors, fast)
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        assert_close_up_to_order(g, r, grad_chain)
    assert all(float(jnp.max(jnp.abs(s))) > 0 for s in got[1].values())

    direction = {path: jax.random.normal(jax.random.PRNGKey(i), f.shape) for i, (path, f) in
                 enumerate(factors.items())}
    jvp = jax.jit(lambda d, probes: jax.jvp(lambda f: logits(embed, f, probes), (factors,), (d,)))
    (ref_y, ref_dy), (y, dy) = jvp(direction, general), jvp(direction, fast)
    assert_close_up_to_order(y, ref_y, logits_chain)
    assert_close_up_to_order(dy, ref_dy, logits_chain)
    assert float(jnp.max(jnp.abs(dy))) > 1e-3

    def flops(probes):
        return grad.lower(embed, factors, probes).compile().cost_analysis()["flops"]
    assert flops(fast) < flops(general)



def test_the_sketched_backward_forms_no_dense_weight_gradient(model, tokens):
    """LoGRA's gradient (the targets closed over, ∂L/∂B from zero-factor probes) performs exactly
    the dense gradient's matrix products minus every target's weight gradient, 2·T·in·out, plus
    its sketch, x·Aᵀ and (x·Aᵀ)ᵀH: 2·T·r·(in + out). Counted in the compiled programs with every
    iteration of the layer scan (matmul_count), so a dense gradient formed anywhere shows."""
    from logra_jax.perf import matmul_count
    rank, L, T = 4, CONFIG.num_layers, tokens.size
    probes = {path: dataclasses.replace(p, factor_is_zero=True)
              for path, p in _probes(model, rank, 0.0).items()}
    factors = {path: p.factor for path, p in probes.items()}
    is_target = lambda path, _: "/".join(map(str, path)) in probes
    graphdef, targets, others = nnx.split(model, is_target, ...)

    def loss(targets, others, factors):
        live = {path: dataclasses.replace(p, factor=factors[path]) for path, p in probes.items()}
        return jnp.sum(jnp.sin(nnx.merge(graphdef, targets, others)(tokens, probes=live)))

    def count(argnums):
        compiled = jax.jit(jax.grad(loss, argnums)).lower(targets, others, factors).compile()
        return matmul_count.of_compiled(compiled).flops
    shapes = [(_in_features(model, path), p.factor.shape[1]) for path, p in probes.items()]
    dense_grads = sum(2 * L * T * d_in * d_out for d_in, d_out in shapes)
    sketches = sum(2 * L * T * rank * (d_in + d_out) for d_in, d_out in shapes)
    assert count((0, 1)) - count((1, 2)) == dense_grads - sketches


def _in_features(model, path):
    layer = model.layers
    for name in path.split("/")[1:-1]:
        layer = getattr(layer, name)
    return layer.in_features


@pytest.mark.parametrize("factor_is_zero", [True, False])
def test_the_sketch_is_formed_r_by_out_and_transposed_after(factor_is_zero):
    """XLA:CPU runs Hᵀ(x·Aᵀ) written out × r up to 3× slower than (x·Aᵀ)ᵀH written r × out
    (models/linear.py: times_factor_t), and the latter faster again as a canonical product over
    (x·Aᵀ)ᵀ stored r × T (sketch_tangent, the B = 0 branch). The compiled backward of both probe
    branches must hold the r × out product and no out × r one; the sketch still equals G·Aᵀ."""
    import re

    from logra_jax.models.linear import Linear

    tokens, d_in, d_out, rank = 64, 48, 40, 8
    layer = Linear(d_in, d_out, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (tokens, d_in))
    h = jax.random.normal(jax.random.PRNGKey(2), (tokens, d_out))    # ∂L/∂y
    keys = projection_keys(3, "w", 0, ())

    def loss(factor):
        probe = SketchProbe(keys, factor, factor_is_zero=factor_is_zero)
        return jnp.sum(layer(x, probe) * h)

    grad = jax.jit(jax.grad(loss))
    factor = jnp.zeros((d_out, rank))
    a = SketchProbe(keys, factor).projection(d_in)
    np.testing.assert_allclose(grad(factor), h.T @ (x @ a.T), rtol=1e-5, atol=1e-5)
    dots = re.findall(r"= f32\[(\d+),(\d+)\]\{1,0\} dot\(.*?lhs_contracting_dims=\{(\d)\}, "
                      r"rhs_contracting_dims=\{(\d)\}", grad.lower(factor).compile().as_text())
    shapes = {(int(m), int(n)): (int(lc), int(rc)) for m, n, lc, rc in dots}
    assert (rank, d_out) in shapes and (d_out, rank) not in shapes, shapes
    if factor_is_zero:
        # models/linear.py: sketch_tangent — (x·Aᵀ)ᵀ stored r × T, so the product is canonical
        # (left operand contracted over its last dim), the form XLA:CPU gives to YNNPACK.
        assert shapes[(rank, d_out)] == (1, 0), shapes

def _transposed_copies(hlo: str, elements: int) -> list[str]:
    """The loop fusions of compiled ``hlo`` that write an array of ``elements`` entries through a
    transpose: the copies XLA:CPU inserts when an operand's layout is not the one a product or
    reduction wants."""
    import re
    bodies = {m.group(1): m.group(2) for m in re.finditer(r"\n%?([\w.-]+) [^\n]*\{\n(.*?)\n\}", hlo,
                                                          re.S)}
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]+)\]\S* fusion\(.*kind=kLoop, calls=%?([\w.-]+)", line)
        if m and np.prod([int(d) for d in m.group(1).split(",")]) == elements \
                and " transpose(" in bodies.get(m.group(2), ""):
            found.append(line.strip()[:160])
    return found


def test_attention_writes_no_transposed_copy_of_the_scores():
    """Attention multiplies K as [b, kv_heads, d, S] and V as [b, kv_heads, S, d] (the cache's
    layouts) with and without a cache. With K and V as the projections' [b, S, kv_heads, d],
    XLA:CPU laid the scores out as [b, kv_heads, S, (t, group)] and wrote a transposed copy of
    the b·H·t·S scores around the products: twice in the forward, four times more in the
    recomputed forward and backward (docs/results/step_time.md). The forward must write none; the
    backward at most one (the softmax gradient's, which XLA lays out on its own)."""
    config = tiny(num_layers=1, remat=True)
    model = Decoder(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, config.vocab_size, dtype=jnp.int32)
    scores = tokens.shape[0] * config.num_heads * tokens.shape[1] ** 2

    def loss(state):
        return jnp.sum(jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens))[..., 0])

    forward = jax.jit(loss).lower(state).compile().as_text()
    backward = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
    assert not _transposed_copies(forward, scores), _transposed_copies(forward, scores)
    assert len(_transposed_copies(backward, scores)) <= 1, _transposed_copies(backward, scores)


def test_probe_validation(model, tokens):
    L = CONFIG.num_layers
    keys = np.zeros((L, 2), np.uint32)
    up = SketchProbe(keys, np.zeros((L, CONFIG.intermediate_size, 2), np.float32))
    with pytest.raises(ValueError, match="not a stacked linear kernel"):
        model(tokens, probes={"lm_head/kernel": up})
    with pytest.raises(ValueError, match=r"factor must have shape \(layers, out, rank\)"):
        model(tokens, probes={"layers/mlp/down_proj/kernel": up})
    with pytest.raises(ValueError, match="must be a SketchProbe"):
        model(tokens, probes={"layers/mlp/up_proj/kernel": up.factor})


def test_remat_and_bf16_variants(model, run, tokens):
    weights = weights_of(model)
    value_and_grad = nnx.jit(nnx.value_and_grad(lambda m: jnp.mean(m(tokens) ** 2)))
    ref_value, ref_grads = value_and_grad(model)
    remat = model_from_weights(CONFIG.replace(remat=True), weights)
    value, grads = value_and_grad(remat)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for (p, g), (_, r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        np.testing.assert_allclose(g[...], r[...], rtol=1e-4, atol=1e-7, err_msg="/".join(map(str, p)))
    bf16 = model_from_weights(CONFIG.replace(dtype="bfloat16"), weights)
    assert bf16.layers.mlp.up_proj.kernel[...].dtype == jnp.float32  # fp32 master weights
    logits = nnx.jit(lambda m: m(tokens))(bf16)
    assert logits.dtype == jnp.float32
    # bf16 activations against fp32's: measured 2.5e-3 at most (logits up to 0.41, XLA:CPU); a
    # difference of 0 would mean the bf16 config computed in fp32.
    gap = float(np.abs(np.asarray(logits) - np.asarray(run(tokens))).max())
    assert 5e-4 < gap < 1e-2, gap
    cache = bf16.init_cache(2, 4)
    assert cache.k.dtype == jnp.bfloat16


@pytest.mark.parametrize("mesh_shape", [(8, 1), (4, 2), (2, 4)])
def test_sharded_logits_equal_unsharded(model, run, tokens, mesh_shape):
    mesh = make_mesh({"fsdp": mesh_shape[0], "tensor": mesh_shape[1]})
    sharded = model_from_weights(CONFIG, weights_of(model), mesh=mesh)
    kernel = sharded.layers.self_attn.q_proj.kernel[...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    graphdef, state = nnx.split(sharded)
    batch = jnp.concatenate([tokens] * 4)  # 8 rows: divisible by every fsdp size
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, batch)
    np.testing.assert_allclose(logits, jnp.concatenate([run(tokens)] * 4), atol=2e-5)


def test_input_and_cache_errors(model, tokens):
    with pytest.raises(ValueError, match=r"tokens must be \[batch, time\]"):
        model(tokens[0])
    with pytest.raises(ValueError, match="segment_mask shape"):
        model(tokens, segment_mask=jnp.ones((2, 3), bool))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.init_cache(1, CONFIG.max_position_embeddings + 1)
    cache = model.init_cache(2, 8)
    with pytest.raises(ValueError, match="do not fit a cache of 8 slots"):
        model(tokens, cache=cache)
    with pytest.raises(ValueError, match=r"cache overflow: index 6 \+ 3 tokens > 8"):
        model(tokens[:, :3], cache=dataclasses.replace(cache, index=jnp.int32(6)))
    with pytest.raises(ValueError, match="cache batch"):
        model(tokens[:1, :2], cache=cache)
    with pytest.raises(ValueError, match="needs a ModelConfig"):
        Decoder({"vocab_size": 3}, rngs=nnx.Rngs(0))
    # The overflow check's boundary: a chunk that exactly fills the cache is accepted.
    _, full = model(tokens[:, :3], cache=dataclasses.replace(cache, index=jnp.int32(5)))
    assert isinstance(full, KVCache) and int(full.index) == 8


def test_model_from_weights_errors(model):
    weights = weights_of(model)
    missing = {k: v for k, v in weights.items() if k != "norm/scale"}
    with pytest.raises(ValueError, match="lack parameter 'norm/scale'"):
        model_from_weights(CONFIG, missing)
    bad = dict(weights, **{"layers/mlp/up_proj/kernel": weights["layers/mlp/up_proj/kernel"][:, :, :3]})
    with pytest.raises(ValueError, match="'layers/mlp/up_proj/kernel' has shape"):
        model_from_weights(CONFIG, bad)
    with pytest.raises(ValueError, match="names the model does not have"):
        model_from_weights(CONFIG, dict(weights, extra=np.zeros(3)))
