"""A decode step's cache in two segments: each group's prompt once, each slot's completion its own.

The G rows of a GRPO group continue one prompt. A static batch holds that prompt's keys and
values G times and every decode step reads all G copies; here the cache splits in two:

    prompt segment      [Q prompt slots, KV, d, P] (K) and [Q, KV, P, d] (V), one group each
    completion segment  [S decode slots, KV, d, C] and [S, KV, C, d], one row each

and a decode step's attention for the row in slot s, of group q = group_of[s], is

    softmax([q_s·K_p(q) | q_s·K_c(s)] · scale) · [V_p(q); V_c(s)]

computed in two parts merged by log-sum-exp (as Hydragen and FlashInfer's cascade attention do):
each part i gives its running max mᵢ, its sum of exponentials lᵢ = Σ exp(sⱼ − mᵢ) and its
unnormalised output aᵢ = Σ exp(sⱼ − mᵢ)·vⱼ; with m = max(m₁, m₂) the output is

    (a₁·e^{m₁−m} + a₂·e^{m₂−m}) / (l₁·e^{m₁−m} + l₂·e^{m₂−m}),

the softmax over the concatenated keys, summed in another order. The prompt part reads each
group's prompt keys once for all its rows: the queries of a group's members (``members``
[Q, G], slot ids, S for an empty place) are gathered into one [Q, KV, G·H/KV, d] block and
multiplied by that group's K_p as one batched product. The completion part reads only the
columns a live row can see: blocks of ``BLOCK`` columns up to the longest live row's column
(``bound``), in a loop whose trip count is that bound, merged block by block the same way (on
XLA:CPU and a TPU; XLA:GPU reads a loop's trip condition on the host, one stall per layer and
step, so there every column is read, masked, as one part; a bound per row is the GPU kernel's,
`decode_kernels.segmented_decode_attention`, which a GPU decode step with kernels runs). A slot
reads its own columns ≤ its own (``column``), so a slot refilled by another row never sees the
columns its previous row wrote beyond the new row's length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# Completion columns read per block of a decode step's attention: the granularity of the live-
# length bound (at most BLOCK − 1 columns past the longest live row are read).
BLOCK = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentKV:
    """One layer's view of the two segments, and the slot table shared by every layer.

    prompt_k, prompt_v:         [Q, KV, d, P], [Q, KV, P, d]: each prompt slot's group's prompt.
    prompt_mask:                bool [Q, P]: its real tokens.
    completion_k, completion_v: [S, KV, d, C], [S, KV, C, d] (C a multiple of BLOCK).
    members:                    int32 [Q, G]: the slot of each of a group's rows, S when none.
    group_of, member_of:        int32 [S]: each slot's prompt slot and its place in members.
    column:                     int32 [S]: the completion column this step writes and reads up to.
    bound:                      int32 scalar: columns to read, max(column) + 1 over live slots.
    """

    prompt_k: jax.Array
    prompt_v: jax.Array
    prompt_mask: jax.Array
    completion_k: jax.Array
    completion_v: jax.Array
    members: jax.Array
    group_of: jax.Array
    member_of: jax.Array
    column: jax.Array
    bound: jax.Array

    def written(self, k: jax.Array, v: jax.Array) -> "SegmentKV":
        """The segments with each slot's new key k [S, KV, d] and value v [S, KV, d] at its column."""
        slots = jnp.arange(k.shape[0])
        completion_k = self.completion_k.at[slots, :, :, self.column].set(
            k.astype(self.completion_k.dtype), mode="drop")
        completion_v = self.completion_v.at[slots, :, self.column, :].set(
            v.astype(self.completion_v.dtype), mode="drop")
        return dataclasses.replace(self, completion_k=completion_k, completion_v=completion_v)


def _part(scores: jax.Array, visible: jax.Array, values, product: str):
    """(m, l, a) of one part: its max score, Σ exp(s − m) and Σ exp(s − m)·v over the visible
    keys (m = the float32 minimum where none is visible, and then l = 0, a = 0)."""
    low = jnp.finfo(jnp.float32).min
    scores = jnp.where(visible, scores, low)
    m = jnp.max(scores, axis=-1)
    e = jnp.where(visible, jnp.exp(scores - m[..., None]), 0.0)
    return m, jnp.sum(e, axis=-1), jnp.einsum(product, e.astype(values.dtype), values,
                                              preferred_element_type=jnp.float32)


def _merge(first, second):
    """The (m, l, a) of two parts' keys together: each rescaled to the larger max."""
    (m1, l1, a1), (m2, l2, a2) = first, second
    m = jnp.maximum(m1, m2)
    w1, w2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return m, l1 * w1 + l2 * w2, a1 * w1[..., None] + a2 * w2[..., None]


COMPLETION_READS = ("auto", "bounded", "whole")


def segmented_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: SegmentKV,
                        scale: float, completion_read: str = "auto") -> tuple[jax.Array, SegmentKV]:
    """(attention output [n, H, d] in v's dtype, the segments with k, v written) for one decode
    step of the first n slots: q [n, H, d] (rotated), k and v [n, KV, d] the step's own key and
    value (rotated k); ``column``, ``group_of`` and ``member_of`` are those n slots'; the
    completion segment may hold more slots (a batch shrunk to its live rows, `rl.sampler.slots`),
    which this step neither reads nor writes, and a member id ≥ n counts as an empty place. The
    math is in the module docstring.

    ``completion_read``: "bounded" (blocks up to the live bound), "whole" (every column masked)
    or "auto": whole on XLA:GPU, bounded elsewhere (module docstring). A GPU decode step with
    kernels (one GPU, `decode_kernels.fits`) runs `decode_kernels.segmented_decode_attention`
    instead, which reads each slot's own columns only."""
    if completion_read not in COMPLETION_READS:
        raise ValueError(f"completion_read must be one of {COMPLETION_READS}, got {completion_read!r}")
    args = (q, k, v, segments)   # (the scale stays a Python float)
    if completion_read == "auto":
        return jax.lax.platform_dependent(
            *args, default=functools.partial(_xla_attention, scale=scale, read="bounded"),
            cuda=functools.partial(_xla_attention, scale=scale, read="whole"),
            rocm=functools.partial(_xla_attention, scale=scale, read="whole"))
    return _xla_attention(*args, scale=scale, read=completion_read)


def _xla_attention(q, k, v, segments: SegmentKV, *, scale: float, read: str):
    """`segmented_attention` in XLA's ops, the completion read "bounded" or "whole".

    The step's key and value are written first and the blocks read from the written segment:
    written after the reads, XLA:CPU copied each layer's whole segment twice per step to keep
    the unwritten version alive for them."""
    segments = segments.written(k, v)
    num_slots, num_heads, head_dim = q.shape
    num_groups, kv_heads = segments.prompt_k.shape[:2]
    per_kv = num_heads // kv_heads
    group_size = segments.members.shape[1]
    q = q.reshape(num_slots, kv_heads, per_kv, head_dim)

    # The prompt part, one product per prompt slot over all of its members' queries.
    padded = jnp.concatenate([q, jnp.zeros_like(q[:1])])            # slot n: an empty place
    grouped = padded[jnp.minimum(segments.members, num_slots)]      # [Q, G, KV, h, d]
    grouped = grouped.transpose(0, 2, 1, 3, 4).reshape(num_groups, kv_heads, group_size * per_kv,
                                                       head_dim)
    scores = jnp.einsum("qkmd,qkdp->qkmp", grouped, segments.prompt_k,
                        preferred_element_type=jnp.float32) * scale
    prompt = _part(scores, segments.prompt_mask[:, None, None, :], segments.prompt_v,
                   "qkmp,qkpd->qkmd")

    def per_slot(x):   # [Q, KV, G·h, …] → the slot's own [S, KV, h, …]
        x = x.reshape(num_groups, kv_heads, group_size, per_kv, *x.shape[3:]).swapaxes(1, 2)
        return x.reshape(num_groups * group_size, kv_heads, per_kv, *x.shape[4:])[
            segments.group_of * group_size + segments.member_of]

    state = jax.tree.map(per_slot, prompt)

    # The completion part, BLOCK columns at a time up to the live bound.
    def block(j, state):
        start = j * BLOCK
        keys = jax.lax.dynamic_slice(segments.completion_k, (0, 0, 0, start),
                                     (num_slots, kv_heads, head_dim, BLOCK))
        values = jax.lax.dynamic_slice(segments.completion_v, (0, 0, start, 0),
                                       (num_slots, kv_heads, BLOCK, head_dim))
        scores = jnp.einsum("skhd,skdc->skhc", q, keys, preferred_element_type=jnp.float32) * scale
        columns = start + jnp.arange(BLOCK)
        visible = (columns[None, :] <= segments.column[:, None])[:, None, None, :]
        return _merge(state, _part(scores, visible, values, "skhc,skcd->skhd"))

    def bounded(state):   # the blocks up to the live bound, a loop of a dynamic trip count
        return jax.lax.fori_loop(0, (segments.bound + BLOCK - 1) // BLOCK, block, state)

    def whole(state):     # every column in one masked part: XLA:GPU tests a loop's condition
        # on the host, and the blocks unrolled were two GEMMs and a merge each (24 per layer at
        # 1,536 columns: twice the static step's kernels); one part reads the same bytes.
        keys = segments.completion_k[:num_slots]
        values = segments.completion_v[:num_slots]
        scores = jnp.einsum("skhd,skdc->skhc", q, keys, preferred_element_type=jnp.float32) * scale
        columns = jnp.arange(keys.shape[3])
        visible = (columns[None, :] <= segments.column[:, None])[:, None, None, :]
        return _merge(state, _part(scores, visible, values, "skhc,skcd->skhd"))

    m, l, a = (bounded if read == "bounded" else whole)(state)
    out = a / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_slots, num_heads, head_dim).astype(v.dtype), segments
