"""LoGRA's memory-saving path for any Flax NNX model, not only ours (docs/optax_api.md, third part).

Our `Decoder` computes its gradient sketches S = G·Aᵀ in the backward pass because its `Linear`
takes a `SketchProbe` (docs/algorithm.md §3). A model written elsewhere — flax's examples, an NNX
port of Gemma or Qwen, a researcher's own transformer — multiplies its kernels in
``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum``. This package gives those layers the same
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

Its files, one job each: layers.py (the kernel layers it knows and the product each computes),
discovery.py (a model's targets and where their sketches live), branch.py (the sketch branch a
target layer adds), attach.py (giving the layers their probes for one call, and restoring them),
sketch.py (`prepare` and `NNXSketch`, the public entry).
"""

from logra_jax.nnx_sketch.attach import Probe, SketchFactor, SketchKey
from logra_jax.nnx_sketch.discovery import Target
from logra_jax.nnx_sketch.layers import register
from logra_jax.nnx_sketch.sketch import NNXSketch, prepare
from logra_jax.optim import DEFAULT_TARGETS

__all__ = ["DEFAULT_TARGETS", "NNXSketch", "Probe", "SketchFactor", "SketchKey", "Target", "prepare",
           "register"]
