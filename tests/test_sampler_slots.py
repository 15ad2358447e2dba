"""The slot engine (rl/sampler/slots.py) against the static engine, and its two-segment attention
(models/kv_segments.py) against one softmax over the concatenated keys."""

import dataclasses
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models import Decoder, decode_kernels
from logra_jax.models.config import tiny
from logra_jax.models.kv_segments import BLOCK, SegmentKV, segmented_attention
from logra_jax.rl.policy import Policy
from logra_jax.rl.sampler import Sampler, pad_prompts, slot_schedule
from logra_jax.rl.sampler.slots import default_prompt_slots
from tolerance import assert_close_up_to_order

PAD, PROMPT_LEN, STEPS, GROUP = 0, 8, 40, 4
# Four prompts of four rows each; EOS ids chosen so that with key 3 siblings end far apart (2 vs
# 40 tokens) and one row ends on its first token (checked below, not assumed).
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3], [40, 41]]
EOS = [2, 7, 11, 13]


@pytest.fixture(scope="module")
def engines():
    model = Decoder(tiny(), rngs=nnx.Rngs(0))   # float32 weights and activations
    policy = Policy(model)
    params = Policy.params_of(model)
    tokens, mask = pad_prompts([p for p in PROMPTS for _ in range(GROUP)], PROMPT_LEN, PAD)
    kw = dict(max_prompt_length=PROMPT_LEN, max_completion_length=STEPS, eos_ids=EOS, pad_id=PAD)
    static = Sampler(policy, **kw)
    # 8 slots for 16 rows: half the groups wait for slots that rows of earlier groups free.
    slots = Sampler(policy, engine="slots", group_size=GROUP, slots=8, **kw)
    return params, tokens, mask, static, slots


def _same_completions(a, b):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.mask, b.mask)
    np.testing.assert_array_equal(a.finished, b.finished)
    np.testing.assert_allclose(b.logprobs, a.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("draw", [dict(), dict(top_k=5), dict(top_p=0.9, temperature=0.7),
                                  dict(greedy=True)], ids=["sampled", "top_k", "top_p", "greedy"])
def test_the_slot_engine_draws_the_static_engines_tokens(engines, draw):
    """Token for token, whatever the schedule: rows refilled into freed slots, siblings ending far
    apart, a row ending on its first token; log-probs within 1e-5."""
    params, tokens, mask, static, slots = engines
    key = jax.random.key(3)
    want = static.generate(params, tokens, mask, key, **draw)
    got = slots.generate(params, tokens, mask, key, **draw)
    _same_completions(want, got)
    if not draw:   # the schedule this test claims to cover
        lengths = np.asarray(want.mask).sum(axis=1)
        assert lengths.min() == 1 and lengths.max() == STEPS, lengths
        per_group = lengths.reshape(-1, GROUP)
        assert (per_group.max(axis=1) - per_group.min(axis=1)).max() >= STEPS // 2, per_group


def test_rows_forced_to_their_lengths_end_there_in_both_engines(engines):
    """`Sampler.generate`'s ``lengths``: a row draws at most its length (a benchmark's schedule),
    ends unfinished there unless it drew EOS first, and both engines draw the same tokens."""
    params, tokens, mask, static, slots = engines
    key = jax.random.key(3)
    lengths = np.array([1, 40, 3, 17] * GROUP, np.int32)
    free = static.generate(params, tokens, mask, key)
    want = static.generate(params, tokens, mask, key, lengths=lengths)
    got = slots.generate(params, tokens, mask, key, lengths=lengths)
    _same_completions(want, got)
    free_lengths = np.asarray(free.mask).sum(axis=1)
    np.testing.assert_array_equal(np.asarray(want.mask).sum(axis=1), np.minimum(free_lengths, lengths))
    np.testing.assert_array_equal(want.finished, np.asarray(free.finished) & (free_lengths <= lengths))
    assert slots.prefilled_rows(len(lengths)) == len(lengths) // GROUP
    assert static.prefilled_rows(len(lengths)) == len(lengths)


def test_the_slot_engine_runs_fewer_row_steps_than_a_static_batch(engines):
    """The work a row's slot ran: its kept draws and the idle steps until a boundary freed it;
    never less than its length, and in all fewer than the static batch's rows × longest row."""
    params, tokens, mask, static, slots = engines
    key = jax.random.key(3)
    want, got = static.generate(params, tokens, mask, key), slots.generate(params, tokens, mask, key)
    lengths = np.asarray(got.mask).sum(axis=1)
    steps = np.asarray(got.token_steps)
    assert (steps >= lengths).all(), (steps, lengths)
    assert steps.sum() < np.asarray(want.token_steps).sum(), (steps.sum(), want.token_steps)


def test_the_replayed_schedule_is_the_one_the_engine_ran(engines):
    """`slot_schedule.replay` (what launch.cost counts a rollout's steps by) gives, from the
    kept lengths alone, each row's token steps exactly as the engine counted them: groups
    admitted into the lowest freed slots, idle steps, compaction to smaller sizes. Two
    schedules: the free draw (EOS ends rows) and rows forced to their lengths."""
    params, tokens, mask, _, slots = engines
    key = jax.random.key(3)
    for lengths in (None, np.array([1, 40, 3, 17] * GROUP, np.int32)):
        got = slots.generate(params, tokens, mask, key, lengths=lengths)
        kept = np.asarray(got.mask).sum(axis=1)
        schedule = slot_schedule.replay(kept, group_size=GROUP, slots=8,
                                        prompt_slots=default_prompt_slots(len(kept), 8, GROUP),
                                        refill_every=1)
        np.testing.assert_array_equal(schedule.token_steps, got.token_steps)
        assert schedule.groups == len(PROMPTS) and schedule.sizes == (8, 4, 2, 1)
        assert schedule.row_steps >= schedule.token_steps.sum()


def _segments(rng, *, groups, group_size, slots, kv, heads, d, prompt, capacity, columns,
              members, group_of, member_of, stale, past_bound=jnp.nan):
    """Random segments with ``stale`` in every completion column past each slot's own (what a
    refilled slot's previous row left there) and ``past_bound`` in every block past the live
    bound."""
    k1, k2, k3, k4 = jax.random.split(rng, 4)
    prompt_k = jax.random.normal(k1, (groups, kv, d, prompt))
    prompt_v = jax.random.normal(k2, (groups, kv, prompt, d))
    prompt_mask = jnp.arange(prompt)[None, :] >= jnp.array([[0], [3]])[:groups]
    column = jnp.asarray(columns, jnp.int32)
    bound = int(column.max()) + 1
    cols = jnp.arange(capacity)
    past_own = cols[None, :] > column[:, None]
    beyond = cols >= -(-bound // BLOCK) * BLOCK
    def fill(x, axis):
        shape = [1] * x.ndim
        shape[0], shape[axis] = slots, capacity
        x = jnp.where(past_own.reshape(shape), stale, x)
        shape[0] = 1
        return jnp.where(beyond.reshape(shape), past_bound, x)
    completion_k = fill(jax.random.normal(k3, (slots, kv, d, capacity)), 3)
    completion_v = fill(jax.random.normal(k4, (slots, kv, capacity, d)), 2)
    return SegmentKV(prompt_k, prompt_v, prompt_mask, completion_k, completion_v,
                     jnp.asarray(members, jnp.int32), jnp.asarray(group_of, jnp.int32),
                     jnp.asarray(member_of, jnp.int32), column, jnp.int32(bound))


@pytest.mark.parametrize("read", ["bounded", "whole", "kernel"])
def test_two_segments_merged_by_log_sum_exp_are_one_softmax(read):
    """Each live slot's output is softmax over [its group's prompt keys | its own completion
    columns ≤ its column], summed in another order. Stale values (1e4) past a slot's column
    leave it unchanged: a refilled slot reads no column of its previous row. Read in blocks up
    to the live bound (XLA:CPU, TPU), NaN in the blocks past it leaves it unchanged too: none of
    them is read. Read whole (XLA:GPU without the kernel), every column past a slot's own is stale
    and masked. The GPU's kernel (`decode_kernels.segmented_decode_attention`, here through
    Pallas' interpreter) reads each slot's own columns only: NaN past them changes nothing."""
    kv, heads, d, prompt, group_size, slots = 2, 4, 8, 6, 3, 4
    capacity = 3 * BLOCK
    members = [[0, 2, 4], [1, 3, 4]]    # slot 4 = none: each group's third row has ended
    group_of, member_of = [0, 1, 0, 1], [0, 0, 1, 1]
    columns = [5, BLOCK + 3, 0, 17]     # slot 1 reaches into the second block; none the third
    segments = _segments(jax.random.key(0), groups=2, group_size=group_size, slots=slots, kv=kv,
                         heads=heads, d=d, prompt=prompt, capacity=capacity, columns=columns,
                         members=members, group_of=group_of, member_of=member_of,
                         stale=jnp.nan if read == "kernel" else 1e4,
                         past_bound=1e4 if read == "whole" else jnp.nan)
    q = jax.random.normal(jax.random.key(1), (slots, heads, d))
    k_new = jax.random.normal(jax.random.key(2), (slots, kv, d))
    v_new = jax.random.normal(jax.random.key(3), (slots, kv, d))
    scale = 1 / math.sqrt(d)
    if read == "kernel":   # q, k and v side by side, rotated by the identity (cos 1, sin 0)
        qkv = jnp.concatenate([x.reshape(slots, -1) for x in (q, k_new, v_new)], axis=1)
        ones = jnp.ones((slots, d))
        out, completion_k, completion_v = jax.jit(
            decode_kernels.segmented_decode_attention, static_argnames=("heads", "scale"))(
            qkv, ones, ones * 0, segments.prompt_k, segments.prompt_v, segments.prompt_mask,
            segments.completion_k, segments.completion_v, segments.group_of, segments.column,
            heads=heads, scale=scale)
        written = dataclasses.replace(segments, completion_k=completion_k,
                                      completion_v=completion_v)
    else:
        out, written = jax.jit(segmented_attention, static_argnums=(4, 5))(
            q, k_new, v_new, segments, scale, read)
    for s in range(slots):
        g, n = group_of[s], columns[s] + 1
        keys = np.concatenate([np.asarray(segments.prompt_k[g])[..., np.asarray(segments.prompt_mask[g])],
                               np.asarray(written.completion_k[s, :, :, :n])], axis=-1)
        values = np.concatenate([np.asarray(segments.prompt_v[g])[:, np.asarray(segments.prompt_mask[g])],
                                 np.asarray(written.completion_v[s, :, :n])], axis=1)
        np.testing.assert_array_equal(written.completion_k[s, :, :, columns[s]], k_new[s])
        per_kv = heads // kv
        qs = np.asarray(q[s]).reshape(kv, per_kv, d)
        scores = np.einsum("khd,kdn->khn", qs, keys) * scale
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        want = np.einsum("khn,knd->khd", weights, values).reshape(heads, d)
        assert_close_up_to_order(out[s], want, [d, keys.shape[-1], keys.shape[-1]],
                                 err_msg=f"slot {s}")


def test_a_groups_prompt_keys_are_read_once_for_all_its_rows():
    """No array of one prompt's keys or values per slot appears in the attention's program: the
    prompt part multiplies each prompt slot's keys by its members' queries, gathered."""
    kv, heads, d, prompt, group_size, slots = 2, 4, 8, 6, 3, 6
    segments = _segments(jax.random.key(0), groups=2, group_size=group_size, slots=slots, kv=kv,
                         heads=heads, d=d, prompt=prompt, capacity=BLOCK, columns=[1] * slots,
                         members=[[0, 1, 2], [3, 4, 5]], group_of=[0, 0, 0, 1, 1, 1],
                         member_of=[0, 1, 2, 0, 1, 2], stale=0.0)
    q = jnp.zeros((slots, heads, d))
    k_new = v_new = jnp.zeros((slots, kv, d))
    jaxpr = jax.make_jaxpr(segmented_attention, static_argnums=4)(q, k_new, v_new, segments, 1.0)
    shapes = set()
    def collect(jaxpr):
        for eqn in jaxpr.eqns:
            shapes.update(tuple(v.aval.shape) for v in eqn.outvars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                collect(sub)
    collect(jaxpr.jaxpr)
    per_slot = {(slots, kv, d, prompt), (slots, kv, prompt, d)}
    assert not shapes & per_slot, f"the prompt's keys or values copied per slot: {shapes & per_slot}"
