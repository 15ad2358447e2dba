"""Tolerances derived from the arithmetic a comparison checks, never from one machine's result.

Two programs that compute the same sums in different orders (another kernel, another fusion, or
the same program on a machine with wider vector registers: AVX-512 sums 16 fp32 lanes at a time
where AVX2 sums 8) agree only up to rounding. A sum of n terms in floating point with unit
roundoff u (half the dtype's machine epsilon), in any order, lies within γ_{n-1}·Σ|terms| of the
exact sum, γ_k = k·u / (1 − k·u) (Higham, *Accuracy and Stability of Numerical Algorithms*,
§4.2), so two orders lie within twice that of each other. A value computed through several sums
in sequence (a layer's products, its attention, the next layer's products) carries each one's
error on; to first order the bounds add. ``scale`` stands in for Σ|terms|: the largest magnitude
among the values compared.

Which CPU features a test depends on: none. A bound from this module holds for any summation
order, so for any vector width (AVX2, AVX-512) and any vendor.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


def summation_atol(reductions: Iterable[int], dtype, scale: float) -> float:
    """The largest difference two summation orders may make to a value computed through sums of
    ``reductions`` terms in sequence, in ``dtype``, with terms of magnitude up to ``scale``:
    2 · Σ γ_{n−1} · scale."""
    u = float(np.finfo(dtype).eps) / 2
    gamma = sum((n - 1) * u / (1 - (n - 1) * u) for n in reductions)
    return 2 * gamma * scale


def assert_close_up_to_order(got, want, reductions: Iterable[int], dtype=np.float32, err_msg=""):
    """``got`` equals ``want`` up to what reordering the sums of ``reductions`` may change."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    atol = summation_atol(reductions, dtype, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=err_msg)
