"""Our decoder family (SmolLM2, Llama 3.1, Qwen2, Qwen3, Gemma 3) in Flax NNX, with a scanned layer stack.

    Llama / Qwen:   h   = x + Attn(RMSNorm(x))             out = h + MLP(RMSNorm(h))
    Gemma 3:        h   = x + RMSNorm(Attn(RMSNorm(x)))    out = h + RMSNorm(MLP(RMSNorm(h)))
    Attn: RoPE (rope.py), grouped-query heads, causal + padding mask; Qwen3/Gemma 3 RMS-normalise
          every query and key head first; Gemma 3's "sliding" layers see only the last W tokens.
    MLP(x) = down(act(gate(x)) ⊙ up(x))       act = silu (SwiGLU) or tanh-GELU (Gemma's GeGLU)
    logits = RMSNorm(x_L) · W_head            W_head = embeddingᵀ when tied

All per-layer parameters are stacked along a leading layer axis (``layers/self_attn/q_proj/kernel``
has shape (L, in, out)) and the layer body runs under ``jax.lax.scan``, so compile time does not grow
with depth. A layer's type (full or sliding) is a scanned boolean that picks its mask and RoPE
frequencies, so mixed stacks still scan. Parameter names follow Hugging Face (``embed_tokens``,
``self_attn.q_proj``, ``pre_feedforward_layernorm`` ...) with Flax leaf names (``kernel`` (in, out),
``bias``, ``embedding``, ``scale``). A decode loop may instead pass ``layers=`` (the stack split
once into per-layer arrays, `Decoder.unstacked_layers`) with a per-layer cache: the same layers,
run one after the other, each reading its own arrays in place (what the sampler does on CPU).

The KV cache holds every slot for every layer, sliding ones included: one cache stack of one
shape is what lets the layers scan. A window-sized ring buffer for Gemma's sliding layers would
need a second stack and a scan over (5 local + 1 global) groups; at Gemma-3-27B with 2048-token
rollouts and a 1024-token window it would save 52/62 · ½ of the KV cache. Not done yet.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from logra_jax.models import decode_kernels
from logra_jax.models.config import ModelConfig
from logra_jax.models.kv_cache import KVCache
from logra_jax.models.kv_segments import SegmentKV, segmented_attention
from logra_jax.models.linear import Linear, weights_major, weights_major_product
from logra_jax.models.rope import apply_rotary, inverse_frequencies, rotary_cos_sin
from logra_jax.projections import SketchProbe
from jax.sharding import PartitionSpec

from logra_jax.sharding import (BATCH_AXIS, get_logical_axes, set_logical_axes, shard_batch,
                                shard_features)

# The stacked linear layers a SketchProbe may target, by kernel path, and their in/out logical axes.
LAYER_LINEARS: dict[str, tuple[str, str]] = {
    "layers/self_attn/q_proj/kernel": ("embed", "heads"),
    "layers/self_attn/k_proj/kernel": ("embed", "kv_heads"),
    "layers/self_attn/v_proj/kernel": ("embed", "kv_heads"),
    "layers/self_attn/o_proj/kernel": ("heads", "embed"),
    "layers/mlp/gate_proj/kernel": ("embed", "mlp"),
    "layers/mlp/up_proj/kernel": ("embed", "mlp"),
    "layers/mlp/down_proj/kernel": ("mlp", "embed"),
}

_INIT_STD = 0.02  # Hugging Face's initializer_range for Llama/Qwen2


def _linear(in_features: int, out_features: int, axes: tuple[str, str], config: ModelConfig, *,
            use_bias: bool = False, rngs: nnx.Rngs) -> Linear:
    layer = Linear(in_features, out_features, use_bias=use_bias, kernel_axes=axes,
                   dtype=config.compute_dtype, param_dtype=config.weight_dtype,
                   kernel_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)
    set_logical_axes(layer.kernel, axes)
    if layer.bias is not None:
        set_logical_axes(layer.bias, (axes[1],))
    return layer


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x²) + ε) ⊙ scale, normalised in fp32 and cast back (as Hugging Face does).

    With ``unit_offset`` (Gemma) the stored weight w is zero-centred: y = x̂ ⊙ (1 + w), multiplied
    in fp32 before the cast, as Gemma's reference does.
    """

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype, unit_offset: bool = False):
        self.eps = eps
        self.dtype = dtype
        self.unit_offset = unit_offset
        self.scale = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((dim,), param_dtype))
        set_logical_axes(self.scale, ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(self.dtype)
        return self.scale[...].astype(self.dtype) * normed.astype(self.dtype)

    def in_one_kernel(self, x: jax.Array, residual: jax.Array | None = None):
        """This norm of a decode step's rows x [b, 1, d] as one GPU kernel
        (`decode_kernels.rms_norm`); with ``residual``, (x + residual, its norm) in that kernel."""
        rows = lambda a: a.reshape(a.shape[0], -1)
        out = decode_kernels.rms_norm(rows(x), self.scale[...], eps=self.eps,
                                      unit_offset=self.unit_offset,
                                      residual=None if residual is None else rows(residual))
        return jax.tree.map(lambda a: a.reshape(x.shape), out)


def _norm(dim: int, config: ModelConfig) -> RMSNorm:
    return RMSNorm(dim, eps=config.rms_norm_eps, dtype=config.compute_dtype,
                   param_dtype=config.weight_dtype, unit_offset=config.norm_unit_offset)


class Embedding(nnx.Module):
    """Token embedding table (vocab, d); also the output head when embeddings are tied."""

    def __init__(self, vocab_size: int, dim: int, *, dtype, param_dtype, rngs: nnx.Rngs,
                 scale: bool = False):
        self.dtype = dtype
        self.embedding = nnx.Param(
            nnx.initializers.normal(_INIT_STD)(rngs.params(), (vocab_size, dim), param_dtype))
        set_logical_axes(self.embedding, ("vocab", "embed"))
        # Gemma multiplies by √d rounded to the weights' dtype (√3072 is 55.5 in bf16), as its
        # reference does; the head (tied) uses the table unscaled.
        self.multiplier = float(np.asarray(math.sqrt(dim), param_dtype)) if scale else None

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)
        return x if self.multiplier is None else x * jnp.asarray(self.multiplier, self.dtype)


# A GPU decode step multiplies the attention weights by V as a matrix product once the layer's
# K and V cache (all rows) exceeds this many bytes, as a broadcast multiply and sum below
# (`grouped_query_attention`; q·K is a product either way).
GPU_DECODE_PRODUCTS_BYTES = 8 * 2**20


def grouped_query_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                            scale: float | None = None) -> jax.Array:
    """softmax(q·kᵀ·scale + mask)·v where query head h reads key/value head h // (H / KV).

    q: [b, t, H, d]; k: [b, KV, d, S] and v: [b, KV, S, d], the KV cache's layouts (KVCache),
    in which both products are canonical batched products (batch dims first, then free, then
    contracted) that XLA:CPU runs without transposing k, v or the scores; mask: bool [b, t, S]
    (True = may attend); scale defaults to 1/√d. With k and v as [b, S, KV, d] (the
    projections' own layout) XLA:CPU laid the scores out as [b, KV, S, (t, group)] and wrote a
    transposed copy of them, and of q with the group dim innermost, around every product, in the
    forward, the recomputed forward and the backward (docs/results/step_time.md).
    With one query per row (a decode step) the products, ~10⁶ operations each, are a broadcast
    multiply and a sum instead: XLA:CPU's matmul kernels cost more per call than that (SmolLM2's
    30 layers at batch 16: 7.9 vs 9.6 ms over 96 cache slots, 36 vs 64 ms over 512).
    Scores and softmax are fp32. A fully masked row (a padding query) gets uniform weights rather
    than NaN: its output is garbage but finite, and callers mask it out of every loss.
    """
    b, t, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    q = q.reshape(b, t, num_kv, num_heads // num_kv, head_dim).transpose(0, 2, 3, 1, 4)

    def products(q, k, v, mask, scores_as_sum, outputs_as_sum):
        if scores_as_sum:   # a decode step on XLA:CPU (see above) or a TPU
            scores = jnp.sum(q[..., None].astype(jnp.float32) * k[:, :, None, None], axis=-2)
        else:
            scores = jnp.einsum("bkgtd,bkds->bkgts", q, k, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(head_dim) if scale is None else scores * scale
        scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        if outputs_as_sum:
            return jnp.sum(weights[..., None].astype(jnp.float32) * v[:, :, None, None],
                           axis=-2).astype(v.dtype)
        return jnp.einsum("bkgts,bksd->bkgtd", weights, v)

    if t == 1:
        # XLA:GPU runs q·K as one Triton GEMM that reads K as the cache lays it out; as a
        # multiply-sum, it wrote an f32 copy of K transposed to [S, d] first, one kernel and
        # 1.6 times K's bytes more (Qwen2.5-1.5B's layer at batch 1, 1,024 slots: 3 kernels and
        # 3.3 MB for attention, 2 and 1.2 MB with the product). weights·V as a multiply-sum is
        # one reduction fused with the softmax, while the product is a split-K Triton GEMM and a
        # sum of its parts, two kernels more, which read V less once the cache is large: there
        # the product (16 MiB of K and V at 4 rows × 4,096 slots: 54 vs 20 MB).
        small = k.size * k.dtype.itemsize + v.size * v.dtype.itemsize <= GPU_DECODE_PRODUCTS_BYTES
        on_gpu = functools.partial(products, scores_as_sum=False, outputs_as_sum=small)
        out = jax.lax.platform_dependent(q, k, v, mask, cuda=on_gpu, rocm=on_gpu, default=functools.partial(
            products, scores_as_sum=True, outputs_as_sum=True))
    else:
        out = products(q, k, v, mask, scores_as_sum=False, outputs_as_sum=False)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, num_heads, head_dim)


def split_output_product(project, x: jax.Array) -> jax.Array:
    """``project(x)`` for a decode step's few rows ``x`` [rows, …] and a weight split along its
    output (o_proj and down_proj: ``embed`` over ``fsdp``), on the GPUs of the mesh in context:
    every row goes to every GPU, each multiplies them by its own columns of the weight, and the
    products return to their rows' GPUs, so rows × out numbers move instead of the weight. Each
    output is the same sum over the whole input dimension as with the weight gathered. Gathering
    such a weight, XLA:GPU's all-gather wants the gathered dimension major, and it laid the
    whole stack out transposed for it, a copy held through the call (Gemma-3-27B on 8 H100s:
    2.0 GiB of `generate`'s temporaries). As ``project(x)`` elsewhere (XLA:CPU, a TPU) and
    without an ``fsdp`` axis > 1."""
    if not _on_gpu_fsdp(jax.sharding.get_abstract_mesh()):
        return project(x)
    y = project(jax.lax.with_sharding_constraint(x, PartitionSpec()))
    y = jax.lax.with_sharding_constraint(y, PartitionSpec(*(None,) * (y.ndim - 1), BATCH_AXIS))
    return shard_batch(y)


def gathered_by_output_blocks(kernel: jax.Array) -> jax.Array:
    """A prefill's o_proj or down_proj ``kernel`` [in, out], split along out over ``fsdp``,
    gathered whole on every GPU of the mesh in context as F blocks of out / F columns: each GPU's
    block is a contiguous piece of the gathered [in, F, out / F] array's second dimension. Gathered
    along out itself, XLA:GPU's all-gather wants the gathered dimension major, and XLA laid the
    whole layer stack out transposed for it before the prefill's layer loop, a copy held through
    the call (Gemma-3-27B on 8 H100s: 2.0 GiB of `generate`'s temporaries); this way it
    rearranges one layer's gathered weight inside the loop. The same numbers either way.
    ``kernel`` as it is elsewhere (XLA:CPU, a TPU), without an ``fsdp`` axis > 1, or when it
    does not split evenly."""
    mesh = jax.sharding.get_abstract_mesh()
    if not _on_gpu_fsdp(mesh) or kernel.shape[-1] % mesh.shape[BATCH_AXIS]:
        return kernel
    blocks = mesh.shape[BATCH_AXIS]
    free = PartitionSpec.UNCONSTRAINED
    split = kernel.reshape(*kernel.shape[:-1], blocks, kernel.shape[-1] // blocks)
    split = jax.lax.with_sharding_constraint(split, PartitionSpec(free, BATCH_AXIS, None))
    whole = jax.lax.with_sharding_constraint(split, PartitionSpec(free, None, None))
    return whole.reshape(kernel.shape)


def _on_gpu_fsdp(mesh) -> bool:
    """Whether ``mesh`` (the abstract mesh in context) is of GPUs with an ``fsdp`` axis > 1."""
    return (not mesh.empty and BATCH_AXIS in mesh.axis_names and mesh.shape[BATCH_AXIS] > 1
            and getattr(getattr(mesh, "abstract_device", None), "platform", None) == "gpu")


# Metadata of a per-layer q_proj kernel that holds the q, k and v kernels as one (`fuse_qkv_kernels`).
QKV_IN_Q_PROJ = "qkv_in_q_proj"


def fuse_qkv_kernels(layer: nnx.State) -> nnx.State:
    """One layer's decode weights (weights-major, `Decoder.unstacked_layers`) with q_proj's kernel
    [W_qᵀ; W_kᵀ; W_vᵀ] (and its bias [b_q, b_k, b_v]), tagged, and k_proj's and v_proj's empty.

    Why: a GPU decode step multiplies a few rows by each projection as its own kernel, and XLA
    fuses the k and v products (same shape) into one but not the q product: held as one, the
    three are one kernel (Qwen2.5-1.5B's layer on one H200, XLA:GPU deviceless: 16 → 15 kernels
    per layer and token at batch 1). The same numbers: each output is the same sum over the
    same row of the input. Not on XLA:CPU, whose products of the fused kernel ran slower
    (docs/results/sampler.md, "Tried, not kept").
    """
    attention = layer["self_attn"]
    projections = [attention[name] for name in ("q_proj", "k_proj", "v_proj")]
    for leaf in ("kernel", "bias"):
        if leaf not in projections[0]:
            continue
        parts = [p[leaf] for p in projections]
        fused = parts[0].replace(jnp.concatenate([part[...] for part in parts], axis=0))
        if leaf == "kernel":
            fused.set_metadata(**{QKV_IN_Q_PROJ: True})
        projections[0][leaf] = fused
        for projection, part in zip(projections[1:], parts[1:]):
            projection[leaf] = part.replace(part[...][:0])
    return layer


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = _linear(c.hidden_size, q_dim, LAYER_LINEARS["layers/self_attn/q_proj/kernel"], c,
                              use_bias=c.qkv_bias, rngs=rngs)
        self.k_proj = _linear(c.hidden_size, kv_dim, LAYER_LINEARS["layers/self_attn/k_proj/kernel"], c,
                              use_bias=c.qkv_bias, rngs=rngs)
        self.v_proj = _linear(c.hidden_size, kv_dim, LAYER_LINEARS["layers/self_attn/v_proj/kernel"], c,
                              use_bias=c.qkv_bias, rngs=rngs)
        self.o_proj = _linear(q_dim, c.hidden_size, LAYER_LINEARS["layers/self_attn/o_proj/kernel"], c,
                              rngs=rngs)
        self.q_norm = _norm(c.head_dim, c) if c.qk_norm else None
        self.k_norm = _norm(c.head_dim, c) if c.qk_norm else None
        self.scale = (None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar ** -0.5)

    def _project(self, x, probes):
        """(x·W_q, x·W_k, x·W_v), each with its bias and its probe's term. With the three kernels
        held as one (`fuse_qkv_kernels`, per-layer decode weights on a GPU) one product, split."""
        if not self.q_proj.kernel.get_metadata().get(QKV_IN_Q_PROJ):
            return tuple(proj(x, probes.get(name)) for name, proj in
                         (("q_proj", self.q_proj), ("k_proj", self.k_proj), ("v_proj", self.v_proj)))
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = jnp.split(self.q_proj(x), (q_dim, q_dim + kv_dim), axis=-1)
        return tuple(y if probes.get(name) is None else y + proj.probe_term(x, probes[name])
                     for name, proj, y in (("q_proj", self.q_proj, q), ("k_proj", self.k_proj, k),
                                           ("v_proj", self.v_proj, v)))

    def _project_as_one(self, x, probes):
        """([x·W_q, x·W_k, x·W_v] side by side, the biases [b_q, b_k, b_v] still to add or None).
        With q, k and v's kernels held as one (`fuse_qkv_kernels`) and no probes, that one
        product, its bias left to the attention kernel: XLA:GPU added it in a kernel of its own.
        Otherwise the three projections, concatenated."""
        fused = self.q_proj.kernel.get_metadata().get(QKV_IN_Q_PROJ)
        if fused and not any(probes.get(name) is not None for name in ("q_proj", "k_proj", "v_proj")):
            bias = self.q_proj.bias
            return self.q_proj(x, with_bias=False), None if bias is None else bias[...]
        return jnp.concatenate(self._project(x, probes), axis=-1), None

    def _rotated_qkv(self, x, cos, sin, probes):
        """q [b, t, H, d], k and v [b, t, KV, d]: the projections, each head normed (Qwen3,
        Gemma 3) and q and k rotated."""
        b, t, _ = x.shape
        q, k, v = self._project(x, probes)
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:   # per head, over head_dim, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def __call__(self, x, cos, sin, mask, probes: dict[str, SketchProbe], kv, write_index,
                 chunk_keys: bool = False, layer=None, kernels: bool = False):
        """Returns (output, the cache ``kv`` after writing this chunk's keys and values, or None).

        ``kv``: (k, v) of this layer, or with ``layer`` (an int32 scalar) the whole stack's, whose
        slots [layer, …, write_index + t) this chunk updates in place: a decode step then writes
        one slot of one layer instead of returning the layer's whole cache for the scan to stack
        into a new cache (which held every cache twice and rewrote it every token). Or a slot
        engine's `SegmentKV`: one token per slot, ``mask`` and ``write_index`` unused.
        ``chunk_keys``: the queries attend to this chunk's own keys (``mask`` [b, t, t]) though
        the chunk is written to the cache: a prefill into an empty cache, where every other slot
        is masked out anyway, scores t × t instead of t × S.
        ``kernels``: a decode step of one layer's cache on a GPU, whose rotations, cache writes
        and attention run as one kernel (`decode_kernels.decode_attention`, or for a slot
        engine's segments `decode_kernels.segmented_decode_attention`)."""
        b, t, _ = x.shape
        if kernels and isinstance(kv, SegmentKV):   # a slot engine's step on a GPU
            qkv, bias = self._project_as_one(x, probes)
            out, completion_k, completion_v = decode_kernels.segmented_decode_attention(
                qkv[:, 0], cos[:, 0], sin[:, 0], kv.prompt_k, kv.prompt_v, kv.prompt_mask,
                kv.completion_k, kv.completion_v, kv.group_of, kv.column, bias=bias,
                heads=self.num_heads, scale=self.scale)
            return (split_output_product(lambda x: self.o_proj(x, probes.get("o_proj")),
                                         out.reshape(b, t, -1)),
                    dataclasses.replace(kv, completion_k=completion_k, completion_v=completion_v))
        if kernels:
            qkv, bias = self._project_as_one(x, probes)
            out, *new_kv = decode_kernels.decode_attention(
                qkv[:, 0], cos[:, 0], sin[:, 0], *kv, mask[:, 0], write_index, bias=bias,
                heads=self.num_heads, scale=self.scale)
            return (split_output_product(lambda x: self.o_proj(x, probes.get("o_proj")),
                                         out.reshape(b, t, -1)), tuple(new_kv))
        q, k, v = self._rotated_qkv(x, cos, sin, probes)
        if isinstance(kv, SegmentKV):   # a decode step of a slot engine (kv_segments.py)
            scale = 1 / math.sqrt(self.head_dim) if self.scale is None else self.scale
            out, kv = segmented_attention(q[:, 0], k[:, 0], v[:, 0], kv, scale)
            return (split_output_product(lambda x: self.o_proj(x, probes.get("o_proj")),
                                         out.reshape(b, t, -1)), kv)
        # Attention multiplies K as [b, kv_heads, d, t] and V as [b, kv_heads, t, d], the layouts
        # the cache keeps (KVCache): this chunk is transposed once, not the scores or the whole
        # cache around every product.
        k, v = k.transpose(0, 2, 3, 1), v.swapaxes(1, 2)
        new_kv = None
        if kv is not None and layer is not None and not chunk_keys:   # a stacked decode step
            new_kv, (k, v) = update_stacked_kv(kv, k, v, write_index, layer)
        elif kv is not None:
            new_kv = write_kv(kv, k, v, write_index, layer)
            if not chunk_keys:
                k, v = read_kv(new_kv, layer)
        out = grouped_query_attention(q, k, v, mask, self.scale).reshape(b, t, -1)
        if kv is not None and not chunk_keys:   # a decode step
            return split_output_product(lambda x: self.o_proj(x, probes.get("o_proj")), out), new_kv
        hint = gathered_by_output_blocks if chunk_keys else None
        return self.o_proj(out, probes.get("o_proj"), kernel_hint=hint), new_kv


def write_kv(kv, k, v, slot, layer=None):
    """The cache ``kv`` = (K, V) with a chunk's k [b, kv, d, t] and v [b, kv, t, d] written at
    ``slot``: of one layer's arrays, or with ``layer`` of the stack's [L, …] arrays at that layer."""
    cache_k, cache_v = kv
    k, v = k.astype(cache_k.dtype), v.astype(cache_v.dtype)
    if layer is None:
        return (jax.lax.dynamic_update_slice(cache_k, k, (0, 0, 0, slot)),
                jax.lax.dynamic_update_slice(cache_v, v, (0, 0, slot, 0)))
    return (jax.lax.dynamic_update_slice(cache_k, k[None], (layer, 0, 0, 0, slot)),
            jax.lax.dynamic_update_slice(cache_v, v[None], (layer, 0, 0, slot, 0)))


def update_stacked_kv(kv, k, v, slot, layer):
    """(the stack ``kv`` with a decode step's k, v written at [layer, …, slot], that layer's
    (K, V) after the write): what a stacked decode step attends to.

    XLA:GPU writes the slot in place and reads the layer from the written stack. XLA:CPU fused
    that read with the write into one kernel reading the stack as it was before the write, so it
    copied the whole stack every layer to keep that version alive (two copies per layer and
    token); there the layer is read first, written, and put back whole (a data dependency XLA
    can order, the stack then updated in place): one pass over the cache per token, as when the
    layer scan stacked its outputs."""
    def write_then_read(kv, k, v, slot, layer):
        written = write_kv(kv, k, v, slot, layer)
        return written, read_kv(written, layer)

    def read_write_put_back(kv, k, v, slot, layer):
        layer_kv = write_kv(read_kv(kv, layer), k, v, slot)
        return tuple(jax.lax.dynamic_update_index_in_dim(stack, one, layer, 0)
                     for stack, one in zip(kv, layer_kv)), layer_kv

    return jax.lax.platform_dependent(kv, k, v, slot, layer, cpu=read_write_put_back,
                                      default=write_then_read)


def read_kv(kv, layer=None):
    """One layer's (K, V): ``kv`` itself, or with ``layer`` that layer of the stack's arrays."""
    if layer is None:
        return kv
    return tuple(jax.lax.dynamic_index_in_dim(a, layer, keepdims=False) for a in kv)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.gate_proj = _linear(c.hidden_size, c.intermediate_size,
                                 LAYER_LINEARS["layers/mlp/gate_proj/kernel"], c, rngs=rngs)
        self.up_proj = _linear(c.hidden_size, c.intermediate_size,
                               LAYER_LINEARS["layers/mlp/up_proj/kernel"], c, rngs=rngs)
        self.down_proj = _linear(c.intermediate_size, c.hidden_size,
                                 LAYER_LINEARS["layers/mlp/down_proj/kernel"], c, rngs=rngs)
        self.activation = _ACTIVATIONS[c.mlp_activation]

    def __call__(self, x, probes: dict[str, SketchProbe], step: str | None = None):
        """``step``: "decode", a decode step's few rows (`split_output_product` for down_proj),
        or "prefill" (`gathered_by_output_blocks`); None for the training forward."""
        gate = self.gate_proj(x, probes.get("gate_proj"))
        up = self.up_proj(x, probes.get("up_proj"))
        if step == "decode":
            return split_output_product(lambda x: self.down_proj(x, probes.get("down_proj")),
                                        self.activation(gate) * up)
        hint = gathered_by_output_blocks if step == "prefill" else None
        return self.down_proj(self.activation(gate) * up, probes.get("down_proj"), kernel_hint=hint)


_ACTIVATIONS = {"silu": jax.nn.silu,
                "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}   # torch's gelu(tanh)


class Block(nnx.Module):
    """One pre-norm transformer layer (with sandwich norms for Gemma); the Decoder stacks L of them.

    Names are Hugging Face's: for Llama ``post_attention_layernorm`` is the norm *before* the MLP;
    with ``sandwich_norms`` it normalises the attention output, and the MLP sits between
    ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.input_layernorm = _norm(c.hidden_size, c)
        self.self_attn = Attention(c, rngs=rngs)
        self.post_attention_layernorm = _norm(c.hidden_size, c)
        self.mlp = MLP(c, rngs=rngs)
        self.sandwich = c.sandwich_norms
        if c.sandwich_norms:
            self.pre_feedforward_layernorm = _norm(c.hidden_size, c)
            self.post_feedforward_layernorm = _norm(c.hidden_size, c)

    def __call__(self, x, cos, sin, mask, probes: dict[str, SketchProbe], kv, write_index,
                 chunk_keys: bool = False, layer=None, kernels: bool = False):
        """``kernels``: a decode step of per-layer weights on a GPU (`decode_kernels`): each norm
        one kernel, the attention's residual sum in the second's, attention one kernel."""
        attn_probes = {k.split("/")[1]: p for k, p in probes.items() if k.startswith("self_attn/")}
        mlp_probes = {k.split("/")[1]: p for k, p in probes.items() if k.startswith("mlp/")}
        if kernels:
            attn_out, new_kv = self.self_attn(self.input_layernorm.in_one_kernel(x), cos, sin, mask,
                                              attn_probes, kv, write_index, kernels=True)
            h, normed = self.post_attention_layernorm.in_one_kernel(x, residual=attn_out)
            return h + self.mlp(normed, mlp_probes, "decode"), new_kv
        attn_out, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, attn_probes, kv,
                                          write_index, chunk_keys, layer)
        step = None if kv is None else "prefill" if chunk_keys else "decode"
        if not self.sandwich:
            h = x + attn_out
            return h + self.mlp(self.post_attention_layernorm(h), mlp_probes, step), new_kv
        h = x + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(h), mlp_probes, step)
        return h + self.post_feedforward_layernorm(mlp_out), new_kv


class Decoder(nnx.Module):
    """The causal language model. See the module docstring for the math and parameter layout."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, ModelConfig):
            raise ValueError(f"Decoder needs a ModelConfig, got {type(config).__name__}")
        c = self.config = config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype=c.compute_dtype,
                                      param_dtype=c.weight_dtype, rngs=rngs, scale=c.embed_scale)

        @nnx.split_rngs(splits=c.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(layer_rngs):
            return Block(c, rngs=layer_rngs)

        self.layers = make_layers(rngs)
        # vmap copies metadata but does not know our key: add the stacked dimension's name.
        for _, node in nnx.iter_graph(self.layers):
            if isinstance(node, nnx.Variable) and get_logical_axes(node) is not None:
                set_logical_axes(node, ("layers",) + get_logical_axes(node))
        self.norm = _norm(c.hidden_size, c)
        self.lm_head = (None if c.tie_embeddings else
                        _linear(c.hidden_size, c.vocab_size, ("embed", "vocab"), c, rngs=rngs))

    # ----------------------------------------------------------------------------------------- #
    def head_kernel(self) -> jax.Array:
        """The output projection [d, V] (the embedding table transposed when tied), param dtype."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., d] (compute dtype) · head → fp32 logits [..., V] (fp32 accumulation)."""
        head = self.head_kernel().astype(hidden.dtype)
        return jnp.einsum("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32)

    def vocab_major_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [b, d] (compute dtype) → fp32 logits [V, b], the vocabulary first (a decode step's).

        With a tied head the table E (V × d) is W_headᵀ as stored, and (hidden·Eᵀ)ᵀ = E·hiddenᵀ
        runs weights-major (`linear.weights_major_product`): 1.7× faster at 16 rows on XLA:CPU.
        The sampler's draw then reduces over the vocabulary with the batch contiguous, which is
        also faster than over rows of a [b, V] array (docs/results/sampler.md).
        """
        hidden = shard_features(hidden)   # the head's partial products summed, not the head gathered
        if self.lm_head is not None:
            return self.logits(hidden).T
        table = self.embed_tokens.embedding[...].astype(hidden.dtype)
        return weights_major_product(table, hidden, preferred_element_type=jnp.float32)

    def unstacked_layers(self, fuse_qkv: bool = False) -> tuple:
        """The layer stack's weights as one state per layer, each its own array (for a decode loop),
        with every linear kernel stored transposed, (out, in) (`linear.weights_major`); with
        ``fuse_qkv`` the attention's q, k and v kernels held as one (`fuse_qkv_kernels`).

        XLA on CPU copies a scanned layer's weights out of the stack before its dots, so a scanned
        decode step moves every weight three times; arrays made once per generate call are read
        in place. Transposed, because XLA:CPU multiplies the few rows of a decode step 1.6× faster
        with the weights as the product's left operand (`linear.weights_major_product`); making
        the copy a transposed one costs ~0.1 s more per call for SmolLM2's 106 M layer weights.
        The optimization barrier keeps XLA from sinking the copies back into the loop. Costs one
        copy of the layer weights while it lives.
        """
        _, stacked = nnx.split(self.layers)

        def layer(i):
            def take(path, variable):
                one = variable.replace(variable[...][i])
                return weights_major(one) if path[-1].key == "kernel" else one
            one = jax.tree.map_with_path(take, stacked, is_leaf=lambda v: isinstance(v, nnx.Variable))
            return fuse_qkv_kernels(one) if fuse_qkv else one

        return jax.lax.optimization_barrier(tuple(layer(i) for i in range(self.config.num_layers)))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KVCache for ``batch`` sequences of up to ``max_len`` tokens (compute dtype)."""
        c = self.config
        if max_len > c.max_position_embeddings:
            raise ValueError(f"init_cache: max_len {max_len} exceeds the model's "
                             f"max_position_embeddings {c.max_position_embeddings}")
        return KVCache.create(num_layers=c.num_layers, batch=batch, max_len=max_len,
                              num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=c.compute_dtype)

    def _per_layer_probes(self, probes) -> dict[str, SketchProbe]:
        """{kernel path: stacked probe} → {"self_attn/q_proj": probe, ...}, checked against the stack."""
        if not probes:
            return {}
        out = {}
        for path, probe in probes.items():
            if path not in LAYER_LINEARS:
                raise ValueError(f"probe for {path!r}, which is not a stacked linear kernel of this "
                                 f"decoder; valid targets: {sorted(LAYER_LINEARS)}")
            if not isinstance(probe, SketchProbe) and not (hasattr(probe, "projection")
                                                           and hasattr(probe, "factor")):
                raise ValueError(f"probe for {path!r} must be a SketchProbe or an adapter with "
                                 f"projection() and factor (LoRA), got {type(probe).__name__}")
            layer = self.layers
            for name in path.split("/")[1:-1]:
                layer = getattr(layer, name)
            expected = (self.config.num_layers, layer.out_features)
            if probe.factor.ndim != 3 or probe.factor.shape[:2] != expected:
                raise ValueError(f"probe for {path!r}: factor must have shape (layers, out, rank) = "
                                 f"{expected + ('r',)}, got {probe.factor.shape}")
            out[path[len("layers/"):-len("/kernel")]] = probe
        return out

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 segment_mask: jax.Array | None = None, probes: dict[str, SketchProbe] | None = None,
                 cache: KVCache | None = None, return_hidden: bool = False, layers=None,
                 prefill: bool = False, kernels: bool = False):
        """Logits [b, t, V] fp32 (or the final-normed hidden [b, t, d]); with a cache, (out, new cache).

        tokens: int32 [b, t]. positions: int32 [b, t] RoPE positions (default: cache index + arange).
        segment_mask: bool [b, t], True = real token; False keys are never attended to (left or right
        padding). probes: {kernel path: SketchProbe with a leading layer dim}; paths absent get none.
        cache: see KVCache — this chunk is written at slots [index, index + t).
        prefill: the cache is empty (index 0): the chunk still fills slots [0, t), but its queries
        attend to its own t keys, not all S slots (every other slot is masked out, so the values are
        those of attending to the cache, up to the order of summing): the scores are b × H × t × t.
        A sampler's prompt of 512 tokens under a 2048-slot cache held 4× the scores without it.
        kernels: a decode step (one token, per-layer weights and cache) on a GPU with each layer's
        norms and attention as the kernels of decode_kernels.py (`decode_kernels.fits` the model).

        Three ways through the layers, one method each, picked by what is passed:
          no cache, no ``layers``   `_scanned`: the stack under one scan (training, scoring);
          a cache, no ``layers``    `_scanned_into_cache`: the scan writes each layer's keys and
                                    values into the stacked cache (a prefill, a stacked decode step);
          ``layers``                `_layer_by_layer`: per-layer weights and cache, one layer after
                                    the other (the sampler's decode loop, its GPU kernels).
        """
        layer_probes = self._per_layer_probes(probes)
        tokens, segment_mask, positions = self._checked_inputs(tokens, segment_mask, positions, cache)
        b, t = tokens.shape
        if cache is not None:
            self._check_cache(cache, b, t, prefill=prefill, per_layer=layers is not None)
        if kernels and (cache is None or layers is None or t != 1
                        or not decode_kernels.fits(self.config)):
            raise ValueError("kernels=True is for a decode step (one token) of per-layer weights "
                             "and cache, of a model decode_kernels.fits")

        if layers is not None:
            x, new_kv, new_mask = self._layer_by_layer(tokens, positions, segment_mask, layer_probes,
                                                       cache, layers, prefill, kernels)
        elif cache is not None:
            x, new_kv, new_mask = self._scanned_into_cache(tokens, positions, segment_mask,
                                                           layer_probes, cache, prefill)
        else:
            x = self._scanned(tokens, positions, segment_mask, layer_probes)
        x = self.norm(x)
        out = x if return_hidden else self.logits(x)
        if cache is None:
            return out
        return out, KVCache(k=new_kv[0], v=new_kv[1], index=(cache.index + t).astype(jnp.int32),
                            mask=new_mask)

    # The three ways through the layers ------------------------------------------------------ #
    def _scanned(self, tokens, positions, segment_mask, layer_probes) -> jax.Array:
        """No cache: the stacked layers under one ``jax.lax.scan`` over the whole sequence; with
        ``remat`` the backward recomputes each layer from its input instead of keeping its
        activations. Returns the last layer's output [b, t, d]."""
        mask, _, query_slot, key_slot = self._attention_mask(segment_mask, None, False)
        x = self._embedded(tokens)
        layer = self._layer_fn(positions, mask, query_slot, key_slot, write_index=0)
        if self.config.remat:
            layer = jax.checkpoint(layer, prevent_cse=False)
        x, _ = jax.lax.scan(layer, x, (self._stacked_params(), layer_probes, None,
                                       jnp.asarray(self.config.sliding_layers)))
        return x

    def _scanned_into_cache(self, tokens, positions, segment_mask, layer_probes, cache, prefill):
        """A chunk written into the stacked cache: (last layer's output, (K, V) stacks, cache mask).

        The cache stack rides in the scan's carry and each layer writes its chunk into it in place
        (`write_kv`), so the stack exists once: as the scan's output instead, every layer's whole
        cache would be copied into a new stack, every token."""
        mask, new_mask, query_slot, key_slot = self._attention_mask(segment_mask, cache, prefill)
        x = self._embedded(tokens)
        layer = self._layer_fn(positions, mask, query_slot, key_slot, write_index=cache.index,
                               chunk_keys=prefill)

        def layer_with_cache(carry, per_layer):
            h, kv = carry
            params, probes_l, sliding_l, index = per_layer
            h, kv = layer(h, (params, probes_l, kv, sliding_l), index)
            return (h, kv), None

        (x, new_kv), _ = jax.lax.scan(
            layer_with_cache, (x, (cache.k, cache.v)),
            (self._stacked_params(), layer_probes, jnp.asarray(self.config.sliding_layers),
             jnp.arange(self.config.num_layers, dtype=jnp.int32)))
        return x, new_kv, new_mask

    def _layer_by_layer(self, tokens, positions, segment_mask, layer_probes, cache, layers,
                        prefill, kernels):
        """Per-layer weights (`unstacked_layers`) and cache (`KVCache.unstacked`), the layers run
        one after the other, each reading its own weight and cache arrays in place: (last layer's
        output, (K, V) tuples of one array per layer, cache mask). ``kernels``: each layer's norms
        and attention as decode_kernels.py's kernels."""
        mask, new_mask, query_slot, key_slot = self._attention_mask(segment_mask, cache, prefill)
        x = self._embedded(tokens)
        layer = self._layer_fn(positions, mask, query_slot, key_slot,
                               write_index=0 if cache is None else cache.index,
                               chunk_keys=prefill and cache is not None, kernels=kernels)
        kvs = (None,) * len(layers) if cache is None else tuple(zip(cache.k, cache.v))
        x, new_kvs = self._run_per_layer(x, layer, layers, layer_probes, kvs,
                                         jnp.asarray(self.config.sliding_layers))
        if cache is None:
            return x, None, None
        return x, (tuple(k for k, _ in new_kvs), tuple(v for _, v in new_kvs)), new_mask

    # What the three share with each other and with `decode_segments` ----------------------- #
    @staticmethod
    def _checked_inputs(tokens, segment_mask, positions, cache):
        """(tokens, segment_mask, positions) as arrays of shape [b, t], the defaults filled in: every
        token real, positions counting on from the cache's index."""
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
        b, t = tokens.shape
        if segment_mask is None:
            segment_mask = jnp.ones((b, t), bool)
        segment_mask = jnp.asarray(segment_mask).astype(bool)
        if segment_mask.shape != (b, t):
            raise ValueError(f"segment_mask shape {segment_mask.shape} != tokens shape {(b, t)}")
        offset = 0 if cache is None else cache.index
        if positions is None:
            positions = jnp.broadcast_to(offset + jnp.arange(t, dtype=jnp.int32), (b, t))
        positions = jnp.asarray(positions)
        if positions.shape != (b, t):
            raise ValueError(f"positions shape {positions.shape} != tokens shape {(b, t)}")
        return tokens, segment_mask, positions

    @staticmethod
    def _check_cache(cache: KVCache, b: int, t: int, *, prefill: bool, per_layer: bool) -> None:
        """Refuses a cache that ``t`` tokens of ``b`` rows do not fit (its index checked where it is
        known while tracing), a prefill into a cache that is not empty, and per-layer weights with
        a stacked cache or the other way round."""
        if cache.batch_size != b:
            raise ValueError(f"cache batch {cache.batch_size} != tokens batch {b}")
        if t > cache.max_len:
            raise ValueError(f"{t} tokens do not fit a cache of {cache.max_len} slots")
        if not isinstance(cache.index, jax.core.Tracer) and int(cache.index) + t > cache.max_len:
            raise ValueError(f"cache overflow: index {int(cache.index)} + {t} tokens > "
                             f"{cache.max_len} slots")
        if prefill and not isinstance(cache.index, jax.core.Tracer) and int(cache.index):
            raise ValueError(f"prefill=True needs an empty cache, got index {int(cache.index)}")
        if per_layer != cache.per_layer:
            raise ValueError("per-layer weights (layers=) go with a per-layer cache "
                             "(KVCache.unstacked()) and the other way round")

    @staticmethod
    def _attention_mask(segment_mask, cache, prefill):
        """(mask [b, t, keys], the cache's mask after this chunk or None, query slots [t], key
        slots [keys]): query slot i sees key slot j when j ≤ i and j holds a real token. Without a
        cache the keys are the chunk's own; with one, every slot of the cache, or with ``prefill``
        the chunk's own again (written at slots [0, t) of the empty cache)."""
        t = segment_mask.shape[1]
        if cache is None:
            query_slot = key_slot = jnp.arange(t)
            return ((key_slot[None, :] <= query_slot[:, None])[None] & segment_mask[:, None, :],
                    None, query_slot, key_slot)
        new_mask = jax.lax.dynamic_update_slice(cache.mask, segment_mask, (0, cache.index))
        query_slot = cache.index + jnp.arange(t)
        key_slot = jnp.arange(t if prefill else cache.max_len)
        key_mask = segment_mask if prefill else new_mask
        mask = (key_slot[None, :] <= query_slot[:, None])[None] & key_mask[:, None, :]
        return mask, new_mask, query_slot, key_slot

    def _embedded(self, tokens: jax.Array) -> jax.Array:
        """The tokens' embeddings [b, t, d], split by rows (`shard_batch`)."""
        return shard_batch(self.embed_tokens(tokens))

    def _rotary(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE's (cos, sin) at ``positions`` with the model's own base (a full layer's)."""
        c = self.config
        return rotary_cos_sin(positions, inverse_frequencies(c.head_dim, c.rope_theta,
                                                             c.rope_scaling), c.compute_dtype)

    def _stacked_params(self) -> nnx.State:
        """The layer stack's parameters, each with its leading layer axis (what the scans slice)."""
        return nnx.split(self.layers)[1]

    def _layer_fn(self, positions, mask, query_slot, key_slot, *, write_index,
                  chunk_keys: bool = False, kernels: bool = False):
        """``layer(h, (params, probes, kv, sliding), stack_index=None)`` → (h, kv): one `Block` of
        this pass, merged from its ``params``, with the RoPE and the mask of its type.

        Gemma 3's sliding layers: key slot j is visible from query slot i when i − W < j ≤ i (as
        Hugging Face's sliding_window_overlay), and they rotate with their own RoPE base; the
        layer's ``sliding`` flag (scanned with the stack) picks between the two.
        ``write_index``, ``chunk_keys``, ``stack_index``, ``kernels``: the cache slot this chunk is
        written at, and `Attention`'s arguments of the same meaning."""
        c = self.config
        cos, sin = self._rotary(positions)
        graphdef, _ = nnx.split(self.layers)
        if any(c.sliding_layers):
            window = key_slot[None, :] > query_slot[:, None] - c.sliding_window
            local_rope = rotary_cos_sin(positions, inverse_frequencies(
                c.head_dim, c.rope_local_theta or c.rope_theta), c.compute_dtype)

        def layer(h, per_layer, stack_index=None):
            params, probes_l, kv_l, sliding_l = per_layer
            block = nnx.merge(graphdef, params)
            cos_l, sin_l, mask_l = cos, sin, mask
            if any(c.sliding_layers):
                cos_l, sin_l = (jnp.where(sliding_l, a, b) for a, b in zip(local_rope, (cos, sin)))
                mask_l = mask & (window[None] | ~sliding_l)
            return block(shard_batch(h), cos_l, sin_l, mask_l, probes_l, kv_l, write_index,
                         chunk_keys, stack_index, kernels)

        return layer

    @staticmethod
    def _run_per_layer(x, layer, layers, layer_probes, kvs, sliding):
        """``layer`` (`_layer_fn`) over per-layer weights ``layers``, each with its slice of the
        stacked probes, its own ``kvs[i]`` (a layer's cache, a `SegmentKV`, or None) and its flag
        ``sliding[i]``: (output, [each layer's kv after the step])."""
        written = []
        for i, params_i in enumerate(layers):
            probes_i = jax.tree.map(lambda a: a[i], layer_probes)
            x, kv_i = layer(x, (params_i, probes_i, kvs[i], sliding[i]))
            written.append(kv_i)
        return x, written

    def decode_segments(self, tokens: jax.Array, positions: jax.Array,
                        segments: tuple[SegmentKV, ...], *, layers, probes=None,
                        kernels: bool = False):
        """One decode step of a slot engine: (final-normed hidden [S, d], ``segments`` with the
        step's keys and values written).

        tokens, positions: int32 [S], each slot's last drawn token and its RoPE position.
        segments: one `SegmentKV` per layer (kv_segments.py: each group's prompt once, each
        slot's completion its own). layers: per-layer weights (`unstacked_layers`), run one
        after the other as a per-layer decode step does. probes: as in `__call__`. kernels: on a
        GPU, each layer's norms and attention as decode_kernels.py's kernels (`__call__`'s).
        """
        if any(self.config.sliding_layers):
            raise ValueError("the slot engine does not decode sliding-window layers (Gemma 3) yet; "
                             "set rl.rollout_engine='static' for this model")
        if kernels and not decode_kernels.fits(self.config):
            raise ValueError("kernels=True is for a model decode_kernels.fits")
        layer_probes = self._per_layer_probes(probes)
        x = self._embedded(tokens[:, None])
        # One token per slot: the segments bound what each slot attends to (no mask, no slot).
        layer = self._layer_fn(positions[:, None], None, None, None, write_index=None,
                               kernels=kernels)
        # No layer slides (refused above): the flags stay Python's, nothing for the trace to hold.
        x, written = self._run_per_layer(x, layer, layers, layer_probes, segments,
                                         self.config.sliding_layers)
        return self.norm(x)[:, 0], tuple(written)
