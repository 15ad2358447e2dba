"""A sketched projection's backward lowered for a device set: what the tests that keep XLA:CPU's
layout barriers (models/linear.py: `cpu_layout`) out of TPU and GPU programs compile."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from logra_jax.models import linear

# B (the sketch factor), x, W, A, H: small, but shaped as the update's products are.
SHAPES = [(1024, 64), (512, 256), (256, 1024), (64, 256), (512, 1024)]


def _loss(factor, x, kernel, a, h):
    return jnp.sum((linear.sketched_matmul(x, kernel, a, factor) * h).astype(jnp.float32))


def lowered_sketch_backward(devices):
    """jax.grad of a sketched projection, lowered (not compiled) on the first of ``devices``.
    Reads ``linear.cpu_layout`` when traced, so a test may monkeypatch it first."""
    on = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), P())
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=on) for s in SHAPES]
    return jax.jit(jax.grad(_loss)).lower(*args)
