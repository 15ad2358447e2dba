"""The one linear layer every attention and MLP projection uses, with the LoGRA sketch probe.

Without a probe it is y = x·W (Flax layout: ``kernel`` = Wᵀ, shape (in, out)). With a probe
(ALGORITHM.md §3) it computes

    y = x·stop_gradient(kernel) + (x·Aᵀ)·Bᵀ,      B = probe.factor = 0 (out × r)

so the forward value is unchanged, ∂L/∂B = Hᵀ(X·Aᵀ) = G·Aᵀ = S exactly, the dense weight gradient
is never formed, and backward keeps X·Aᵀ (tokens × r) instead of X (tokens × in).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from logra_jax.optim.projections import SketchProbe


class Linear(nnx.Module):
    """y = x·kernel (+ bias), kernel (in, out); optional sketch probe for LoGRA targets."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
                 kernel_axes: tuple[str | None, str | None] = (None, None),
                 dtype=jnp.float32, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), rngs: nnx.Rngs):
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.kernel_axes = kernel_axes
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = (nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None)

    def __call__(self, x: jax.Array, probe: SketchProbe | None = None) -> jax.Array:
        x = x.astype(self.dtype)
        kernel = self.kernel[...].astype(self.dtype)
        if probe is None:
            y = x @ kernel
        else:
            a = probe.projection(self.in_features, self.dtype)           # (r, in)
            y = x @ jax.lax.stop_gradient(kernel) + (x @ a.T) @ probe.factor.astype(self.dtype).T
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y
