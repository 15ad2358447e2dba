"""Device meshes, logical-axis sharding rules for the model's parameters, and batch-sharded activations.

Every parameter carries the names of its dimensions ("logical axes", e.g. ``("layers", "embed", "mlp")``)
as Variable metadata under the key ``logical_axes``. A rule table maps each logical name to a mesh axis
(or to ``None``: replicated). That indirection lets one model run unchanged on any mesh:
FSDP shards ``embed`` over ``fsdp``; tensor parallelism shards heads / MLP width / vocabulary over
``tensor``; the stacked-layer dimension is never sharded because ``lax.scan`` slices it.

Why our own metadata key and not flax's ``sharding_names``/``out_sharding``: flax 0.12 shards such
variables eagerly when they are created (``flax_always_shard_variable`` is on by default), which fails
outside a mesh context and needs mesh axis names at model-construction time. A plain metadata key is
inert: models are built unsharded, anywhere, and placed later with :func:`shard_model`. Flax copies
Variable metadata into derived variables (``nnx.vmap`` outputs, ``nnx.Optimizer`` state), so state
shaped like a parameter inherits its logical axes.

Shardings derived from the params' (:func:`batch_sharding`, :func:`opt_state_shardings`,
:func:`sketch_shardings`) are the one place each layout is decided, for the trainer, the memory
report and the benchmarks alike.

Activations are split by batch over ``fsdp`` (:func:`shard_batch`): FSDP's contract is that every
device computes its own rows with all-gathered weights. Propagation alone does not give that — with
weights sharded on ``embed`` over the same axis, XLA may keep activations whole and run every row
on every device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from logra_jax.tree_paths import leaves_with_paths, map_with_paths

LOGICAL_AXES_KEY = "logical_axes"

# logical axis name -> mesh axis name (None: replicated). Unknown names are replicated too.
DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "fsdp"),       # activations / data: data-parallel over the fsdp axis
    ("embed", "fsdp"),       # FSDP: every weight is split along the model width
    ("heads", "tensor"),     # q / o projections, column- and row-parallel
    ("kv_heads", "tensor"),  # k / v projections
    ("mlp", "tensor"),       # gate / up / down
    ("vocab", "tensor"),     # embedding table and lm_head
    ("layers", None),        # the scanned stack dimension
    ("norm", None),          # RMSNorm scales: tiny, replicated
    ("length", None),
)

Rules = Sequence[tuple[str, str | None]] | Mapping[str, str | None]


def make_mesh(axes: Mapping[str, int] | Sequence[tuple[str, int]], devices=None) -> Mesh:
    """A mesh with named axes, e.g. ``make_mesh({"fsdp": 4, "tensor": 2})``.

    Axes are ``AxisType.Auto`` (GSPMD propagation): jax 0.10's ``jax.make_mesh`` default of Explicit
    axes would demand sharding annotations on every intermediate. ``devices`` defaults to all
    devices; the product of the axis sizes must equal their number.
    """
    pairs = list(axes.items()) if isinstance(axes, Mapping) else [tuple(p) for p in axes]
    if not pairs:
        raise ValueError("make_mesh needs at least one axis, e.g. {'fsdp': 8, 'tensor': 1}")
    names = [name for name, _ in pairs]
    sizes = [size for _, size in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"make_mesh: axis names must be unique, got {names}")
    for name, size in pairs:
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"make_mesh: axis {name!r} must have a positive int size, got {size!r}")
    devices = list(jax.devices() if devices is None else devices)
    product = math.prod(sizes)
    if product != len(devices):
        raise ValueError(f"make_mesh: axis sizes {dict(pairs)} multiply to {product}, but there are "
                         f"{len(devices)} devices; the product must equal the device count")
    return jax.make_mesh(tuple(int(s) for s in sizes), tuple(names),
                         axis_types=(AxisType.Auto,) * len(names), devices=devices)


def _rules_dict(rules: Rules | None) -> dict[str, Any]:
    if rules is None:
        rules = DEFAULT_RULES
    return dict(rules.items()) if isinstance(rules, Mapping) else dict(rules)


def logical_to_spec(logical_axes: Sequence[str | None], mesh: Mesh, rules: Rules | None = None,
                    shape: Sequence[int] | None = None) -> PartitionSpec:
    """The PartitionSpec for an array whose dimensions carry ``logical_axes``.

    A dimension stays replicated when its rule says None, its mesh axis is absent from ``mesh``, the
    mesh axis was already used by an earlier dimension (a mesh axis may shard one dimension only),
    or — given ``shape`` — the dimension is not divisible by the mesh axis size. The last case is a
    deliberate fallback, not an error: e.g. 3 kv-heads×64 on a tensor axis of 4 simply stays whole,
    so any model runs on any mesh, at the cost of replicating that weight.
    """
    table = _rules_dict(rules)
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"logical axes {tuple(logical_axes)} name {len(logical_axes)} dimensions "
                         f"but the array has shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(logical_axes):
        mesh_axis = table.get(name) if name is not None else None
        if mesh_axis is None or mesh_axis not in mesh.shape or mesh_axis in used:
            spec.append(None)
            continue
        if shape is not None and shape[dim] % mesh.shape[mesh_axis]:
            spec.append(None)  # not divisible: replicate this dimension (see docstring)
            continue
        used.add(mesh_axis)
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def logical_sharding(logical_axes: Sequence[str | None], mesh: Mesh, rules: Rules | None = None,
                     shape: Sequence[int] | None = None) -> NamedSharding:
    """NamedSharding of an array with ``logical_axes`` (see :func:`logical_to_spec`)."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, mesh, rules, shape))


def set_logical_axes(variable: nnx.Variable, logical_axes: Sequence[str | None]) -> None:
    """Record the logical axis names of ``variable``'s dimensions (checked against its rank)."""
    logical_axes = tuple(logical_axes)
    if len(logical_axes) != variable[...].ndim:
        raise ValueError(f"logical axes {logical_axes} do not match a variable of shape "
                         f"{variable[...].shape}")
    variable.set_metadata(**{LOGICAL_AXES_KEY: logical_axes})


def get_logical_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    return variable.get_metadata().get(LOGICAL_AXES_KEY)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(model_or_state, mesh: Mesh, rules: Rules | None = None, *,
                    filter=nnx.Param):
    """An ``nnx.State`` of NamedSharding, one per Variable, from the logical-axes metadata.

    ``model_or_state`` is an ``nnx.Module`` (its Variables matching ``filter`` are taken: Params by
    default) or an ``nnx.State`` (all its Variables). The result has the state's structure with each
    Variable replaced by its NamedSharding, so it is a valid sharding prefix for ``jax.device_put``
    and for ``jax.jit``'s ``in_shardings``/``out_shardings`` of that state. A Variable without
    logical axes is replicated. A Param whose axes do not match its rank is an error naming its
    path; any other Variable (optimizer state shaped unlike its parameter) is then replicated.
    """
    state = nnx.state(model_or_state, filter) if isinstance(model_or_state, nnx.Module) else model_or_state

    def one(path, variable):
        if not _is_variable(variable):  # a raw array leaf (e.g. a pure-dict state): replicate
            return NamedSharding(mesh, PartitionSpec())
        axes = get_logical_axes(variable)
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        shape = variable.get_value().shape   # an array or a ShapeDtypeStruct (a plan)
        if len(axes) != len(shape):
            if not isinstance(variable, nnx.Param):
                # Optimizer state inherits its parameter's metadata but may drop dims (e.g. a per-row
                # second moment of a matrix): such a derived, smaller array is replicated.
                return NamedSharding(mesh, PartitionSpec())
            raise ValueError(f"parameter {jax.tree_util.keystr(path, simple=True, separator='/')}: "
                             f"logical axes {axes} do not match its shape {shape}")
        return logical_sharding(axes, mesh, rules, shape)

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules | None = None) -> nnx.Module:
    """Place every Variable of ``model`` on ``mesh`` per the rules (in place); returns ``model``."""
    state = nnx.state(model)
    shardings = param_shardings(state, mesh, rules)
    nnx.update(model, jax.device_put(state, shardings))
    return model


BATCH_AXIS = "fsdp"


def shard_batch(x: jax.Array) -> jax.Array:
    """``x`` with its leading (batch) dimension split over ``fsdp`` of the mesh in context.

    The context is ``jax.sharding.use_abstract_mesh(mesh.abstract_mesh)`` (``PolicyUpdate`` sets it
    while tracing its step). Without a mesh in context, without an ``fsdp`` axis > 1, or when the
    rows do not divide evenly (e.g. a 2-row probe on 4 devices), ``x`` is returned as it is.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or BATCH_AXIS not in mesh.axis_names:
        return x
    size = mesh.shape[BATCH_AXIS]
    if size == 1 or x.ndim == 0 or x.shape[0] % size:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(BATCH_AXIS))


def shard_features(x: jax.Array) -> jax.Array:
    """``x`` [..., d] with d split over ``fsdp`` and every row whole, on the mesh in context.

    For a product of a few rows with a weight split the same way along d (FSDP's ``embed``): each
    device multiplies its slice of d and the partial products are summed, rows × out numbers,
    instead of every device gathering the whole weight. The sampler's logits (128 rows): the
    Llama-3.1-70B head gathered is 2 GiB per chip at every token, the partial logits 63 MiB.
    Returned as it is under the conditions of :func:`shard_batch`, or when d does not divide.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or BATCH_AXIS not in mesh.axis_names:
        return x
    size = mesh.shape[BATCH_AXIS]
    if size == 1 or x.ndim == 0 or x.shape[-1] % size:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*(None,) * (x.ndim - 1), BATCH_AXIS))


def mesh_of(tree) -> Mesh | None:
    """The one mesh every NamedSharding in ``tree`` (arrays or ShapeDtypeStructs) lies on; None when
    there are none or several. What a jitted program traces under (``jax.sharding.use_abstract_mesh``)
    so that :func:`shard_batch` splits its activations."""
    meshes = {x.sharding.mesh for x in jax.tree.leaves(tree)
              if isinstance(getattr(x, "sharding", None), NamedSharding)}
    return meshes.pop() if len(meshes) == 1 else None


def batch_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """Rows over the ``fsdp`` axis when they divide evenly, else replicated."""
    divides = BATCH_AXIS in mesh.shape and rows % mesh.shape[BATCH_AXIS] == 0
    return NamedSharding(mesh, PartitionSpec(BATCH_AXIS if divides else None))


# ----------------------------------------------------------------------------------------------
# Layouts of things shaped like the params: optimizer state and sketches
# ----------------------------------------------------------------------------------------------
def sharding_without_in_dim(param, keep_last: bool, layout=None) -> NamedSharding | None:
    """The param's NamedSharding with its ``in`` entry dropped (for v and sketches), if it has one.

    ``keep_last`` appends a replicated entry (the rank dim of a sketch). Only concrete arrays carry
    a sharding; under tracing this returns None and XLA's propagation decides. ``layout``
    (projections.KernelLayout) names the stack, in and out axes of a kernel that is not
    (*stack, in, out); its out axes become one, which keeps the first out axis's mesh axes when the
    others are unsharded (a row-major flattening keeps those blocks contiguous), else none.
    """
    sharding = getattr(param, "sharding", None)
    if not isinstance(sharding, NamedSharding) or isinstance(param, jax.core.Tracer):
        return None
    spec = tuple(sharding.spec) + (None,) * (param.ndim - len(sharding.spec))
    if layout is None:
        new = spec[:-2] + spec[-1:]
    else:
        first, *rest = (spec[a] for a in layout.outputs)
        out = first if all(e is None for e in rest) else None
        new = tuple(spec[a] for a in layout.stack) + (out,)
    new = new + ((None,) if keep_last else ())
    return NamedSharding(sharding.mesh, PartitionSpec(*new))


def _owning_param(path: str, params_by_path: dict[str, Any]) -> str | None:
    """The longest param path that ``path`` ends with (optax nests param-shaped trees in state)."""
    best = None
    for candidate in params_by_path:
        if path == candidate or path.endswith("/" + candidate):
            if best is None or len(candidate) > len(best):
                best = candidate
    return best


def sharded_like_matrix(shape, param) -> NamedSharding | None:
    """(*stack, a, b) laid out like the param (*stack, in, out): the stack as the param's, and a or
    b as the param's in or out entry of the same size (each mesh axis used once); else None."""
    sharding = getattr(param, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (param.ndim - len(sharding.spec))
    by_size = {param.shape[-2]: spec[-2], param.shape[-1]: spec[-1]}
    trailing, used = [], set()
    for size in shape[-2:]:
        entry = by_size.get(size)
        axes = set(entry if isinstance(entry, tuple) else (entry,)) - {None}
        if entry is not None and not axes & used:
            trailing.append(entry)
            used |= axes
        else:
            trailing.append(None)
    if all(e is None for e in trailing):
        return None
    return NamedSharding(sharding.mesh, PartitionSpec(*(spec[:-2] + tuple(trailing))))


def opt_state_shardings(tx, params):
    """Shardings for ``tx.init(params)``: each leaf like the parameter it belongs to.

    A leaf shaped like its parameter (Adam's m and v) takes the parameter's sharding; one shaped
    like the parameter without its ``in`` dimension (RowAdam's per-row v, shape (*stack, out))
    takes that sharding with the ``in`` entry dropped; a matrix stack with the parameter's stack
    and one of its ``in`` / ``out`` sizes (GaLore's projector (*stack, out, r) and low-rank moments
    (*stack, in, r) or (*stack, r, out)) shards that axis as the parameter does; counters and other
    leaves are replicated.
    ``jax.jit(tx.init)`` cannot be used for this: its outputs do not depend on the params' values,
    so XLA places them all on one device.
    """
    params_by_path = dict(leaves_with_paths(params))
    mesh = next(x.sharding.mesh for x in params_by_path.values()
                if isinstance(x.sharding, NamedSharding))
    replicated = NamedSharding(mesh, PartitionSpec())
    shapes = jax.eval_shape(tx.init, params)

    def one(path, leaf):
        owner = _owning_param(path, params_by_path)
        if owner is None or leaf.ndim == 0:
            return replicated
        param = params_by_path[owner]
        if tuple(leaf.shape) == tuple(param.shape):
            return param.sharding
        if param.ndim >= 2 and tuple(leaf.shape) == tuple(param.shape[:-2]) + (param.shape[-1],):
            return sharding_without_in_dim(param, keep_last=False)
        if param.ndim >= 2 and leaf.ndim == param.ndim and leaf.shape[:-2] == param.shape[:-2]:
            return sharded_like_matrix(leaf.shape, param) or replicated
        return replicated

    return map_with_paths(one, shapes)


def sketch_shardings(params, sketch) -> dict[str, NamedSharding]:
    """{target path: sharding of its sketch (*stack, out, r)} from the kernels' shardings.

    ``sketch`` is the SketchSpec (its ``is_target`` picks the kernels). The sketch keeps the
    kernel's stack and ``out`` entries, and the mesh axes that sharded the kernel's ``in``
    dimension move to ``out`` when it divides: without that an FSDP-sharded kernel (in over fsdp,
    out over a tensor axis of size 1) would get a sketch — and a sketch accumulator — replicated on
    every device (measured at Qwen2.5-7B shapes on 4 devices: 1.4 GiB per copy). Params without
    NamedShardings (e.g. on one device) give {}.
    """
    out = {}
    for path, leaf in leaves_with_paths(params):
        sharding = getattr(leaf, "sharding", None)
        if not sketch.is_target(path) or not isinstance(sharding, NamedSharding):
            continue
        spec = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
        *stack, s_in, s_out = spec

        def axes(entry):
            return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

        merged = axes(s_out) + tuple(a for a in axes(s_in) if a not in axes(s_out))
        size = 1
        for a in merged:
            size *= sharding.mesh.shape[a]
        new_out = merged if merged and leaf.shape[-1] % size == 0 else s_out
        out[path] = NamedSharding(sharding.mesh, PartitionSpec(*stack, new_out or None, None))
    return out
