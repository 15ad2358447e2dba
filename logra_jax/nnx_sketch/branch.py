"""The sketch branch a target layer adds to its output: y = layer(x) + (x·Aᵀ)·Bᵀ.

A target layer's class is swapped, for one call, for a subclass (`sketched_class`) whose
``__call__`` runs the layer's own product untouched (its dtype promotion, precision, dot_general,
sharding) and adds the branch on the kernel viewed as a matrix (`layers.product_of`). At B = 0 the
branch is a custom JVP (as our Linear's ``sketched_matmul``): value and x-gradient zero, not
computed, and the B-derivative is ``linear.sketch_tangent``, whose transpose is the sketch
S = G·Aᵀ. With B ≠ 0 it is the layer at W + B·A (the predicted-KL safeguard's candidate).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.custom_derivatives import SymbolicZero

from logra_jax.models.linear import WEIGHTS_MAJOR, sketch_tangent, times_factor_t
from logra_jax.nnx_sketch.layers import Kind, Product, kind_of_class
from logra_jax.projections import projection

# The attach contexts being traced (not thread-safe): a sketched layer reports its call to each,
# so a target the model never calls through its layer is found (attach.Attached).
ACTIVE: list = []


@jax.custom_jvp
def _zero_branch(x: jax.Array, a: jax.Array, factor: jax.Array) -> jax.Array:
    """(x·Aᵀ)·Bᵀ at B = ``factor`` = 0: the value is zero and not computed; of the derivative only
    the B term survives, (x·Aᵀ)·dBᵀ (`sketch_tangent`), whose transpose is the sketch Hᵀ(x·Aᵀ).
    The layer's own product gives y and ∂L/∂x (docs/algorithm.md §3)."""
    del a
    return jnp.zeros((x.shape[0], factor.shape[0]), x.dtype)


def _zero_branch_jvp(primals, tangents):
    x, a, factor = primals
    y = jnp.zeros((x.shape[0], factor.shape[0]), x.dtype)
    dfactor = tangents[2]                    # dx and dA only meet B = 0
    if isinstance(dfactor, SymbolicZero):
        return y, jnp.zeros_like(y)
    with jax.named_scope("logra_sketch"):    # named for profiles (logra_jax/perf/profiling.py)
        return y, sketch_tangent(x @ a.T, dfactor)


_zero_branch.defjvp(_zero_branch_jvp, symbolic_zeros=True)


@dataclasses.dataclass(frozen=True)
class ProbeFacts:
    """Static facts a sketched layer reads at call time (its graph attribute ``logra_sketch``)."""

    path: str
    product: Product
    in_dim: int
    distribution: str
    factor_is_zero: bool


def _matrix_input(product: Product, layer, x: jax.Array, kernel_shape, einsum_str):
    """(x as (tokens, in), the shape of the output's free dims, the permutation that puts the
    branch's (free..., out...) axes in the layer's output order, or None)."""
    if product.kind == "Einsum":
        if einsum_str is not None and einsum_str.replace(" ", "") != product.equation:
            raise ValueError(f"target {layer.logra_sketch.path!r}: called with the equation "
                             f"{einsum_str!r}, sketched for {product.equation!r}")
        import opt_einsum  # flax's own dependency (nnx.Einsum parses ellipses with it)
        operands, result, _ = opt_einsum.parser.parse_einsum_input(
            (product.equation, jax.ShapeDtypeStruct(x.shape, x.dtype),
             jax.ShapeDtypeStruct(kernel_shape, x.dtype)))
        lhs, rhs = operands.split(",")
        free = [c for c in lhs if c not in rhs]
        contracted = [rhs[i] for i in product.inputs]
        order = [lhs.index(c) for c in free + contracted]
        current = free + [rhs[i] for i in product.outputs]
        perm = tuple(current.index(c) for c in result)
        perm = None if perm == tuple(range(len(perm))) else perm
    else:
        axes = (x.ndim - 1,) if product.kind == "Linear" else tuple(
            sorted(a % x.ndim for a in layer.axis))            # as LinearGeneral pairs them
        order = [a for a in range(x.ndim) if a not in axes] + list(axes)
        perm = None
    moved = x if order == list(range(x.ndim)) else jnp.transpose(x, order)
    n_free = x.ndim - len(product.inputs)
    free_shape = moved.shape[:n_free]
    return moved.reshape((math.prod(free_shape), -1)), free_shape, perm


def _sketched_call(base, kind: Kind):
    def __call__(self, inputs, *args, **kwargs):
        y = base.__call__(self, inputs, *args, **kwargs)
        probe: ProbeFacts | None = getattr(self, "logra_sketch", None)
        if probe is None:
            return y
        kernel = getattr(self, kind.kernel)
        if kernel.get_metadata().get(WEIGHTS_MAJOR, False):
            raise ValueError(f"target {probe.path!r}: a decoding copy of the kernel (stored "
                             f"(out, in), models.linear.weights_major) cannot be sketched")
        for attached in ACTIVE:
            attached.called.add(probe.path)
        product = probe.product
        kernel_shape = tuple(kernel.shape)
        einsum_str = None    # nnx.Einsum may take another equation at call time: refused
        if base is nnx.Einsum:
            einsum_str = kwargs.get("einsum_str", args[0] if args else None)
        x, free_shape, perm = _matrix_input(product, self, inputs, kernel_shape, einsum_str)
        dtype = y.dtype
        x = x.astype(dtype)
        factor = self.logra_factor[...]
        a = projection(self.logra_key[...], factor.shape[-1], probe.in_dim, probe.distribution,
                       dtype)
        if probe.factor_is_zero:
            z = _zero_branch(x, a, factor.astype(dtype))
        else:  # B = U: the layer at W + U·A (the predicted-KL safeguard's candidate)
            with jax.named_scope("logra_sketch"):
                z = times_factor_t(x @ a.T, factor.astype(dtype))
        z = z.reshape(free_shape + tuple(kernel_shape[i] for i in product.outputs))
        if perm is not None:
            z = jnp.transpose(z, perm)
        return y + z
    return __call__


_SKETCHED_CLASSES: dict[type, type] = {}


def sketched_class(cls: type) -> type:
    """``cls`` with the sketch branch in its ``__call__`` (one subclass per class, made once)."""
    if cls not in _SKETCHED_CLASSES:
        base, kind = kind_of_class(cls)
        _SKETCHED_CLASSES[cls] = type(f"Sketched{cls.__name__}", (cls,),
                                      {"__call__": _sketched_call(base, kind),
                                       "__module__": __name__,
                                       "__qualname__": f"Sketched{cls.__name__}"})
    return _SKETCHED_CLASSES[cls]
