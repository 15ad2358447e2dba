"""The draw: one token per row from a decode step's logits, at a temperature, with top-k / top-p.

Every draw is Gumbel-max over counter-hashed noise (`gumbel_max` says why), and the noise of a
row's token is a function of the run's key, the row's index in the rollout batch and the token's
position in its completion only (`gumbel_max`'s ``rows`` and ``positions``): never of the slot
that decodes the row, the pass it is in or the loop step at which it is scheduled. So any
schedule of the same rows (one pass, passes of rows, slots refilled as rows end) draws the same
tokens wherever the model gives the same logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logra_jax.projections import check_counter_range, hash_positions, hash_words

NEG_INF = -1e30


def first_argmax(x: jax.Array, axis: int) -> jax.Array:
    """jnp.argmax(x, axis): the first maximum's index, or the first NaN's.

    XLA's CPU backend runs argmax, a reduction over (value, index) pairs, as a scalar loop: over
    16 × 49 152 logits it took 3.3× as long as a max, then the smallest index holding it, which is
    what a program compiled for XLA:CPU runs (`jax.lax.platform_dependent`). Elsewhere argmax's
    own one-pass reduction (two passes over a [V, 64] f32 array are 39 MB more per decode step).
    Both give the same index.
    """
    def two_reductions(x):
        top = jnp.max(x, axis=axis, keepdims=True)
        index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis % x.ndim)
        at_top = (x == top) | jnp.isnan(x)
        return jnp.min(jnp.where(at_top, index, x.shape[axis]), axis=axis)

    return jax.lax.platform_dependent(
        x, cpu=two_reductions, default=lambda x: jnp.argmax(x, axis=axis).astype(jnp.int32))


def token_words(key: jax.Array, positions: jax.Array) -> jax.Array:
    """uint32 [2, rows]: the hash words of each row's token, those of fold_in(key, position) for
    its completion position ``positions`` (int32 [rows]): the noise of a token is keyed by its
    position, never by the loop step that draws it."""
    return jax.vmap(lambda p: hash_words(jax.random.fold_in(key, p)))(positions).T


def gumbel_noise(key: jax.Array, positions: jax.Array, words: jax.Array | None = None) -> jax.Array:
    """−log(−log u) for the logits at row-major ``positions`` (uint32) of a [rows, V] array, u
    from the counter hash (`gumbel_max` says why and how); ``words``: [2, …] hash words
    broadcast against ``positions`` (`token_words`), default those of ``key``."""
    u = ((hash_positions(key, positions, words) >> 8).astype(jnp.float32) + 0.5) * (2.0 ** -24)
    return jnp.log(-jnp.log(u))


def gumbel_max(key: jax.Array, logits: jax.Array, *, vocab_axis: int = -1,
               rows: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
    """One draw per row from softmax(logits) (int32 [rows]), by the Gumbel-max trick:

        token = argmax_v (logits_v + g_v),   g_v = −log(−log u_v),   u_v ~ U(0, 1) independent

    (argmax of logits plus independent standard Gumbel noise is distributed as softmax(logits)).
    ``logits``: [rows, V], or [V, rows] with ``vocab_axis=0`` (how a decode step's head writes
    them, `Decoder.vocab_major_logits`); either layout draws the same tokens. u comes from the
    counter hash `projections.hashed_bits`, one 32-bit word per logit at its row-major position
    in the [rows, V] array, whose top 24 bits pick the centre of one of 2²⁴ equal bins:
    u ∈ [2⁻²⁵, 1 − 2⁻²⁵], so g ∈ [−2.85, 17.33] (a standard Gumbel leaves that range with
    probability 3·10⁻⁸). Why not `jax.random.categorical`, which does the same with threefry
    bits: XLA's CPU backend runs threefry as a loop of rounds, ~16 ms of a 100 ms SmolLM2 decode
    step at batch 16 (docs/results/sampler.md); hashed bits fuse into the argmax. Like
    threefry's, they are a function of the key and each logit's global position, so a batch
    split over other devices or processes draws the same tokens. Gumbel-max, not an inverse-CDF
    draw: a last-bit change of the logits (another layout sums in another order) flips its token
    only at a near-tie of the two largest perturbed logits. ``rows`` (int32 [rows]): the row
    each logits row stands for in a larger batch (default 0, 1, …): a batch drawn in parts
    (`Sampler`'s ``rows_per_pass``) draws each row's noise from the same positions as one pass.
    ``positions`` (int32 [rows]): each row's token position in its completion; the row's noise
    then comes from the words of fold_in(key, position) (`token_words`), so a row's t-th token
    draws the same noise whichever step of whichever schedule draws it.
    """
    if logits.ndim != 2:
        raise ValueError(f"gumbel_max takes [rows, V] or [V, rows] logits, got shape {logits.shape}")
    vocab_axis %= 2
    check_counter_range(logits.shape)
    vocab = logits.shape[vocab_axis]
    row = jax.lax.broadcasted_iota(jnp.uint32, logits.shape, 1 - vocab_axis)
    if rows is not None:
        row = jnp.expand_dims(rows.astype(jnp.uint32), vocab_axis) + jnp.zeros_like(row)
    position = row * jnp.uint32(vocab) + jax.lax.broadcasted_iota(jnp.uint32, logits.shape, vocab_axis)
    words = None if positions is None else jnp.expand_dims(token_words(key, positions), 1 + vocab_axis)
    return first_argmax(logits - gumbel_noise(key, position, words), vocab_axis)


def filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Top-k then nucleus (top-p) filtering; removed entries become -inf. top_k=0 / top_p=1 disable."""
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, NEG_INF, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it is kept).
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, NEG_INF, logits)
    return logits


# How many of the most probable tokens a nucleus (top-p) draw chooses from, at least: XLA:GPU
# finds up to 16 largest of each row in one pass of its TopK kernel and sorts the whole row
# for more (a sort of every row's vocabulary per decode step); `truncation` says what it means.
TOP_P_CANDIDATES = 16


def truncation(logits: jax.Array, top_k: int, top_p: float, log_total: jax.Array | None = None):
    """(values, ids, keep) [rows, n]: the candidates a top-k / top-p draw chooses from, the
    n = max(top_k, TOP_P_CANDIDATES) largest logits of each row of ``logits`` [rows, V] (only
    top_k when top_p = 1) in descending order (equal logits: the lower id first), their token
    ids, and which of them the draw keeps:

    - top-k: the first top_k candidates.
    - top-p: the shortest prefix of the kept candidates whose probability reaches top_p (the
      candidate crossing it is kept), probabilities of softmax(logits) (``log_total`` =
      log Σ exp(logits) when given) or, with top_k, of softmax over the top_k candidates: the
      nucleus of the full-vocabulary sort (`filter_logits`) whenever it has at most n tokens.
      When the n candidates together hold less than top_p, all n are kept: the nucleus capped
      at n tokens, where the full sort would keep more (a flat distribution).

    Ties are where the two can also differ: `filter_logits` keeps every logit equal to the
    k-th, or to the one crossing top_p; here a tie at either boundary is cut at the lower ids.
    """
    size = max(top_k, TOP_P_CANDIDATES) if top_p < 1.0 else top_k
    size = min(size, logits.shape[-1])
    values, ids = jax.lax.top_k(logits, size)
    keep = jnp.ones(values.shape, bool)
    if top_k:
        keep = jax.lax.broadcasted_iota(jnp.int32, values.shape, 1) < top_k
    if top_p < 1.0:
        if top_k:
            log_norm = jax.nn.logsumexp(jnp.where(keep, values, -jnp.inf), axis=-1, keepdims=True)
        else:
            log_norm = (jax.nn.logsumexp(logits, axis=-1) if log_total is None else log_total)[:, None]
        probs = jnp.where(keep, jnp.exp(values - log_norm), 0.0)
        keep = keep & (jnp.cumsum(probs, axis=-1) - probs < top_p)
    return values, ids, keep


def truncated_draw(key: jax.Array, logits: jax.Array, top_k: int, top_p: float,
                   rows: jax.Array | None = None, log_total: jax.Array | None = None,
                   positions: jax.Array | None = None) -> jax.Array:
    """One draw per row of ``logits`` [rows, V] among the tokens `truncation` keeps: the
    Gumbel-max draw of `gumbel_max` (the same noise at each token's place in [rows, V], the
    same first-index rule for equal perturbed logits), evaluated at the candidates only. So it
    draws the token `gumbel_max` draws from `filter_logits`' output whenever the two keep the
    same tokens (``positions`` as there)."""
    values, ids, keep = truncation(logits, top_k, top_p, log_total)
    vocab = logits.shape[-1]
    row = (jnp.arange(logits.shape[0], dtype=jnp.uint32) if rows is None else rows.astype(jnp.uint32))
    words = None if positions is None else token_words(key, positions)[:, :, None]
    noise = gumbel_noise(key, row[:, None] * jnp.uint32(vocab) + ids.astype(jnp.uint32), words)
    perturbed = jnp.where(keep, values - noise, -jnp.inf)
    best = jnp.max(perturbed, axis=-1, keepdims=True)
    return jnp.min(jnp.where(perturbed == best, ids, vocab), axis=-1).astype(jnp.int32)



def draw(logits_t: jax.Array, key: jax.Array, positions: jax.Array, rows: jax.Array, *,
         temperature, greedy: bool, top_k: int, top_p: float):
    """(token, log softmax(logits / T) at the token), int32 and float32 [b], of every row of a
    decode step's vocabulary-major logits ``logits_t`` [V, b]: row i is row ``rows[i]`` of the
    rollout batch drawing its token at completion position ``positions[i]``, under the run's
    ``key``. Greedy takes the first largest logit; otherwise Gumbel-max over the whole
    vocabulary, or over `truncation`'s candidates with top-k / top-p. The log-prob is taken
    before truncation (what the RL losses compare against, `SampleOutput`)."""
    scaled = logits_t / jnp.where(greedy, 1.0, temperature)
    # log_softmax's arithmetic for the drawn entry only: (x − max) − log Σ exp(x − max).
    top = jnp.max(scaled, axis=0)
    log_total = jnp.log(jnp.sum(jnp.exp(scaled - top), axis=0))
    if greedy:
        token = first_argmax(logits_t, axis=0)
    elif top_k or top_p < 1.0:
        token = truncated_draw(key, scaled.T, top_k, top_p, rows=rows, log_total=top + log_total,
                               positions=positions)
    else:
        token = gumbel_max(key, scaled, vocab_axis=0, rows=rows, positions=positions)
    return token, (jnp.take_along_axis(scaled, token[None], axis=0)[0] - top) - log_total
