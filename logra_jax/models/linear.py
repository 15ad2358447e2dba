"""The one linear layer every attention and MLP projection uses, with the LoGRA sketch probe.

Without a probe it is y = x·W (Flax layout: ``kernel`` = Wᵀ, shape (in, out)). With a probe
(ALGORITHM.md §3) it computes

    y = x·kernel + (x·Aᵀ)·Bᵀ,      B = probe.factor = 0 (out × r)

so the forward value is unchanged and ∂L/∂B = Hᵀ(X·Aᵀ) = G·Aᵀ = S exactly. The dense weight
gradient is never formed because LoGRA's loss differentiates (non-target params, B) and closes
over the target kernels — not because of a stop_gradient here: one would make the layer scan save
a second copy of every stacked kernel as a backward residual when remat is off (measured: 80.7 vs
26.2 MiB at width 1024 with and without it). Backward keeps X·Aᵀ (tokens × r), not X (tokens × in).
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
            y = x @ kernel + (x @ a.T) @ probe.factor.astype(self.dtype).T
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y
