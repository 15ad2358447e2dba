"""Rotary position embeddings (RoPE) and the frequency scalings of long-context checkpoints.

A head vector x (d dims) at position p is rotated pairwise: with x = [x₁, x₂] halves and angles
p·f_i for the d/2 frequencies f_i = θ^(−2i/d),

    rope(x, p) = x·cos(p·f) + [−x₂, x₁]·sin(p·f)          (f repeated for both halves)

which makes q·k depend on positions only through p_q − p_k. Scalings change only the frequencies:

    "linear"  (position interpolation):  f_i / factor
    "llama3"  (Llama 3.1): with wavelength λ_i = 2π/f_i and the pre-training context C,
              λ_i < C/high_freq_factor        → f_i             (high frequencies kept)
              λ_i > C/low_freq_factor         → f_i / factor    (low frequencies interpolated)
              otherwise, with s = (C/λ_i − low_freq_factor)/(high_freq_factor − low_freq_factor),
                                              → (1 − s)·f_i/factor + s·f_i
Neither changes the attention temperature (Hugging Face's attention_factor is 1 for both).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

ROPE_TYPES = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A frequency scaling of RoPE (module docstring); Hugging Face's ``rope_scaling`` fields."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0                   # llama3 only
    high_freq_factor: float = 4.0                  # llama3 only
    original_max_position_embeddings: int = 8192   # llama3 only

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeScaling.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if not self.factor >= 1.0:
            raise ValueError(f"RopeScaling.factor must be ≥ 1, got {self.factor!r}")
        if self.rope_type == "llama3" and not (0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError("RopeScaling llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """The d/2 rotation frequencies f_i in fp32, scaled as the module docstring says."""
    freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return freq
    if scaling.rope_type == "linear":
        return freq / scaling.factor
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / freq
    scaled = jnp.where(wavelength > context / scaling.low_freq_factor, freq / scaling.factor, freq)
    smooth = ((context / wavelength - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelength >= context / scaling.high_freq_factor) & (
        wavelength <= context / scaling.low_freq_factor)
    return jnp.where(medium, smoothed, scaled)


def rotary_cos_sin(positions: jax.Array, inv_freq: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin [b, t, head_dim] of the angles p·f_i, each frequency repeated for both halves.

    Computed in fp32 (angles of long positions lose precision in bf16) and then cast.
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE in the Hugging Face "rotate_half" layout: x·cos + [−x₂, x₁]·sin, x = [x₁, x₂] halves.

    x: [b, t, heads, head_dim]; cos, sin: [b, t, head_dim].
    """
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
