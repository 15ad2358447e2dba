"""The kernel layers nnx_sketch knows, and the matrix product each computes with its kernel.

A registered layer class has a kind: "Linear" (y = x·kernel over x's last axis), "LinearGeneral"
(its in/out features and ``axis``) or "Einsum" (an equation of the input and the kernel). From it,
`product_of` reads which kernel axes a layer contracts with its input (in) and which reach its
output (out), and `layout_of` places them in the kernel with any leading stack axes: the matrix
LoGRA sketches (``KernelLayout``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import nnx

from logra_jax.models.linear import Linear
from logra_jax.projections import KernelLayout


@dataclasses.dataclass(frozen=True)
class Kind:
    """How a layer class multiplies its kernel: ``product`` "Linear" (x·kernel over x's last axis),
    "LinearGeneral" (its in/out features and ``axis``) or "Einsum" (``equation(layer)``), and the
    attribute that holds the kernel."""

    product: str
    kernel: str = "kernel"
    equation: Callable[[Any], str | None] | None = None


# Flax's three kernel layers, and our own Linear (y = x·kernel, as nnx.Linear's; our Decoder passes
# it probes itself, but could be sketched this way too: docs/optax_api.md). `register` adds more.
_KINDS: dict[type, Kind] = {
    nnx.Linear: Kind("Linear"),
    nnx.LinearGeneral: Kind("LinearGeneral"),
    nnx.Einsum: Kind("Einsum", equation=lambda layer: layer.einsum_str),
    Linear: Kind("Linear"),
}


def register(cls: type, *, kernel: str = "kernel",
             equation: str | Callable[[Any], str] | None = None) -> None:
    """Teaches nnx_sketch a kernel layer of one's own (a library's ``Einsum`` with a Param ``w``,
    say). ``kernel``: the attribute holding its kernel Param. ``equation``: the einsum it computes
    with the input (first positional argument of ``__call__``) and the kernel — a string, or a
    function of the layer (``lambda layer: layer.einsum_str``); None: y = x·kernel over x's last
    axis, kernel (in, out). The layer's ``__call__`` must compute exactly that product (plus an
    optional bias); the sketch branch is added to what it returns. Subclasses with their own
    ``__call__`` need registering themselves."""
    if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
        raise ValueError(f"register: {cls!r} is not an nnx.Module class")
    if isinstance(equation, str):
        fixed = equation
        equation = lambda layer: fixed  # noqa: E731
    _KINDS[cls] = Kind("Linear" if equation is None else "Einsum", kernel, equation)


def kind_of_class(layer_cls: type) -> tuple[type, Kind] | None:
    """(the registered class whose ``__call__`` ``layer_cls`` runs, its kind), or None."""
    for cls in layer_cls.__mro__:
        if cls in _KINDS:
            return (cls, _KINDS[cls]) if layer_cls.__call__ is cls.__call__ else None
    return None


def _kind_of(layer) -> tuple[type, Kind] | None:
    return kind_of_class(type(layer))


def registered_kind(layer) -> Kind | None:
    """The kind of the nearest registered class the layer is an instance of, if any."""
    return next((_KINDS[cls] for cls in type(layer).__mro__ if cls in _KINDS), None)


# ----------------------------------------------------------------------------------------------
# The layer's product as a matrix: which input axes it contracts, which kernel axes are in / out
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Product:
    """A layer's kernel product, per layer: kernel axes ``inputs`` (contracted with x, in this
    order) and ``outputs`` (in the result), and, for an Einsum, its equation."""

    kind: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    equation: str | None = None


def _einsum_parts(equation: str, where: str) -> tuple[str, str, str]:
    equation = equation.replace(" ", "")
    if "->" not in equation or equation.count(",") != 1:
        raise ValueError(f"{where}: the Einsum equation {equation!r} must be explicit with two "
                         f"operands")
    operands, result = equation.split("->")
    lhs, rhs = operands.split(",")
    if "." in rhs:
        raise ValueError(f"{where}: the Einsum kernel's subscripts {rhs!r} have an ellipsis; "
                         f"LoGRA needs every kernel axis named")
    return lhs, rhs, result


def product_of(layer, path: str) -> Product:
    """The static description of a supported layer's product, or ValueError naming the layer."""
    found = _kind_of(layer)
    if found is None:
        raise ValueError(
            f"target {path!r} belongs to a {type(layer).__module__}.{type(layer).__qualname__} "
            f"at {path.rsplit('/', 1)[0]!r}, a subclass with its own __call__: logra_jax."
            f"nnx_sketch knows the products of nnx.Linear, nnx.LinearGeneral and nnx.Einsum (and "
            f"our models.linear.Linear); nnx_sketch.register(...) it, or leave it out of the "
            f"targets pattern")
    base, kind = found
    if kind.product == "Linear":
        return Product("Linear", (0,), (1,))
    if kind.product == "LinearGeneral":
        if layer.batch_axis:
            raise ValueError(f"target {path!r}: nnx.LinearGeneral with batch_axis "
                             f"{dict(layer.batch_axis)} (one matrix per batch index) is not "
                             f"supported")
        n_in = len(layer.in_features)
        return Product("LinearGeneral", tuple(range(n_in)),
                       tuple(range(n_in, n_in + len(layer.out_features))))
    equation = kind.equation(layer)
    if equation is None:
        raise ValueError(f"target {path!r}: this {base.__name__} takes its equation at call time; "
                         f"LoGRA needs it at construction to know the kernel's in and out axes")
    lhs, rhs, result = _einsum_parts(equation, f"target {path!r}")
    inputs = tuple(i for i, c in enumerate(rhs) if c in lhs and c not in result)
    outputs = tuple(i for i, c in enumerate(rhs) if c in result and c not in lhs)
    letters = lhs.replace(".", "")
    odd = ([c for c in rhs if (c in lhs) == (c in result)]
           + [c for c in letters if c not in rhs and c not in result])
    repeated = len(set(rhs)) != len(rhs) or len(set(letters)) != len(letters)
    if odd or repeated or not inputs or not outputs:
        raise ValueError(f"target {path!r}: the Einsum {equation!r} is not one matrix "
                         f"product per kernel (index {''.join(odd) or rhs!r} is a batch, diagonal "
                         f"or summed index); LoGRA needs each kernel index contracted with the "
                         f"input or passed to the output")
    return Product("Einsum", inputs, outputs, equation.replace(" ", ""))


def layout_of(product: Product, kernel_ndim: int, path: str) -> KernelLayout:
    per_layer = len(product.inputs) + len(product.outputs)
    n_stack = kernel_ndim - per_layer
    if n_stack < 0:
        raise ValueError(f"target {path!r}: a kernel of {kernel_ndim} axes cannot hold the "
                         f"{per_layer} of its {product.kind}")
    return KernelLayout(stack=tuple(range(n_stack)),
                        inputs=tuple(n_stack + a for a in product.inputs),
                        outputs=tuple(n_stack + a for a in product.outputs))


def is_default(layout: KernelLayout) -> bool:
    """The view SketchSpec takes without a layout: all leading axes stack, then in, then out."""
    n = layout.ndim
    return layout.inputs == (n - 2,) and layout.outputs == (n - 1,)
