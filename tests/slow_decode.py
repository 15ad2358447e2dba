"""A policy whose decode steps of one program sleep: what a loaded machine looks like to a clock."""

import time

import jax
import numpy as np

# A decode step of the mode named here sleeps.
SLOW = {"mode": None, "seconds": 0.05}


def _slowed(mode: str, hidden):
    def sleep(x):
        if SLOW["mode"] == mode:
            time.sleep(SLOW["seconds"])
        return np.zeros_like(x)
    # Of the step's own hidden state (nothing XLA could hoist out of the decode loop), and a result
    # the step uses (the call cannot finish before the sleep does).
    return hidden + jax.pure_callback(sleep, jax.ShapeDtypeStruct((), hidden.dtype),
                                      hidden.reshape(-1)[0])


class SlowablePolicy:
    """A Policy whose decode steps pass through `_slowed`: a per-layer step is one called with
    ``layers``, a stacked step one without ``layers`` that is not the prefill."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def bind(self, params):
        model = self.inner.bind(params)
        original = type(model).__call__

        class Slowable(type(model)):
            def __call__(self, *args, layers=None, prefill=False, **kwargs):
                hidden, cache = original(self, *args, layers=layers, prefill=prefill, **kwargs)
                if not prefill:
                    hidden = _slowed("stacked" if layers is None else "per_layer", hidden)
                return hidden, cache

        model.__class__ = Slowable
        return model

    def probes(self, params, probes=None):
        return self.inner.probes(params, probes)
