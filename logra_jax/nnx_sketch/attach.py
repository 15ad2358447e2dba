"""Giving a model's target layers their probes for one call, and taking them back.

Each target layer is given, for that call only, a zero probe B (*stack, out, r) and the keys of A
(*stack, 2) as two Variables of its own (``SketchFactor``, ``SketchKey``; both ``Probe``, an
``nnx.Param`` kind, so an ``nnx.scan``/``nnx.vmap`` over a stack of layers slices them with the
kernels whatever its ``StateAxes`` do with other state), and its class is swapped for the sketched
subclass (branch.py). Afterwards the model is as it was: parameter paths, values, Variable
metadata and graph are unchanged.
"""

from __future__ import annotations

from flax import nnx

from logra_jax.nnx_sketch.branch import ACTIVE, ProbeFacts, sketched_class
from logra_jax.nnx_sketch.discovery import modules_of


class Probe(nnx.Param):
    """What a target layer carries during one gradient call. An ``nnx.Param`` kind, so that a scan
    over a layer stack slices it with the kernels; a loss that sums over ``nnx.state(model,
    nnx.Param)`` (a weight penalty) should leave it out: ``nnx.All(nnx.Param, nnx.Not(Probe))``."""


class SketchFactor(Probe):
    """The zero probe B (*stack, out, r) of a target layer during one gradient: ∂L/∂B = S."""


class SketchKey(Probe):
    """The key data (*stack, 2) of A_l(k) for every layer of a target, during one gradient."""


class Attached:
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
        modules = modules_of(self.model)
        try:
            for path, (owner, target) in self.targets.items():
                layer = modules[owner]
                cls = type(layer)
                object.__setattr__(layer, "__class__", sketched_class(cls))
                self.done.append((layer, cls))
                layer.logra_sketch = ProbeFacts(path, target.product, target.info.in_dim,
                                                self.distribution, self.factor_is_zero)
                layer.logra_factor = SketchFactor(self.factors[path])
                layer.logra_key = SketchKey(self.keys[path])
        except BaseException:
            self._restore()
            raise
        ACTIVE.append(self)
        return self.model

    def _restore(self):
        for layer, cls in reversed(self.done):
            for name in ("logra_sketch", "logra_factor", "logra_key"):
                if name in vars(layer):
                    delattr(layer, name)
            object.__setattr__(layer, "__class__", cls)
        self.done = []

    def __exit__(self, exc_type=None, *exc):
        if self in ACTIVE:
            ACTIVE.remove(self)
        self._restore()
        missed = sorted(set(self.targets) - self.called)
        if exc_type is None and missed:
            raise ValueError(f"targets {missed} were never called through their layer: the model "
                             f"uses these kernels some other way (e.g. reads layer.kernel itself), "
                             f"which LoGRA cannot sketch; leave them out of the targets pattern")
        return False
