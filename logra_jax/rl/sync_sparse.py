"""Sparse weight patches for the ``sparse`` sync mode: only the sampler-dtype entries that changed.

A patch of one leaf is (flat int32 indices, new values) of the entries whose sampler-dtype bits
differ from what the receiver holds. Bits, not values, are compared, so a -0 → +0 flip or a NaN is
sent like any other change and the receiver ends up bit-identical to the sender's cast.

JAX needs static shapes, and the number of changed entries differs every step. A patch is therefore
padded to a *bucket* size: the smallest m·2^e ≥ count with m ∈ {4, 5, 6, 7} (at most 25 % padding,
a handful of compiled shapes per leaf over a run). Padding slots carry the index ``size`` (one past
the end), which the receiver's scatter drops. The padded arrays are what crosses the wire, and
their bytes are what the sync reports.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

INDEX_DTYPE = jnp.int32
MIN_BUCKET = 64   # = 4·2⁴; smaller patches are padded to it


def bucket_size(count: int) -> int:
    """Smallest m·2^e ≥ count with m ∈ {4, 5, 6, 7} (at least MIN_BUCKET); 0 for count 0."""
    if count < 0:
        raise ValueError(f"bucket_size: count must be ≥ 0, got {count}")
    if count == 0:
        return 0
    if count <= MIN_BUCKET:
        return MIN_BUCKET
    exponent = int(count).bit_length() - 3      # 4·2^e ≤ count < 8·2^e
    return next(m << exponent for m in (4, 5, 6, 7, 8) if m << exponent >= count)


def check_indexable(path: str, size: int) -> None:
    """Flat int32 indices address at most 2³¹ − 1 entries per leaf (Qwen2.5-7B's largest: 1.9e9)."""
    if size >= np.iinfo(np.int32).max:
        raise ValueError(f"sparse sync: leaf {path!r} has {size} entries, more than int32 flat "
                         f"indices can address; use sync mode 'full' or 'factors' for this model")


def _bits(x: jax.Array) -> jax.Array:
    unsigned = {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned)


@jax.jit
def count_changes(new: dict[str, jax.Array], old: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """{path: number of entries whose bits differ} (int32 scalars, one program for all leaves)."""
    return {path: jnp.sum(_bits(new[path]) != _bits(old[path]), dtype=jnp.int32) for path in new}


@functools.partial(jax.jit, static_argnames="capacity")
def encode(new: jax.Array, old: jax.Array, *, capacity: int) -> tuple[jax.Array, jax.Array]:
    """(indices [capacity] int32, values [capacity]) of the changed entries, padded with index size."""
    size = new.size
    changed = (_bits(new) != _bits(old)).reshape(-1)
    (indices,) = jnp.nonzero(changed, size=capacity, fill_value=size)
    indices = indices.astype(INDEX_DTYPE)
    values = jnp.take(new.reshape(-1), indices, mode="clip")
    return indices, values


def apply_patch(leaf: jax.Array, indices: jax.Array, values: jax.Array) -> jax.Array:
    """leaf with leaf.flat[indices] = values; padding indices (== size) are dropped."""
    flat = leaf.reshape(-1).at[indices].set(values.astype(leaf.dtype), mode="drop")
    return flat.reshape(leaf.shape)
