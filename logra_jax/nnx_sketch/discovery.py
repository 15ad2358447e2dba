"""Finding a model's targets: the kernels a pattern names, each a supported layer's, and where
their probes and sketches live on a mesh."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from logra_jax.nnx_sketch.layers import Product, is_default, layout_of, product_of, registered_kind
from logra_jax.optim import SketchSpec, TargetInfo
from logra_jax.projections import KernelLayout


@dataclasses.dataclass(frozen=True)
class Target:
    """One sketched kernel: its path, layer kind, layout (None: Flax's (*stack, in, out)) and the
    optimizer's view of it (``info``: stack, in, out, rank)."""

    path: str
    kind: str
    product: Product
    layout: KernelLayout | None
    info: TargetInfo


def modules_of(model) -> dict[tuple, nnx.Module]:
    return {tuple(p): node for p, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}


def param_paths(model) -> list[tuple[tuple, Any]]:
    return [(tuple(p), v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def _shape(var) -> tuple[int, ...]:
    return tuple(var.get_value().shape)


def find_targets(model, spec: SketchSpec) -> dict[str, tuple[tuple, Target]]:
    """{kernel path: (owner module path, Target)} of every target; ValueError for a target that is
    not a supported layer's kernel, or when nothing matches."""
    modules = modules_of(model)
    found: dict[str, tuple[tuple, Target]] = {}
    layouts = {}
    for parts, var in param_paths(model):
        path = "/".join(str(p) for p in parts)
        if not spec.is_target(path):
            continue
        owner = modules.get(parts[:-1])
        registered = None if owner is None else registered_kind(owner)
        if registered is None or parts[-1] != registered.kernel:
            what = "a parameter" if owner is None else (
                f"the {parts[-1]!r} of a {type(owner).__module__}.{type(owner).__qualname__}")
            raise ValueError(
                f"targets pattern {spec.targets!r} matches {path!r}, {what} at "
                f"{'/'.join(map(str, parts[:-1]))!r}: LoGRA sketches only the kernel of "
                f"nnx.Linear, nnx.LinearGeneral and nnx.Einsum layers (and of our "
                f"models.linear.Linear, or of a class given to nnx_sketch.register)")
        product = product_of(owner, path)
        layout = layout_of(product, len(_shape(var)), path)
        layouts[path] = None if is_default(layout) else layout
        found[path] = (parts[:-1], product)
    spec = dataclasses.replace(spec, layouts={p: l for p, l in layouts.items() if l is not None})
    shapes = {"/".join(map(str, p)): _shape(v) for p, v in param_paths(model)}
    infos = spec.find_targets({p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in shapes.items()})
    return {path: (owner, Target(path, product.kind, product, layouts[path], infos[path]))
            for path, (owner, product) in found.items()}


def sketch_sharding(kernel, info: TargetInfo) -> NamedSharding | None:
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


def refuse_explicit_axes(kernel, path: str) -> None:
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
