"""A matrix product whose value does not depend on the order in which the backend sums.

Why: the merge W ← ws·W + U·A runs on the trainer and again on a factors-sync receiver, each on
its own mesh. A plain fp32 dot sums its r products in an order that the backend chooses from the
per-device block shape and the CPU or GPU kind (tiling, split-k, vector width), so the two sides
can differ in the last bit (seen: 146 of 16 384 entries, one ulp, between fsdp 4 and 2 × 2 on an
AVX2 CPU). Here every dot the backend runs is *exact* — no partial sum ever rounds — so any
order, blocking or kernel gives the same bits, and the only roundings are elementwise ones in a
fixed order that this code writes down.

How (error-free splitting, as in the Ozaki scheme). For x (m × r) and y (r × n), scale each row of
x and each column of y by a power of two, 2^-e, so its largest entry is below 1, and cut it into
slices on fixed grids:

    x_i = 2^{e_i} Σ_a x_i^(a),   x^(a) ∈ 2^{-a·bx} ℤ,  |x^(a)| ≤ 2^{-(a-1)·bx}      (same for y, by)

A product of two slices x^(a)_ij·y^(b)_jn then lies on the grid 2^{-(a·bx + b·by)} with magnitude at
most 2^{-((a-1)·bx + (b-1)·by)}, so a sum of r of them is an integer multiple of the grid below
r·2^{bx+by} ≤ 2^24 whenever bx + by + ⌈log₂ r⌉ ≤ 24: representable in fp32, whatever the order.
The result is

    (x·y)_in ≈ 2^{e_i + e_n} · Σ_{a,b} (x^(a)·y^(b))_in        (slice products summed largest first)

which differs from the exact product only by the slices left out (below 2^-32 of each column's
largest entry of y, 2^-24 of each row's of x) and by the rounding of the running sum: with a ±1 x
it is the exact product rounded once (≤ ½ ulp), with a Gaussian x within a few units of
2^-24·Σ|x||y|, like a plain fp32 dot. A ±1 matrix (Rademacher A) is its own single slice with bx = 0.
Cost: one dot per pair of slices (2 for Rademacher A at r ≤ 256, 9 for Gaussian A).

Everything else is elementwise, and each step is exact (scaling by powers of two, rounding to a
grid) or rounds an input once, behind `rounded`, so that a fused multiply-add, which a compiler
may or may not form depending on the surrounding program, cannot change a bit.
The backend must compute fp32 dots with fp32 accumulation (``Precision.HIGHEST``: no TF32 or
bf16 passes, which would drop bits of the slices).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_FP32_SIGNIFICAND = 24  # bits, the implicit one included
_COVERED_BITS = 32      # slices reach this far below each row's (column's) largest entry
_GAUSSIAN_BITS = 8      # slice width of a Gaussian A; the rest of the budget goes to U
_HIGHEST = jax.lax.Precision.HIGHEST


def rounded(x: jax.Array) -> jax.Array:
    """x, rounded to its dtype before any later add: a multiply is never contracted with it.

    Compilers fuse a·b + c into one fused multiply-add (XLA's CPU backend does, seen here), which
    skips the rounding of a·b; whether they do depends on what else shares the kernel, so the
    trainer's program and a receiver's could round differently. A select between x and NaN on
    x's finiteness sits between the multiply and the add, and no compiler folds it (it would
    have to know x is finite). Infinite x becomes NaN, which is as non-finite.
    """
    return jnp.where(jnp.abs(x) < jnp.inf, x, jnp.nan)


def _power_of_two(e: jax.Array) -> jax.Array:
    """2^e in fp32 for integer e in [-126, 126], built from its bits (exact; no pow, no ldexp)."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _exponent(peak: jax.Array) -> jax.Array:
    """The integer e with peak < 2^e, read from peak's exponent bits and clipped to [-126, 126]:
    peak = 1.f·2^(E−127) < 2^(E−126). Zero and subnormal peaks give -126; non-finite ones 126,
    whose NaN/inf then propagates as in any product."""
    biased = (jax.lax.bitcast_convert_type(peak, jnp.int32) >> 23) & 0xFF
    return jnp.clip(biased - 126, -126, 126)


def split(x: jax.Array, axis: int, bits: int, count: int) -> tuple[jax.Array, jax.Array]:
    """x = 2^e · Σ_a slices[a] (+ what lies below count·bits), with ``e`` per slice of ``axis``.

    Returns (slices stacked on a new leading axis, 2^e with keepdims). slices[a] lies on the grid
    2^-(a+1)·bits with |slices[a]| ≤ 2^-a·bits, since max |x| < 2^e along ``axis`` (for entries
    below 2^126; larger ones overflow any fp32 product anyway). Every step is exact: scaling by a
    power of two, rounding to a grid, subtracting a number's own rounding.
    """
    e = _exponent(jnp.max(jnp.abs(x), axis=axis, keepdims=True))
    rest = x * _power_of_two(-e)
    slices = []
    for a in range(1, count + 1):
        grid = float(2.0 ** (a * bits))
        part = jnp.round(rest * grid) / grid
        slices.append(part)
        rest = rest - part
    return jnp.stack(slices), _power_of_two(e)


def budget(rank: int) -> int:
    """Bits the two operands' slices may share for r = ``rank`` terms: bx + by ≤ 24 − ⌈log₂ r⌉."""
    return _FP32_SIGNIFICAND - max(math.ceil(math.log2(rank)), 0) if rank > 0 else _FP32_SIGNIFICAND


def order_free_matmul(x: jax.Array, y: jax.Array, *, x_is_sign: bool) -> jax.Array:
    """x (m × r) · y (r × n) in fp32, the same bits on every backend, layout and summation order.

    ``x_is_sign``: x holds only ±1 (and 0), one exact slice (Rademacher A); else x is cut into
    ⌈24 / 8⌉ slices of 8 bits (Gaussian A). y gets the rest of the bit budget per slice and as many
    slices as reach 32 bits below each column's largest entry (24 with a Gaussian x).
    """
    rank = x.shape[-1]
    if x.ndim != 2 or y.ndim != 2 or y.shape[0] != rank:
        raise ValueError(f"order_free_matmul: needs x (m, r) and y (r, n), got {x.shape} and {y.shape}")
    x, y = rounded(x.astype(jnp.float32)), rounded(y.astype(jnp.float32))
    if x_is_sign:
        x_slices, x_scale, x_bits = x[None], None, 0
    else:
        x_bits = _GAUSSIAN_BITS
        x_slices, x_scale = split(x, axis=1, bits=x_bits, count=math.ceil(_FP32_SIGNIFICAND / x_bits))
    y_bits = budget(rank) - x_bits
    if y_bits < 1:
        raise ValueError(f"order_free_matmul: rank {rank} leaves no fp32 bits for exact slices "
                         f"(needs ⌈log₂ r⌉ + {x_bits} < 24)")
    y_count = math.ceil((_COVERED_BITS if x_is_sign else _FP32_SIGNIFICAND) / y_bits)
    y_slices, y_scale = split(y, axis=0, bits=y_bits, count=y_count)
    # Slice pairs, largest contributions first; the running sum is the only rounding step.
    pairs = sorted(((a, b) for a in range(x_slices.shape[0]) for b in range(y_slices.shape[0])),
                   key=lambda ab: (ab[0] + ab[1], ab))
    first, second = (jnp.asarray([p[i] for p in pairs], jnp.int32) for i in (0, 1))

    # A loop, not a Python sum: one exact product exists at a time (XLA would fuse a sum of all
    # of them into one kernel that keeps every product alive), and no rewrite can merge two dots
    # into dot(x, y₀ + y₁), whose sums would round.
    def add_product(i, total):
        product = jnp.matmul(x_slices[first[i]], y_slices[second[i]], precision=_HIGHEST,
                             preferred_element_type=jnp.float32)
        return total + product

    total = jax.lax.fori_loop(0, len(pairs), add_product,
                              jnp.zeros((x.shape[0], y.shape[1]), jnp.float32))
    total = total * y_scale
    return total if x_scale is None else total * x_scale
