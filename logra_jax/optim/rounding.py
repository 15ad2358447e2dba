r"""Rounding an fp32 merge result to bf16 weights: to nearest, or stochastically (unbiased).

A bf16 weight has 8 bits of mantissa: at RL learning rates most per-step changes |ΔW| are below
half a bf16 ulp of W, so rounding W + ΔW to nearest gives back W and the update is lost. Stochastic
rounding keeps it in expectation. For x between the bf16 neighbours lo < x < hi,

    SR(x) = hi with probability (x − lo) / (hi − lo), else lo,     so  E[SR(x)] = x.

On the fp32 bit pattern (sign · magnitude) this is: add 16 uniform random bits to the low 16 bits
of the magnitude and truncate them; a carry into bit 16 happens with exactly that probability. The
random bits come from a key, so the same key gives the same bf16 weights on any device — a resumed
run or a rollout engine applying the same update reproduces them bit for bit. They are the top 16
bits of projections.hashed_bits (a counter-based hash, one elementwise expression per entry):
a weight-sized threefry draw would run as XLA:CPU's loop of rounds, copying its state each round.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.projections import hashed_bits

ROUNDINGS = ("nearest", "stochastic")
_SIGN, _EXPONENT = np.uint32(0x80000000), np.uint32(0x7F800000)     # fp32 bit fields
_BF16_MAX_BITS = np.uint32(0x7F7F0000)                  # the largest finite bf16, as fp32 bits


def stochastic_round_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
    """``x`` (fp32) rounded to bf16 up or down at random, unbiased; deterministic per ``key``.

    A value that is already a bf16 number is returned unchanged (its low bits are 0, so no carry);
    a finite value never becomes inf (a carry past the largest bf16 is clipped back to it);
    inf and NaN stay what they are.
    """
    x = jnp.asarray(x, jnp.float32)
    # All in integers: float ops on CPU flush subnormals to zero, integer ops and bitcasts do not.
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = hashed_bits(key, x.shape) >> 16
    high = (bits + noise) >> 16                        # the bf16 bit pattern, rounded up or down
    sign, exponent = bits & _SIGN, bits & _EXPONENT
    overflowed = (high << 16) & _EXPONENT == _EXPONENT   # a finite value carried into inf
    high = jnp.where(overflowed, (sign | _BF16_MAX_BITS) >> 16, high)
    high = jnp.where(exponent == _EXPONENT, bits >> 16, high)   # inf and NaN as they were
    return jax.lax.bitcast_convert_type(high.astype(jnp.uint16), jnp.bfloat16)


def round_to(x: jax.Array, dtype, rounding: str = "nearest", key: jax.Array | None = None) -> jax.Array:
    """``x`` in ``dtype``: stochastic rounding applies to bf16 targets only (fp32 is exact here)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if rounding == "stochastic" and jnp.dtype(dtype) == jnp.bfloat16:
        if key is None:
            raise ValueError("stochastic rounding needs a key")
        return stochastic_round_bf16(x, key)
    return x.astype(dtype)
