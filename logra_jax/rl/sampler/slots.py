"""The slot engine: the whole rollout batch flows through a fixed set of decode slots.

A static batch prefills every row's prompt, holds its KV G times and decodes until its longest
row ends. Here, inside one jitted program:

- a group (the G rows of one prompt) is admitted when G decode slots and one prompt slot are
  free: its prompt is prefilled once, its keys and values go to the prompt slot, its G first
  tokens are drawn from that one prefill's logits, and its rows take the G slots;
- every decode step runs all slots at once; each row reads its group's prompt once per group and
  its own completion up to its own length (`models.kv_segments`);
- a row that draws EOS (or its last column) stops recording; its slot is freed at the next
  boundary (every ``REFILL_EVERY`` steps on a GPU, every step elsewhere), and freed slots take
  the next group's rows;
- the program ends when the last row has ended, not when every pass's longest row has.

Each row's tokens come from `draw` keyed by its index in the rollout batch and its token's
position, so they are the static engine's tokens wherever the model's logits are the same (the
attention sums its two parts in another order: equal up to a near-tie of perturbed logits).

``SampleOutput.token_steps`` counts, per row, the decode steps its slot ran while the row held it
(the draws it kept and the ones its slot idled until the boundary freed it), plus its prefill
draw; the steps of a slot nobody held are not counted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logra_jax.models.kv_segments import BLOCK, SegmentKV
from logra_jax.rl.sampler.draw import draw, first_argmax
from logra_jax.rl.sampler.output import SampleOutput
from logra_jax.rl.sampler.prompts import left_align

# Decode steps between two refills of freed slots on a GPU (each refill test is a read on the
# host, as `static.DECODE_CHUNK`'s): a row that ends idles its slot for up to REFILL_EVERY − 1
# steps there. Elsewhere slots are refilled after every step.
REFILL_EVERY = 16
CHUNKED_PLATFORMS = ("cuda", "rocm")


def check_slots(batch: int, group_size: int, slots: int, prompt_slots: int) -> None:
    """Raises unless ``batch`` rows split into groups of ``group_size`` and the slots hold a group."""
    if group_size < 1 or batch % group_size:
        raise ValueError(f"a batch of {batch} rows does not split into groups of {group_size} "
                         f"(rl.num_generations)")
    if slots < group_size or slots % group_size:
        raise ValueError(f"rl.rollout_slots={slots} must be a positive multiple of the group size "
                         f"{group_size} (rl.num_generations)")
    if prompt_slots < 1:
        raise ValueError(f"the slot engine needs at least one prompt slot, got {prompt_slots}")


def executed_sizes(slots: int) -> tuple[int, ...]:
    """The batch sizes the engine compiles a step for, largest first: every slot, then the powers
    of two below it. (Sizes 3·2ᵏ between them would waste fewer row-steps in the tail, 0.73 →
    0.86 of the reference batch's row-steps kept, `launch.cost`; a tail step on a GPU reads the
    weights whatever its size, so its bytes barely move, and each size is one more loop to
    compile.)"""
    return tuple(sorted({slots} | {2 ** i for i in range(slots.bit_length()) if 2 ** i < slots},
                        reverse=True))


def default_prompt_slots(batch: int, slots: int, group_size: int) -> int:
    """The prompt slots a `Sampler` of ``slots`` decode slots holds unless told: twice the groups
    the decode slots hold (a group's prompt stays while its slowest row decodes, so the next
    groups need prompt slots of their own), at most the batch's groups."""
    return min(batch, 2 * slots) // group_size


def generate_in_slots(model, probes, prompt_tokens, prompt_mask, rng, temperature, *,
                      group_size: int, slots: int, prompt_slots: int, max_completion_length: int,
                      eos_ids, pad_id: int, top_k: int, top_p: float, greedy: bool,
                      limits, layers=None, kernels: bool = False) -> SampleOutput:
    """The completions of every row of ``prompt_tokens`` [B, P] (groups of ``group_size``
    adjacent rows share a prompt), decoded through ``slots`` decode slots and ``prompt_slots``
    prompt slots. ``layers``: the per-layer weights (`Decoder.unstacked_layers`), made here when
    None. ``limits`` (int32 [B]): the most tokens each row may draw. ``kernels``: each decode
    step's norms and attention as decode_kernels.py's kernels (one GPU; ``layers`` then with q,
    k and v's kernels as one, `llama.fuse_qkv_kernels`). The rest as `Sampler.generate`."""
    batch, prompt_len = prompt_tokens.shape
    check_slots(batch, group_size, slots, prompt_slots)
    c = model.config
    groups = batch // group_size
    columns = max_completion_length
    capacity = -(-columns // BLOCK) * BLOCK
    eos = jnp.asarray(eos_ids, jnp.int32)
    prompt_tokens, prompt_mask = left_align(prompt_tokens, prompt_mask, pad_id)
    group_tokens, group_mask = prompt_tokens[::group_size], prompt_mask[::group_size]
    group_lengths = jnp.sum(group_mask, axis=1).astype(jnp.int32)
    if layers is None:
        layers = model.unstacked_layers()
    dtype = c.compute_dtype
    kv, d, L = c.num_kv_heads, c.head_dim, c.num_layers
    member_ids = jnp.arange(group_size, dtype=jnp.int32)

    state = dict(
        prompt_k=tuple(jnp.zeros((prompt_slots, kv, d, prompt_len), dtype) for _ in range(L)),
        prompt_v=tuple(jnp.zeros((prompt_slots, kv, prompt_len, d), dtype) for _ in range(L)),
        prompt_mask=jnp.zeros((prompt_slots, prompt_len), bool),
        members=jnp.full((prompt_slots, group_size), slots, jnp.int32),
        row=jnp.full((slots,), batch, jnp.int32),        # batch: none (writes are dropped)
        live=jnp.zeros((slots,), bool),
        group_of=jnp.zeros((slots,), jnp.int32),
        member_of=jnp.zeros((slots,), jnp.int32),
        column=jnp.zeros((slots,), jnp.int32),            # the column of the token to feed
        token=jnp.zeros((slots,), jnp.int32),
        start=jnp.zeros((slots,), jnp.int32),             # the RoPE position of column 0
        next_group=jnp.int32(0),
        tokens=jnp.full((batch, columns), pad_id, jnp.int32),
        logprobs=jnp.zeros((batch, columns), jnp.float32),
        mask=jnp.zeros((batch, columns), bool),
        finished=jnp.zeros((batch,), bool),
        token_steps=jnp.zeros((batch,), jnp.int32),
    )
    # The completion segment, every layer's (K, V), apart from the state: admitting a group
    # (a loop of its own) neither reads nor carries it.
    cache = (tuple(jnp.zeros((slots, kv, d, capacity), dtype) for _ in range(L)),
             tuple(jnp.zeros((slots, kv, capacity, d), dtype) for _ in range(L)))
    sizes = executed_sizes(slots)[::-1]   # smallest first

    def pick(logits_t, positions, rows):
        return draw(logits_t, rng, positions, rows, temperature=temperature, greedy=greedy,
                    top_k=top_k, top_p=top_p)

    def can_admit(s):
        """Whether a group waits and G decode slots and a prompt slot are free."""
        return ((s["next_group"] < groups) & (jnp.sum(~s["live"]) >= group_size)
                & jnp.any(jnp.all(s["members"] == slots, axis=1)))

    def admit(s):
        """One group: one prefill, its G first draws, its rows into the first G free slots."""
        g = s["next_group"]
        q = first_argmax(jnp.all(s["members"] == slots, axis=1), axis=0)   # a free prompt slot
        free = jnp.argsort(s["live"], stable=True)[:group_size]            # the first free slots
        tokens_g = jax.lax.dynamic_index_in_dim(group_tokens, g, keepdims=True)
        mask_g = jax.lax.dynamic_index_in_dim(group_mask, g, keepdims=True)
        positions = jnp.maximum(jnp.cumsum(mask_g, axis=1) - 1, 0).astype(jnp.int32)
        hidden, cache = model(tokens_g, positions=positions, segment_mask=mask_g,
                              cache=model.init_cache(1, prompt_len), return_hidden=True,
                              probes=probes, prefill=True)
        logits_t = jnp.broadcast_to(model.vocab_major_logits(hidden[:, -1]),
                                    (c.vocab_size, group_size))
        rows = g * group_size + member_ids
        token, logprob = pick(logits_t, jnp.zeros((group_size,), jnp.int32), rows)
        ended = jnp.isin(token, eos) | (limits[rows] <= 1)
        s = dict(s)
        s["prompt_k"] = tuple(p.at[q].set(cache.k[l, 0]) for l, p in enumerate(s["prompt_k"]))
        s["prompt_v"] = tuple(p.at[q].set(cache.v[l, 0]) for l, p in enumerate(s["prompt_v"]))
        s["prompt_mask"] = s["prompt_mask"].at[q].set(mask_g[0])
        s["members"] = s["members"].at[q].set(jnp.where(ended, slots, free))
        s["row"] = s["row"].at[free].set(rows)
        s["live"] = s["live"].at[free].set(~ended)
        s["group_of"] = s["group_of"].at[free].set(q)
        s["member_of"] = s["member_of"].at[free].set(member_ids)
        s["column"] = s["column"].at[free].set(0)
        s["token"] = s["token"].at[free].set(token)
        s["start"] = s["start"].at[free].set(group_lengths[g])
        s["tokens"] = s["tokens"].at[rows, 0].set(token)
        s["logprobs"] = s["logprobs"].at[rows, 0].set(logprob)
        s["mask"] = s["mask"].at[rows, 0].set(True)
        s["finished"] = s["finished"].at[rows].set(jnp.isin(token, eos))
        s["token_steps"] = s["token_steps"].at[rows].set(1)
        s["next_group"] = g + 1
        return s

    def step(n):
        """One decode step of the first ``n`` slots: feed each its last token, draw the next
        where live (slots past n hold no live row, `compact`)."""
        def run(carry):
            s, (completion_k, completion_v) = carry
            first = lambda x: x[:n]
            live, row, column = first(s["live"]), first(s["row"]), first(s["column"])
            bound = jnp.max(jnp.where(live, column, 0)) + 1
            segments = tuple(SegmentKV(pk, pv, s["prompt_mask"], ck, cv, s["members"],
                                       first(s["group_of"]), first(s["member_of"]), column, bound)
                             for pk, pv, ck, cv in zip(s["prompt_k"], s["prompt_v"],
                                                       completion_k, completion_v))
            hidden, segments = model.decode_segments(first(s["token"]), first(s["start"]) + column,
                                                     segments, layers=layers, probes=probes,
                                                     kernels=kernels)
            column = column + 1
            token, logprob = pick(model.vocab_major_logits(hidden), column, row)
            kept = jnp.where(live, row, batch)             # batch: dropped
            is_eos = jnp.isin(token, eos)
            s = dict(s)
            s["tokens"] = s["tokens"].at[kept, column].set(token, mode="drop")
            s["logprobs"] = s["logprobs"].at[kept, column].set(logprob, mode="drop")
            s["mask"] = s["mask"].at[kept, column].set(True, mode="drop")
            s["finished"] = s["finished"].at[kept].set(is_eos, mode="drop")
            s["token_steps"] = s["token_steps"].at[row].add(1, mode="drop")
            ends = is_eos | (column + 1 >= limits[jnp.minimum(row, batch - 1)])
            s["live"] = s["live"].at[:n].set(live & ~ends)
            s["column"] = s["column"].at[:n].set(jnp.where(live, column, s["column"][:n]))
            s["token"] = s["token"].at[:n].set(token)
            return s, (tuple(x.completion_k for x in segments),
                       tuple(x.completion_v for x in segments))
        return run

    def chunk(n):
        """A GPU's REFILL_EVERY steps of the first ``n`` slots between two reads on the host;
        XLA:CPU and a TPU test their loops where they run, so there one step at a time."""
        many = lambda carry: jax.lax.fori_loop(0, REFILL_EVERY, lambda _, c: step(n)(c), carry)
        return lambda carry: jax.lax.platform_dependent(
            carry, default=step(n), **dict.fromkeys(CHUNKED_PLATFORMS, many))

    def release(s):
        """At a boundary: ended rows leave their groups' member lists (a group whose rows have
        all ended frees its prompt slot)."""
        members = s["members"]
        held = jnp.concatenate([s["live"], jnp.zeros((1,), bool)])[members]
        return dict(s, members=jnp.where(held, members, slots))

    def compact(carry):
        """The live rows moved to the first slots (stable), the member lists renumbered: one
        gather of the slots' state and completion caches, once per executed size."""
        s, cache = carry
        s = release(s)
        order = jnp.argsort(~s["live"], stable=True)
        new_id = jnp.zeros((slots + 1,), jnp.int32).at[order].set(
            jnp.arange(slots, dtype=jnp.int32)).at[slots].set(slots)
        s = dict(s, members=new_id[s["members"]])
        for name in ("row", "live", "group_of", "member_of", "column", "token", "start"):
            s[name] = s[name][order]
        return s, jax.tree.map(lambda x: x[order], cache)

    def admission(carry):
        """While groups wait: free ended rows' places, admit what fits, decode every slot."""
        s, cache = carry
        s = jax.lax.while_loop(can_admit, admit, release(s))
        return chunk(slots)((s, cache))

    carry = jax.lax.while_loop(lambda c: c[0]["next_group"] < groups, admission, (state, cache))
    # No group waits: the executed batch shrinks to the smallest size that holds the live rows,
    # one loop per size (a loop per size, not a branch per step: a conditional taken every step
    # copied the caches in and out of it every step).
    for i in reversed(range(len(sizes))):
        smaller = sizes[i - 1] if i else 0
        if sizes[i] < slots:
            carry = compact(carry)
        carry = jax.lax.while_loop(lambda c, smaller=smaller: jnp.sum(c[0]["live"]) > smaller,
                                   chunk(sizes[i]), carry)
    s = carry[0]
    return SampleOutput(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=s["tokens"],
                        logprobs=s["logprobs"], mask=s["mask"], finished=s["finished"],
                        token_steps=s["token_steps"])
