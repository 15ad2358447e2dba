"""A GPU decode step's RMSNorm and attention as one kernel each (Pallas, Triton on the GPU).

Why: a decode step of a few rows is launch-bound on a GPU (Qwen2.5-1.5B at batch 1 on one H200:
~1.9 µs per kernel, docs/results/sampler.md), and XLA:GPU emits a layer's small work as many
kernels that it does not fuse further at batch 1: each RMSNorm as a reduction and a multiply,
attention as q's rotation, a write of each of k and v into the cache, q·K and the softmax with
weights·V. Here each norm is one kernel, and attention (both rotations, both cache writes, q·K,
softmax, weights·V) is one: 15 → 9 kernels per layer and token (XLA:GPU deviceless, `launch.cost`).
The projections stay XLA's (GEMVs and GEMMs at the weights' bandwidth).

The same arithmetic as the layers' (llama.py), term by term; the order of summing differs (any
two kernels differ there), and the softmax runs online, one pass over the cache (a running
maximum and sum, the output rescaled as the maximum grows; Milakov & Gimelshein 2018), so the
weights are not rounded to the cache's dtype before they multiply V. Written for Triton: every
block a power of two long, a width that is not one (1,536) read in masked blocks.

On any other platform the same kernels run through Pallas' interpreter (the tests check them on
a CPU that way); the sampler uses them only on a GPU.

Not measured on a GPU yet (`make gpu-check` compares them with the layers' ops on its device
first). The attention runs one program per row and query head, each reading its group's cache
block by block: at batch 1 that is 12 programs for Qwen2.5-1.5B, so over a long cache a split of
the slots across programs (flash-decoding, one more kernel to combine them) may be faster; the
bytes model of `launch.cost` does not see how many programs share the bandwidth.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Slots of the cache one step of the attention kernel reads (a power of two, as Triton's blocks).
SLOTS_PER_BLOCK = 128
# The widest block of a row the norm reads at once.
MAX_ROW_BLOCK = 1024


def fits(config) -> bool:
    """Whether a model's decode step can run these kernels: Llama-style layers (no per-head q
    and k norms, sliding windows or sandwich norms) with a head_dim that is a power of two."""
    return (not (config.qk_norm or config.sandwich_norms or any(config.sliding_layers))
            and config.head_dim & (config.head_dim - 1) == 0)


def _per_platform(call, *operands):
    """``call(interpret, *operands)`` as a Triton kernel on a GPU, through Pallas' interpreter on
    any other platform (a CPU's tests)."""
    on_gpu = functools.partial(call, False)
    return jax.lax.platform_dependent(*operands, cuda=on_gpu, rocm=on_gpu,
                                      default=functools.partial(call, True))


def _load(ref, index, mask=None, other=None):
    from jax.experimental.pallas import triton as pltriton
    return pltriton.load(ref.at[index], mask=mask, other=other)


def _store(ref, index, value, mask=None):
    from jax.experimental.pallas import triton as pltriton
    pltriton.store(ref.at[index], value, mask=mask)


def _compiler_params(warps: int):
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=warps)


# -------------------------------------------------------------------------------------------------
# RMSNorm
# -------------------------------------------------------------------------------------------------
def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float, unit_offset: bool = False,
             residual: jax.Array | None = None):
    """`llama.RMSNorm` of each row of x [b, D] as one kernel: y = x̂ ⊙ scale with
    x̂ = x / √(mean(x²) + ε) in fp32, cast to x's dtype, then multiplied by scale in that dtype
    (with ``unit_offset``, Gemma: x̂ ⊙ (1 + scale) in fp32, then cast).

    With ``residual`` [b, D]: returns (h, norm(h)) for h = x + residual (in x's dtype), the
    pre-norm layer's sum and its norm in one kernel."""
    rows, width = x.shape
    block = min(MAX_ROW_BLOCK, pl.next_power_of_2(width))
    blocks = pl.cdiv(width, block)
    with_sum = residual is not None

    def kernel(*refs):
        if with_sum:
            x_ref, r_ref, scale_ref, h_ref, out_ref = refs
        else:
            x_ref, scale_ref, out_ref = refs
        row = pl.program_id(0)

        def columns(i):
            at = i * block + jnp.arange(block)
            return pl.ds(i * block, block), at < width

        def load_row(i):
            cols, valid = columns(i)
            h = _load(x_ref, (row, cols), mask=valid, other=0)
            if with_sum:
                h = (h + _load(r_ref, (row, cols), mask=valid, other=0)).astype(x.dtype)
            return h

        def sum_squares(i, total):
            h = load_row(i).astype(jnp.float32)
            return total + jnp.sum(h * h)

        total = jax.lax.fori_loop(0, blocks, sum_squares, jnp.zeros((), jnp.float32))
        inverse = jax.lax.rsqrt(total / width + eps)

        def normalize(i, carry):
            cols, valid = columns(i)
            h = load_row(i)
            if with_sum:
                _store(h_ref, (row, cols), h, mask=valid)
            normed = h.astype(jnp.float32) * inverse
            w = _load(scale_ref, cols, mask=valid, other=0)
            if unit_offset:
                y = (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
            else:
                y = w.astype(x.dtype) * normed.astype(x.dtype)
            _store(out_ref, (row, cols), y, mask=valid)
            return carry

        jax.lax.fori_loop(0, blocks, normalize, 0)

    row_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    outputs = (row_shape, row_shape) if with_sum else row_shape
    operands = (x, residual, scale) if with_sum else (x, scale)

    def call(interpret, *operands):
        return pl.pallas_call(kernel, out_shape=outputs, grid=(rows,),
                              compiler_params=_compiler_params(4), interpret=interpret,
                              name="rms_norm")(*operands)

    return _per_platform(call, *operands)


# -------------------------------------------------------------------------------------------------
# Attention
# -------------------------------------------------------------------------------------------------
def _rotate(x1, x2, cos1, cos2, sin1, sin2, dtype):
    """`rope.apply_rotary` of one head given as halves, rounding to ``dtype`` after each
    operation as the layer's does: x·cos + [−x₂, x₁]·sin."""
    def r(a):
        return a.astype(dtype).astype(jnp.float32)
    f = [a.astype(jnp.float32) for a in (x1, x2, cos1, cos2, sin1, sin2)]
    x1, x2, cos1, cos2, sin1, sin2 = f
    return (r(r(x1 * cos1) + r(r(-x2) * sin1)).astype(dtype),
            r(r(x2 * cos2) + r(x1 * sin2)).astype(dtype))


def _rotated_qkv(qkv_ref, bias_ref, cos_ref, sin_ref, row, head, kv, *, heads: int,
                 kv_heads: int, head_dim: int, qkv_dtype, dtype):
    """Inside a kernel: row ``row``'s rotated query half-heads q1, q2 (query head ``head``), its
    rotated key halves k1, k2 and value (KV head ``kv``), the last three in the cache's ``dtype``,
    from qkv [b, (H + 2·KV)·d] of ``qkv_dtype`` (+ the bias, when ``bias_ref`` is given) and cos,
    sin [b, d]: the layer's rotation, term by term (`_rotate`)."""
    half = head_dim // 2
    first, second = pl.ds(0, half), pl.ds(half, half)
    cos1, cos2, sin1, sin2 = [_load(ref, (row, part)) for ref in (cos_ref, sin_ref)
                              for part in (first, second)]

    def columns(start, size):   # qkv[row, start:start + size] (+ bias)
        y = _load(qkv_ref, (row, pl.ds(start, size)))
        if bias_ref is not None:
            y = (y + _load(bias_ref, pl.ds(start, size)).astype(qkv_dtype)).astype(qkv_dtype)
        return y

    def halves(column):   # the head starting at ``column`` of qkv, as its two halves
        return columns(column, half), columns(column + half, half)

    q1, q2 = _rotate(*halves(head * head_dim), cos1, cos2, sin1, sin2, qkv_dtype)
    k1, k2 = _rotate(*halves((heads + kv) * head_dim), cos1, cos2, sin1, sin2, qkv_dtype)
    v = columns((heads + kv_heads + kv) * head_dim, head_dim).astype(dtype)
    return q1, q2, k1.astype(dtype), k2.astype(dtype), v


def decode_attention(qkv, cos, sin, cache_k, cache_v, mask, slot, *, heads: int,
                     bias: jax.Array | None = None, scale: float | None = None):
    """One decode step's attention for every row, as one kernel; returns (out, cache_k, cache_v).

    qkv [b, (H + 2·KV)·d]: the step's projections q, k and v side by side (one product's output,
    `llama.fuse_qkv_kernels`: as three arrays XLA would copy each out of it first), before the
    rotation; ``heads``: H; ``bias`` [(H + 2·KV)·d]: added to qkv first (in qkv's dtype, as
    `Linear` adds it) when given, which saves XLA:GPU a kernel of its own for it; cos, sin
    [b, d]: its rotation (`rope.rotary_cos_sin`); cache_k [b, KV, d, S] and cache_v
    [b, KV, S, d]: the layer's cache (`KVCache`), updated in place; mask [b, S] (True = may
    attend, the step's own slot included); slot: where the step's k and v go (int32 scalar),
    clamped to the cache as `jax.lax.dynamic_update_slice` clamps it.

    out [b, H, d] (qkv's dtype) = softmax(q̃·K̃ᵀ·scale + mask)·Ṽ where q̃ is q rotated, and K̃, Ṽ are
    the cache with the rotated k and v at ``slot``; query head h reads key/value head
    h // (H / KV); scale defaults to 1/√d; a row with every slot masked gets uniform weights
    (`llama.grouped_query_attention`'s conventions). One program per row and query head; the
    first head of each group writes its group's k and v. The step's own slot is scored from k
    and v as computed, not read back from memory another thread wrote.
    """
    b = qkv.shape[0]
    kv_heads, head_dim, slots = cache_k.shape[1:]
    if qkv.shape[1] != (heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"decode_attention: qkv has {qkv.shape[1]} columns, not (H + 2·KV)·d = "
                         f"{(heads + 2 * kv_heads) * head_dim}")
    group, half = heads // kv_heads, head_dim // 2
    if head_dim & (head_dim - 1) or head_dim < 2:
        raise ValueError(f"decode_attention needs a head_dim that is a power of two, got {head_dim}")
    block = min(SLOTS_PER_BLOCK, pl.next_power_of_2(slots))
    blocks = pl.cdiv(slots, block)
    dtype = cache_k.dtype
    lowest = float(jnp.finfo(jnp.float32).min)

    def kernel(*refs):
        if bias is None:
            qkv_ref, cos_ref, sin_ref, mask_ref, slot_ref, _, _, out_ref, ck_ref, cv_ref = refs
        else:
            qkv_ref, bias_ref, cos_ref, sin_ref, mask_ref, slot_ref, _, _, out_ref, ck_ref, cv_ref = refs
        # (the two unnamed inputs are the caches, the same buffers as ck_ref and cv_ref: aliased)
        row, head = pl.program_id(0), pl.program_id(1)
        kv = head // group
        first, second = pl.ds(0, half), pl.ds(half, half)
        q1, q2, k1, k2, v_new = _rotated_qkv(
            qkv_ref, None if bias is None else bias_ref, cos_ref, sin_ref, row, head, kv,
            heads=heads, kv_heads=kv_heads, head_dim=head_dim, qkv_dtype=qkv.dtype, dtype=dtype)
        at = jnp.clip(slot_ref[0], 0, slots - 1)

        @pl.when(head % group == 0)
        def _():
            _store(ck_ref, (row, kv, first, at), k1)
            _store(ck_ref, (row, kv, second, at), k2)
            _store(cv_ref, (row, kv, at, pl.ds(0, head_dim)), v_new)

        q1, q2 = q1.astype(jnp.float32), q2.astype(jnp.float32)
        own = jnp.sum(q1 * k1.astype(jnp.float32)) + jnp.sum(q2 * k2.astype(jnp.float32))

        def step(i, carry):
            top, total, acc = carry
            cols = pl.ds(i * block, block)
            position = i * block + jnp.arange(block)
            inside = position < slots
            keys1 = _load(ck_ref, (row, kv, first, cols), mask=inside[None, :], other=0)
            keys2 = _load(ck_ref, (row, kv, second, cols), mask=inside[None, :], other=0)
            scores = (jnp.sum(q1[:, None] * keys1.astype(jnp.float32), axis=0)
                      + jnp.sum(q2[:, None] * keys2.astype(jnp.float32), axis=0))
            is_own = position == at
            scores = jnp.where(is_own, own, scores)
            scores = scores / math.sqrt(head_dim) if scale is None else scores * scale
            visible = _load(mask_ref, (row, cols), mask=inside, other=0) != 0
            scores = jnp.where(visible, scores, lowest)
            scores = jnp.where(inside, scores, -jnp.inf)   # past the cache: weight 0
            new_top = jnp.maximum(top, jnp.max(scores))
            weights = jnp.exp(scores - new_top)
            rescale = jnp.exp(top - new_top)
            values = _load(cv_ref, (row, kv, cols, pl.ds(0, head_dim)), mask=inside[:, None],
                           other=0)
            values = jnp.where(is_own[:, None], v_new[None, :], values).astype(jnp.float32)
            acc = acc * rescale + jnp.sum(weights[:, None] * values, axis=0)
            return new_top, total * rescale + jnp.sum(weights), acc

        init = (jnp.full((), lowest, jnp.float32), jnp.zeros((), jnp.float32),
                jnp.zeros((head_dim,), jnp.float32))
        _, total, acc = jax.lax.fori_loop(0, blocks, step, init)
        _store(out_ref, (row, head, pl.ds(0, head_dim)), (acc / total).astype(out_ref.dtype))

    slot = jnp.reshape(jnp.asarray(slot, jnp.int32), (1,))
    operands = ((qkv,) if bias is None else (qkv, bias)) + (cos, sin, mask.astype(jnp.int32), slot)

    def call(interpret, *operands):
        return pl.pallas_call(
            kernel,
            out_shape=(jax.ShapeDtypeStruct((b, heads, head_dim), qkv.dtype),
                       jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),
                       jax.ShapeDtypeStruct(cache_v.shape, cache_v.dtype)),
            grid=(b, heads), input_output_aliases={len(operands) - 2: 1, len(operands) - 1: 2},
            compiler_params=_compiler_params(4), interpret=interpret, name="decode_attention",
        )(*operands)

    return _per_platform(call, *operands, cache_k, cache_v)


# -------------------------------------------------------------------------------------------------
# Attention over two segments (the slot engine's cache)
# -------------------------------------------------------------------------------------------------
def segmented_decode_attention(qkv, cos, sin, prompt_k, prompt_v, prompt_mask, completion_k,
                               completion_v, group_of, column, *, heads: int,
                               bias: jax.Array | None = None, scale: float | None = None):
    """One decode step's attention over the slot engine's two segments (`kv_segments`), as one
    kernel: the rotations, the cache writes and the attention; returns (out, completion_k,
    completion_v).

    qkv [n, (H + 2·KV)·d], cos, sin [n, d], ``heads``, ``bias`` and ``scale`` as
    `decode_attention`'s, for the first n slots; prompt_k [Q, KV, d, P], prompt_v [Q, KV, P, d],
    prompt_mask [Q, P]: each prompt slot's group's prompt; completion_k [S, KV, d, C],
    completion_v [S, KV, C, d] (S ≥ n): each slot's own completion, updated in place (the step's
    rotated k and its v written at the slot's ``column``); group_of, column [n]: each slot's
    prompt slot and the completion column it writes.

    out [n, H, d] (qkv's dtype) = softmax([q̃·K_p(g) | q̃·K_c(s)[≤ column]]·scale)·[V_p(g); V_c(s)]
    for slot s of group g: `kv_segments.segmented_attention`'s, one online softmax over the
    prompt's blocks and then the completion's (Milakov & Gimelshein 2018), the weights kept in
    fp32. One program per slot and query head: it reads its group's prompt, and its own
    completion only up to its own column, a loop whose trip count is the slot's (per row, not
    the longest row's). The first head of each KV group writes the slot's k and v; the own
    column is scored from k and v as computed, not read back from memory another program writes.
    """
    n = qkv.shape[0]
    kv_heads, head_dim, prompt_len = prompt_k.shape[1:]
    columns = completion_k.shape[3]
    per_kv, half = heads // kv_heads, head_dim // 2
    if qkv.shape[1] != (heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"segmented_decode_attention: qkv has {qkv.shape[1]} columns, not "
                         f"(H + 2·KV)·d = {(heads + 2 * kv_heads) * head_dim}")
    if head_dim & (head_dim - 1) or head_dim < 2:
        raise ValueError(f"segmented_decode_attention needs a head_dim that is a power of two, "
                         f"got {head_dim}")
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    prompt_block = min(SLOTS_PER_BLOCK, pl.next_power_of_2(prompt_len))
    block = min(SLOTS_PER_BLOCK, pl.next_power_of_2(columns))
    dtype = completion_k.dtype
    lowest = float(jnp.finfo(jnp.float32).min)
    every = pl.ds(0, head_dim)

    def kernel(*refs):
        if bias is None:
            (qkv_ref, cos_ref, sin_ref, pk_ref, pv_ref, pm_ref, group_ref, column_ref, _, __,
             out_ref, ck_ref, cv_ref) = refs
        else:
            (qkv_ref, bias_ref, cos_ref, sin_ref, pk_ref, pv_ref, pm_ref, group_ref, column_ref,
             _, __, out_ref, ck_ref, cv_ref) = refs
        # (the two unnamed inputs are the completion caches, the same buffers as ck_ref, cv_ref)
        slot, head = pl.program_id(0), pl.program_id(1)
        kv = head // per_kv
        g = group_ref[slot]
        at = jnp.clip(column_ref[slot], 0, columns - 1)
        first, second = pl.ds(0, half), pl.ds(half, half)
        q1, q2, k1, k2, v_new = _rotated_qkv(
            qkv_ref, None if bias is None else bias_ref, cos_ref, sin_ref, slot, head, kv,
            heads=heads, kv_heads=kv_heads, head_dim=head_dim, qkv_dtype=qkv.dtype, dtype=dtype)

        @pl.when(head % per_kv == 0)
        def _():
            _store(ck_ref, (slot, kv, first, at), k1)
            _store(ck_ref, (slot, kv, second, at), k2)
            _store(cv_ref, (slot, kv, at, every), v_new)

        q1, q2 = q1.astype(jnp.float32), q2.astype(jnp.float32)
        own = (jnp.sum(q1 * k1.astype(jnp.float32)) + jnp.sum(q2 * k2.astype(jnp.float32))) * scale

        def scored(ref, index, cols, inside):   # q̃ · the keys of ``cols``, two halves at a time
            keys1 = _load(ref, (*index, first, cols), mask=inside[None, :], other=0)
            keys2 = _load(ref, (*index, second, cols), mask=inside[None, :], other=0)
            return (jnp.sum(q1[:, None] * keys1.astype(jnp.float32), axis=0)
                    + jnp.sum(q2[:, None] * keys2.astype(jnp.float32), axis=0)) * scale

        def accumulate(carry, scores, values):
            top, total, acc = carry
            new_top = jnp.maximum(top, jnp.max(scores))
            weights = jnp.exp(scores - new_top)
            rescale = jnp.exp(top - new_top)
            acc = acc * rescale + jnp.sum(weights[:, None] * values, axis=0)
            return new_top, total * rescale + jnp.sum(weights), acc

        def prompt_step(i, carry):
            cols = pl.ds(i * prompt_block, prompt_block)
            inside = i * prompt_block + jnp.arange(prompt_block) < prompt_len
            scores = scored(pk_ref, (g, kv), cols, inside)
            visible = inside & (_load(pm_ref, (g, cols), mask=inside, other=0) != 0)
            scores = jnp.where(visible, scores, -jnp.inf)
            values = _load(pv_ref, (g, kv, cols, every), mask=inside[:, None], other=0)
            values = jnp.where(visible[:, None], values.astype(jnp.float32), 0.0)
            return accumulate(carry, scores, values)

        def completion_step(i, carry):
            cols = pl.ds(i * block, block)
            position = i * block + jnp.arange(block)
            inside = position < columns
            scores = scored(ck_ref, (slot, kv), cols, inside)
            is_own = position == at
            scores = jnp.where(is_own, own, scores)
            scores = jnp.where(position <= at, scores, -jnp.inf)
            values = _load(cv_ref, (slot, kv, cols, every), mask=inside[:, None], other=0)
            values = jnp.where(is_own[:, None], v_new[None, :], values).astype(jnp.float32)
            # (a weight of 0 times a stale value past the slot's column must stay 0: masked)
            values = jnp.where((position <= at)[:, None], values, 0.0)
            return accumulate(carry, scores, values)

        carry = (jnp.full((), lowest, jnp.float32), jnp.zeros((), jnp.float32),
                 jnp.zeros((head_dim,), jnp.float32))
        carry = jax.lax.fori_loop(0, pl.cdiv(prompt_len, prompt_block), prompt_step, carry)
        carry = jax.lax.fori_loop(0, at // block + 1, completion_step, carry)
        _, total, acc = carry
        _store(out_ref, (slot, head, every), (acc / total).astype(out_ref.dtype))

    operands = (((qkv,) if bias is None else (qkv, bias))
                + (cos, sin, prompt_k, prompt_v, prompt_mask.astype(jnp.int32),
                   group_of.astype(jnp.int32), column.astype(jnp.int32)))

    def call(interpret, *operands):
        return pl.pallas_call(
            kernel,
            out_shape=(jax.ShapeDtypeStruct((n, heads, head_dim), qkv.dtype),
                       jax.ShapeDtypeStruct(completion_k.shape, dtype),
                       jax.ShapeDtypeStruct(completion_v.shape, completion_v.dtype)),
            grid=(n, heads), input_output_aliases={len(operands) - 2: 1, len(operands) - 1: 2},
            compiler_params=_compiler_params(4), interpret=interpret,
            name="segmented_decode_attention",
        )(*operands)

    return _per_platform(call, *operands, completion_k, completion_v)
