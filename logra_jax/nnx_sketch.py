"""LoGRA's memory-saving path for any Flax NNX model, not only ours (docs/optax_api.md, third part).

Our `Decoder` computes its gradient sketches S = G·Aᵀ in the backward pass because its `Linear`
takes a `SketchProbe` (docs/algorithm.md §3). A model written elsewhere — flax's examples, an NNX
port of Gemma or Qwen, a researcher's own transformer — multiplies its kernels in
``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum``. This module gives those layers the same
probe without touching the model's code::

    sketch = nnx_sketch.prepare(model, targets=r"(query|key|value|out|up|down)/kernel$", rank=64)
    tx = logra(learning_rate=1e-3, **sketch.logra_kwargs())
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grad_fn = sketch.value_and_grad(loss_fn)            # loss_fn(model, *args) -> scalar
    loss, grads = grad_fn(model, update_index(optimizer.opt_state), batch)
    optimizer.update(model, grads)                      # grads: S at targets, dense elsewhere

How. For one gradient, each target layer of the model is given, for that call only, a zero probe
B (*stack, out, r) and the keys of A (*stack, 2) as two Variables of its own (``SketchFactor``,
``SketchKey``; both ``Probe``, an ``nnx.Param`` kind, so an ``nnx.scan``/``nnx.vmap`` over a
stack of layers slices them with the kernels whatever its ``StateAxes`` do with other state), and
its class is swapped for a subclass whose ``__call__`` is

    y = layer(x) + (x·Aᵀ)·Bᵀ

— the layer's own product untouched (its dtype promotion, precision, dot_general, sharding), plus
the sketch branch on the kernel viewed as a matrix: in = the axes it contracts with x, out = the
others (``KernelLayout``). The loss is differentiated with respect to B and the non-target params
only, the target kernels closed over, so ∂L/∂B = S and no (in × out) gradient exists. At B = 0 the
branch is a custom JVP (as our Linear's ``sketched_matmul``): value and x-gradient zero, not
computed, and the B-derivative is ``linear.sketch_tangent``. Afterwards the model is as it was:
parameter paths, values, Variable metadata and graph are unchanged.

Supported: ``nnx.Linear``; ``nnx.LinearGeneral`` without ``batch_axis``; ``nnx.Einsum`` whose
equation is fixed at construction and whose kernel indices are each either contracted with the
input or passed to the output; our own ``models.linear.Linear`` (so our Decoder could be sketched
this way too, docs/optax_api.md); and any layer class given to ``register`` with its kernel
attribute and equation (a library's own ``Einsum``, as Tunix's Gemma and Qwen have). A stack of
layers made by ``nnx.vmap`` (the layer axis leading the kernels) is one target per path with one A
per layer. A target of any other kind is an error naming it, and so is a target the loss never
calls through its layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.custom_derivatives import SymbolicZero
from jax.sharding import NamedSharding, PartitionSpec

from logra_jax.models.linear import WEIGHTS_MAJOR, Linear, sketch_tangent, times_factor_t
from logra_jax.optim import (DEFAULT_TARGETS, SketchSpec, TargetInfo, exact_kl, make_predict_kl,
                             merge_targets, split_targets)
from logra_jax.optim import update_index as logra_update_index
from logra_jax.optim.logra import sketch_spec_of
from logra_jax.projections import KernelLayout, projection
from logra_jax.tree_paths import leaves_with_paths, map_with_paths


@dataclasses.dataclass(frozen=True)
class _Kind:
    """How a layer class multiplies its kernel: ``product`` "Linear" (x·kernel over x's last axis),
    "LinearGeneral" (its in/out features and ``axis``) or "Einsum" (``equation(layer)``), and the
    attribute that holds the kernel."""

    product: str
    kernel: str = "kernel"
    equation: Callable[[Any], str | None] | None = None


# Flax's three kernel layers, and our own Linear (y = x·kernel, as nnx.Linear's; our Decoder passes
# it probes itself, but could be sketched this way too: docs/optax_api.md). `register` adds more.
_KINDS: dict[type, _Kind] = {
    nnx.Linear: _Kind("Linear"),
    nnx.LinearGeneral: _Kind("LinearGeneral"),
    nnx.Einsum: _Kind("Einsum", equation=lambda layer: layer.einsum_str),
    Linear: _Kind("Linear"),
}


def register(cls: type, *, kernel: str = "kernel",
             equation: str | Callable[[Any], str] | None = None) -> None:
    """Teaches this module a kernel layer of one's own (a library's ``Einsum`` with a Param ``w``,
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
    _KINDS[cls] = _Kind("Linear" if equation is None else "Einsum", kernel, equation)


def _kind_of_class(layer_cls: type) -> tuple[type, _Kind] | None:
    """(the registered class whose ``__call__`` ``layer_cls`` runs, its kind), or None."""
    for cls in layer_cls.__mro__:
        if cls in _KINDS:
            return (cls, _KINDS[cls]) if layer_cls.__call__ is cls.__call__ else None
    return None


def _kind_of(layer) -> tuple[type, _Kind] | None:
    return _kind_of_class(type(layer))


def _registered_kind(layer) -> _Kind | None:
    """The kind of the nearest registered class the layer is an instance of, if any."""
    return next((_KINDS[cls] for cls in type(layer).__mro__ if cls in _KINDS), None)


class Probe(nnx.Param):
    """What a target layer carries during one gradient call. An ``nnx.Param`` kind, so that a scan
    over a layer stack slices it with the kernels; a loss that sums over ``nnx.state(model,
    nnx.Param)`` (a weight penalty) should leave it out: ``nnx.All(nnx.Param, nnx.Not(Probe))``."""


class SketchFactor(Probe):
    """The zero probe B (*stack, out, r) of a target layer during one gradient: ∂L/∂B = S."""


class SketchKey(Probe):
    """The key data (*stack, 2) of A_l(k) for every layer of a target, during one gradient."""


# ----------------------------------------------------------------------------------------------
# The layer's product as a matrix: which input axes it contracts, which kernel axes are in / out
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Product:
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


def _product(layer, path: str) -> _Product:
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
        return _Product("Linear", (0,), (1,))
    if kind.product == "LinearGeneral":
        if layer.batch_axis:
            raise ValueError(f"target {path!r}: nnx.LinearGeneral with batch_axis "
                             f"{dict(layer.batch_axis)} (one matrix per batch index) is not "
                             f"supported")
        n_in = len(layer.in_features)
        return _Product("LinearGeneral", tuple(range(n_in)),
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
    return _Product("Einsum", inputs, outputs, equation.replace(" ", ""))


def _layout(product: _Product, kernel_ndim: int, path: str) -> KernelLayout:
    per_layer = len(product.inputs) + len(product.outputs)
    n_stack = kernel_ndim - per_layer
    if n_stack < 0:
        raise ValueError(f"target {path!r}: a kernel of {kernel_ndim} axes cannot hold the "
                         f"{per_layer} of its {product.kind}")
    return KernelLayout(stack=tuple(range(n_stack)),
                        inputs=tuple(n_stack + a for a in product.inputs),
                        outputs=tuple(n_stack + a for a in product.outputs))


def _is_default(layout: KernelLayout) -> bool:
    """The view SketchSpec takes without a layout: all leading axes stack, then in, then out."""
    n = layout.ndim
    return layout.inputs == (n - 2,) and layout.outputs == (n - 1,)


# ----------------------------------------------------------------------------------------------
# The sketch branch a target layer adds to its output
# ----------------------------------------------------------------------------------------------
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
class _ProbeFacts:
    """Static facts a sketched layer reads at call time (its graph attribute ``logra_sketch``)."""

    path: str
    product: _Product
    in_dim: int
    distribution: str
    factor_is_zero: bool


def _matrix_input(product: _Product, layer, x: jax.Array, kernel_shape, einsum_str):
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


def _sketched_call(base, kind: _Kind):
    def __call__(self, inputs, *args, **kwargs):
        y = base.__call__(self, inputs, *args, **kwargs)
        probe: _ProbeFacts | None = getattr(self, "logra_sketch", None)
        if probe is None:
            return y
        kernel = getattr(self, kind.kernel)
        if kernel.get_metadata().get(WEIGHTS_MAJOR, False):
            raise ValueError(f"target {probe.path!r}: a decoding copy of the kernel (stored "
                             f"(out, in), models.linear.weights_major) cannot be sketched")
        for attached in _ACTIVE:
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


def _sketched_class(cls: type) -> type:
    """``cls`` with the sketch branch in its ``__call__`` (one subclass per class, made once)."""
    if cls not in _SKETCHED_CLASSES:
        base, kind = _kind_of_class(cls)
        _SKETCHED_CLASSES[cls] = type(f"Sketched{cls.__name__}", (cls,),
                                      {"__call__": _sketched_call(base, kind),
                                       "__module__": __name__,
                                       "__qualname__": f"Sketched{cls.__name__}"})
    return _SKETCHED_CLASSES[cls]


# ----------------------------------------------------------------------------------------------
# Finding the targets of a model
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    """One sketched kernel: its path, layer kind, layout (None: Flax's (*stack, in, out)) and the
    optimizer's view of it (``info``: stack, in, out, rank)."""

    path: str
    kind: str
    product: _Product
    layout: KernelLayout | None
    info: TargetInfo


def _modules(model) -> dict[tuple, nnx.Module]:
    return {tuple(p): node for p, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}


def _param_paths(model) -> list[tuple[tuple, Any]]:
    return [(tuple(p), v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def _shape(var) -> tuple[int, ...]:
    return tuple(var.get_value().shape)


def _find_targets(model, spec: SketchSpec) -> dict[str, tuple[tuple, Target]]:
    """{kernel path: (owner module path, Target)} of every target; ValueError for a target that is
    not a supported layer's kernel, or when nothing matches."""
    modules = _modules(model)
    found: dict[str, tuple[tuple, Target]] = {}
    layouts = {}
    for parts, var in _param_paths(model):
        path = "/".join(str(p) for p in parts)
        if not spec.is_target(path):
            continue
        owner = modules.get(parts[:-1])
        registered = None if owner is None else _registered_kind(owner)
        if registered is None or parts[-1] != registered.kernel:
            what = "a parameter" if owner is None else (
                f"the {parts[-1]!r} of a {type(owner).__module__}.{type(owner).__qualname__}")
            raise ValueError(
                f"targets pattern {spec.targets!r} matches {path!r}, {what} at "
                f"{'/'.join(map(str, parts[:-1]))!r}: LoGRA sketches only the kernel of "
                f"nnx.Linear, nnx.LinearGeneral and nnx.Einsum layers (and of our "
                f"models.linear.Linear, or of a class given to nnx_sketch.register)")
        product = _product(owner, path)
        layout = _layout(product, len(_shape(var)), path)
        layouts[path] = None if _is_default(layout) else layout
        found[path] = (parts[:-1], product)
    spec = dataclasses.replace(spec, layouts={p: l for p, l in layouts.items() if l is not None})
    shapes = {"/".join(map(str, p)): _shape(v) for p, v in _param_paths(model)}
    infos = spec.find_targets({p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in shapes.items()})
    return {path: (owner, Target(path, product.kind, product, layouts[path], infos[path]))
            for path, (owner, product) in found.items()}


# ----------------------------------------------------------------------------------------------
# Giving a model's target layers their probes for one call
# ----------------------------------------------------------------------------------------------
# The contexts being traced (not thread-safe); a sketched layer reports its call to them.
_ACTIVE: list[_Attached] = []


class _Attached:
    """Context: the target layers of ``model`` carry the given factors and keys, then are restored.

    On a clean exit every target must have been called through its layer: a kernel the model
    reads directly (``layer.kernel[...]`` in its own product) bypasses the probe, and its sketch
    would silently miss that use.
    """

    def __init__(self, model, targets, factors, keys, distribution, factor_is_zero):
        self.model, self.targets = model, targets
        self.factors, self.keys = factors, keys
        self.distribution, self.factor_is_zero = distribution, factor_is_zero
        self.done = []
        self.called: set[str] = set()

    def __enter__(self):
        modules = _modules(self.model)
        try:
            for path, (owner, target) in self.targets.items():
                layer = modules[owner]
                cls = type(layer)
                object.__setattr__(layer, "__class__", _sketched_class(cls))
                self.done.append((layer, cls))
                layer.logra_sketch = _ProbeFacts(path, target.product, target.info.in_dim,
                                                 self.distribution, self.factor_is_zero)
                layer.logra_factor = SketchFactor(self.factors[path])
                layer.logra_key = SketchKey(self.keys[path])
        except BaseException:
            self._restore()
            raise
        _ACTIVE.append(self)
        return self.model

    def _restore(self):
        for layer, cls in reversed(self.done):
            for name in ("logra_sketch", "logra_factor", "logra_key"):
                if name in vars(layer):
                    delattr(layer, name)
            object.__setattr__(layer, "__class__", cls)
        self.done = []

    def __exit__(self, exc_type=None, *exc):
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self._restore()
        missed = sorted(set(self.targets) - self.called)
        if exc_type is None and missed:
            raise ValueError(f"targets {missed} were never called through their layer: the model "
                             f"uses these kernels some other way (e.g. reads layer.kernel itself), "
                             f"which LoGRA cannot sketch; leave them out of the targets pattern")
        return False


def _index(update_index) -> jax.Array:
    if isinstance(update_index, nnx.Variable):   # nnx.Optimizer keeps its state in OptState
        update_index = update_index[...]
    return jnp.asarray(update_index, jnp.int32)


def _plain(tree):
    """A params-shaped tree (nnx.State, dict) as nested plain dicts; other nodes as they are."""
    if isinstance(tree, Mapping):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def _sketch_sharding(kernel, info: TargetInfo) -> NamedSharding | None:
    """Where B and its gradient, the sketch (*stack, out, r), live: the kernel's stack and out
    entries, and the mesh axes of its in dims moved onto out when they divide it (as
    ``sharding.sketch_shardings`` does for our Decoder: a kernel sharded over in only would
    otherwise get a sketch replicated on every device)."""
    sharding = getattr(kernel, "sharding", None)
    if not isinstance(sharding, NamedSharding) or isinstance(kernel, jax.core.Tracer):
        return None
    layout = info.layout or KernelLayout(tuple(range(kernel.ndim - 2)), (kernel.ndim - 2,),
                                         (kernel.ndim - 1,))
    spec = tuple(sharding.spec) + (None,) * (kernel.ndim - len(sharding.spec))

    def axes(entry):
        return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

    first, *rest = (spec[a] for a in layout.outputs)
    out = axes(first) if all(e is None for e in rest) else ()
    moved = out + tuple(a for i in layout.inputs for a in axes(spec[i]) if a not in out)
    size = math.prod(sharding.mesh.shape[a] for a in moved)
    out = moved if moved and info.out_dim % size == 0 else out
    return NamedSharding(sharding.mesh, PartitionSpec(*(spec[a] for a in layout.stack),
                                                      out or None, None))


# ----------------------------------------------------------------------------------------------
# The public entry
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class NNXSketch:
    """LoGRA's sketch of one NNX model's targets: the ``SketchSpec`` (with the kernel layouts its
    LinearGeneral and Einsum targets need), the targets found, and the functions a train step
    calls. Make it with ``prepare``; it holds no arrays and does not change the model.
    """

    spec: SketchSpec
    targets: dict[str, Target]
    shardings: dict[str, NamedSharding]

    def logra_kwargs(self) -> dict[str, Any]:
        """The sketch arguments of ``logra(...)``, so optimizer and gradients draw the same A."""
        s = self.spec
        return dict(targets=s.targets, rank=s.rank, seed=s.seed, distribution=s.distribution,
                    refresh=s.refresh, layouts=dict(s.layouts))

    # -- probes ---------------------------------------------------------------------------------
    def _found(self, model):
        found = _find_targets(model, self.spec)
        infos = {p: t.info for p, (_, t) in found.items()}
        if infos != {p: t.info for p, t in self.targets.items()}:
            raise ValueError(f"this model's targets {sorted(found)} differ from those the sketch "
                             f"was prepared for ({sorted(self.targets)}) or have other shapes")
        return found

    def check(self, tx) -> None:
        """ValueError unless ``tx`` — a transformation, or the ``nnx.Optimizer`` holding it — was
        made by ``logra(...)`` with this sketch's arguments (`logra_kwargs`): another seed, rank,
        distribution, refresh, targets or layouts would reconstruct every update with another A
        than the one the gradients were sketched with, silently."""
        tx = getattr(tx, "tx", tx)
        theirs = sketch_spec_of(tx)
        if theirs is None:
            raise ValueError("this optimizer was not made by logra_jax.optim.logra(...), so it "
                             "cannot reconstruct this sketch's gradients; build it with "
                             "logra(..., **sketch.logra_kwargs())")
        ours = self.spec
        differ = [f"{f.name}={getattr(theirs, f.name)!r} (the sketch's: {getattr(ours, f.name)!r})"
                  for f in dataclasses.fields(SketchSpec)
                  if getattr(theirs, f.name) != getattr(ours, f.name)]
        if differ:
            raise ValueError(f"logra(...) was built with {'; '.join(differ)}: it would "
                             f"reconstruct the updates with another A than the gradients were "
                             f"sketched with; pass **sketch.logra_kwargs() unchanged")

    def keys(self, update_index) -> dict[str, jax.Array]:
        """{target path: key data (*stack, 2) of A_l(k)} for the gradient after ``update_index``
        updates (``update_index(opt_state)``, or the ``nnx.Optimizer`` itself: then its
        transformation is first `check`ed against this sketch)."""
        if isinstance(update_index, nnx.Optimizer):
            self.check(update_index)
            update_index = logra_update_index(update_index.opt_state)
        k = self.spec.projection_index(_index(update_index))
        return {path: self.spec.keys(t.info, k) for path, t in self.targets.items()}

    def zero_factors(self) -> dict[str, jax.Array]:
        """{target path: B = 0 (*stack, out, r)} in fp32, laid out like the kernels on a mesh."""
        factors = {}
        for path, t in self.targets.items():
            b = jnp.zeros(t.info.sketch_shape, jnp.float32)
            if path in self.shardings:
                b = jax.lax.with_sharding_constraint(b, self.shardings[path])
            factors[path] = b
        return factors

    def sketched(self, model, keys: dict[str, jax.Array], factors: dict[str, jax.Array], *,
                 factor_is_zero: bool = True):
        """A context in which ``model``'s target layers compute y = layer(x) + (x·Aᵀ)·Bᵀ with
        B = ``factors`` (zero: gradient sketches; nonzero, ``factor_is_zero=False``: the model at
        W + B·A), restored on exit. For one's own differentiation; ``value_and_grad`` uses it."""
        return _Attached(model, self._found(model), factors, keys, self.spec.distribution,
                         factor_is_zero)

    # -- gradients ------------------------------------------------------------------------------
    def value_and_grad(self, loss_fn: Callable, *, has_aux: bool = False,
                       train_others: bool = True) -> Callable:
        """``grad_fn(model, update_index, *args) -> (value, grads)`` for ``loss_fn(model, *args)``.

        ``value`` is what ``nnx.value_and_grad`` gives (``(loss, aux)`` with ``has_aux``);
        ``grads`` an ``nnx.State`` with the paths of ``nnx.state(model, nnx.Param)``: the sketch
        S = G·Aᵀ (*stack, out, r) at each target, the dense gradient elsewhere (zeros, never
        computed, with ``train_others=False``: the KL variant's frozen others). Sketches of
        micro-batches add up like gradients. Feed it to ``nnx.Optimizer(model, tx,
        wrt=nnx.Param).update`` or, as ``nnx.to_pure_dict(grads)``, to ``tx.update``.
        ``update_index`` is ``update_index(opt_state)``, the k of A the next update will use, or
        the ``nnx.Optimizer`` itself, whose LoGRA transformation is then checked to draw the same
        A as this sketch (`check`: another seed or rank in ``logra(...)`` is an error).
        Other state the loss changes (RNG counters, batch statistics) is written back as
        ``nnx.value_and_grad`` does.
        """
        def grad_fn(model, update_index, *args):
            found = self._found(model)
            kernels = set(found)

            def others(path, value):
                return (isinstance(value, nnx.Param) and not isinstance(value, Probe)
                        and "/".join(map(str, path)) not in kernels)
            wrt = nnx.Any(SketchFactor, others) if train_others else SketchFactor
            with _Attached(model, found, self.zero_factors(), self.keys(update_index),
                           self.spec.distribution, True):
                value, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt),
                                                  has_aux=has_aux)(model, *args)
            return value, self._assemble(model, found, grads, train_others)
        return grad_fn

    def _assemble(self, model, found, grads, train_others: bool) -> nnx.State:
        """nnx.State over the model's Param paths: sketches at the kernels, dense (or 0) else."""
        by_owner = {owner: path for path, (owner, _) in found.items()}
        flat, sketches = {}, {}
        for parts, var in nnx.to_flat_state(grads):
            parts = tuple(parts)
            if isinstance(var, SketchFactor):
                path = by_owner[parts[:-1]]
                sketch = var[...]
                if path in self.shardings:   # as its probe, wherever XLA would put the cotangent
                    sketch = jax.lax.with_sharding_constraint(sketch, self.shardings[path])
                sketches[path] = sketch
            elif not isinstance(var, Probe):
                flat[parts] = var
        out = []
        for parts, var in _param_paths(model):
            path = "/".join(map(str, parts))
            if path in found:
                out.append((parts, type(var)(sketches[path])))
            elif parts in flat:
                out.append((parts, flat[parts]))
            elif not train_others:
                out.append((parts, var.replace(jnp.zeros_like(var[...]))))
            else:
                raise AssertionError(f"no gradient for {path!r}")
        return nnx.from_flat_state(out)

    # -- predicted-KL control -------------------------------------------------------------------
    def kl_control(self, model, update_index, logits_fn: Callable, *probe_args,
                   response_mask: jax.Array, temperature: float = 1.0,
                   others_frozen: bool = False, safeguard: bool = True) -> dict[str, Callable]:
        """``{"predict_kl": ..., "candidate_kl": ...}`` for ``tx.update(..., **kl)`` of a
        ``logra(..., kl_control=True)`` (docs/algorithm.md §6), on the probe batch
        ``logits_fn(model, *probe_args) -> logits (..., vocab)``.

        predict_kl: one JVP of the probe logits along the candidate (dB = U at the targets, the
        non-target updates elsewhere), ΔW never formed. candidate_kl (``safeguard``): the exact
        KL of the α-scaled candidate, the model run at W + U·A through the probes' nonzero branch.
        Unlike our Decoder's (which forms the head a few positions at a time), it forms the probe
        batch's whole logits, twice. ``others_frozen``: the non-target updates are zero (the KL
        variant); their tangent is skipped. The updates may be keyed like a pure dict or an
        nnx.State (what nnx.Optimizer passes).
        """
        found = self._found(model)
        graphdef, state = nnx.split(model)
        params = _plain(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        kernels, others = split_targets(params, self.spec)
        keys, zeros = self.keys(update_index), self.zero_factors()

        def logits_at(others_, factors, factor_is_zero):
            copy = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))   # fresh Variables
            nnx.update(copy, merge_targets(others_, kernels))
            with _Attached(copy, found, factors, keys, self.spec.distribution, factor_is_zero):
                return logits_fn(copy, *probe_args)

        predict = make_predict_kl(functools.partial(logits_at, factor_is_zero=True), others, zeros,
                                  response_mask, temperature, others_frozen=others_frozen)
        fns = {"predict_kl": lambda updates: predict(_plain(updates))}
        if safeguard:
            logits_old = logits_fn(model, *probe_args)

            def candidate_kl(updates):
                updates = _plain(updates)
                factors = {path: jnp.asarray(getattr(u, "factor", u), jnp.float32)
                           for path, u in leaves_with_paths(updates) if path in found}
                if others_frozen:
                    others_new = others
                else:
                    others_new = map_with_paths(
                        lambda path, p, u: None if p is None else
                        (p.astype(jnp.float32) + u).astype(p.dtype), others,
                        map_with_paths(lambda path, u: None if path in found else u, updates))
                logits_new = logits_at(others_new, factors, False)
                return exact_kl(logits_old, logits_new, response_mask, temperature)
            fns["candidate_kl"] = candidate_kl
        return fns


def _refuse_explicit_axes(kernel, path: str) -> None:
    """The probes and sketches are laid out with ``with_sharding_constraint``, which takes Auto
    mesh axes only: a kernel on Explicit axes (``jax.make_mesh``'s default) would fail at the
    first gradient, deep inside it. Refused here, in one line saying what to pass."""
    mesh = getattr(getattr(kernel, "sharding", None), "mesh", None)
    if mesh is None or isinstance(kernel, jax.core.Tracer):
        mesh = jax.sharding.get_abstract_mesh()   # inside jax.set_mesh, or abstract arrays
    types = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
    explicit = [name for name, kind in types.items() if kind == jax.sharding.AxisType.Explicit]
    if explicit:
        raise ValueError(
            f"target {path!r} is on a mesh with Explicit axes {explicit} (jax.make_mesh's "
            f"default); nnx_sketch lays its probes out on Auto axes: make the mesh with "
            f"jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * {len(types)})")


def prepare(model, *, targets: str = DEFAULT_TARGETS, rank: int = 256, seed: int = 42,
            distribution: str = "rademacher", refresh: bool = True) -> NNXSketch:
    """Finds ``model``'s targets (params whose '/'-joined path matches ``targets``) and checks that
    each is the kernel of an nnx.Linear, nnx.LinearGeneral or nnx.Einsum; returns the `NNXSketch`
    whose ``logra_kwargs()`` build the optimizer and whose ``value_and_grad`` the gradients.

    Nothing in the model changes. The model may be abstract (``nnx.eval_shape``); with sharded
    arrays the probes and sketches are laid out like the kernels (their stack and out entries).
    The same arguments as ``logra(...)``: rank r (capped at each target's in width), seed,
    distribution and refresh fix A_l(k).
    """
    spec = SketchSpec(targets=targets, rank=rank, seed=seed, distribution=distribution,
                      refresh=refresh)
    found = _find_targets(model, spec)
    spec = dataclasses.replace(spec, layouts={p: t.layout for p, (_, t) in found.items()
                                              if t.layout is not None})
    kernels = {"/".join(map(str, p)): v for p, v in _param_paths(model)}
    for path in found:
        _refuse_explicit_axes(kernels[path].get_value(), path)
    shardings = {}
    for path, (_, t) in found.items():
        sharding = _sketch_sharding(kernels[path].get_value(), t.info)
        if sharding is not None:
            shardings[path] = sharding
    return NNXSketch(spec, {p: t for p, (_, t) in found.items()}, shardings)


__all__ = ["DEFAULT_TARGETS", "NNXSketch", "Probe", "SketchFactor", "SketchKey", "Target", "prepare",
           "register"]
