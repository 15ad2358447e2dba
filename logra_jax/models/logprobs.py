"""Token log-probabilities and entropies without materialising the [b, t, V] logits.

With z = h·W / T (W the [d, V] output head, T the temperature):

    log p(y) = z_y − logZ,      logZ = m + log s,       s = Σ_k exp(z_k − m)
    H        = −Σ_k p_k log p_k = logZ − E_p[z] = log s − w / s,   w = Σ_k exp(z_k − m)(z_k − m)

The vocabulary is visited in chunks of C columns by ``lax.scan``; the carry holds the running max
m, s, w (rescaled when m grows: s ← s·e^{m−m'}, w ← e^{m−m'}(w + (m − m')s)) and the target logit
z_y, each [b, t]. Only one [b, t, C] block of logits exists at a time; the scan body is
rematerialised, so backward does not store all blocks either.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def token_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, *,
                   temperature: float = 1.0, chunk_size: int = 8192) -> tuple[jax.Array, jax.Array]:
    """(log p(targets) [b, t] fp32, entropy [b, t] fp32) of softmax(hidden·head / temperature).

    hidden: [b, t, d]; head: [d, V] (e.g. ``model.head_kernel()``); targets: int [b, t] in [0, V)
    (out-of-range targets cannot be checked under jit and give log p = −logZ). The matmul runs in
    hidden's dtype with fp32 accumulation, as the model's own logits do.
    """
    if hidden.ndim != 3 or head.ndim != 2 or hidden.shape[-1] != head.shape[0]:
        raise ValueError(f"token_logprobs needs hidden [b, t, d] and head [d, V]; got {hidden.shape} "
                         f"and {head.shape}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets shape {targets.shape} != hidden's [b, t] {hidden.shape[:2]}")
    if not isinstance(temperature, jax.core.Tracer) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    vocab = head.shape[1]
    chunk = min(chunk_size, vocab)
    num_chunks = math.ceil(vocab / chunk)
    head = head.astype(hidden.dtype)
    targets = targets.astype(jnp.int32)
    lead = hidden.shape[:2]

    def visit(carry, c):
        m, s, w, z_target = carry
        # The last chunk is shifted left to stay in bounds; its columns already seen are skipped.
        first_new = c * chunk
        start = jnp.minimum(first_new, vocab - chunk)
        columns = start + jnp.arange(chunk)
        fresh = columns >= first_new
        z = jnp.einsum("btd,dv->btv", hidden, jax.lax.dynamic_slice_in_dim(head, start, chunk, axis=1),
                       preferred_element_type=jnp.float32) / temperature
        z = jnp.where(fresh, z, -jnp.inf)
        m_new = jnp.maximum(m, z.max(axis=-1))
        decay = jnp.exp(m - m_new)
        shifted = jnp.where(fresh, z - m_new[..., None], 0.0)
        e = jnp.where(fresh, jnp.exp(shifted), 0.0)
        w = decay * (w + (m - m_new) * s) + (e * shifted).sum(axis=-1)
        s = s * decay + e.sum(axis=-1)
        is_target = fresh & (columns == targets[..., None])
        z_target = z_target + jnp.where(is_target, z, 0.0).sum(axis=-1)
        return (m_new, s, w, z_target), None

    # m starts at the lowest finite float, not −inf, so (m − m') stays finite and (m − m')·s = 0.
    init = (jnp.full(lead, jnp.finfo(jnp.float32).min), jnp.zeros(lead, jnp.float32),
            jnp.zeros(lead, jnp.float32), jnp.zeros(lead, jnp.float32))
    (m, s, w, z_target), _ = jax.lax.scan(jax.checkpoint(visit, prevent_cse=False), init,
                                          jnp.arange(num_chunks))
    log_s = jnp.log(s)
    return z_target - (m + log_s), log_s - w / s
