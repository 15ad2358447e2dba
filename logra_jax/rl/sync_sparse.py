"""Sparse weight patches for the ``sparse`` sync mode: only the sampler-dtype entries that changed.

A leaf whose sampler-dtype bits changed in c of its n entries (b bytes each) is sent in whichever
encoding is smallest, chosen per leaf and per message:

    indices   c·(4 + b)          flat int32 index + new value of each changed entry
    bitmap    ⌈n/8⌉ + c·b         one bit per entry (changed or not), then the changed values in order
    dense     n·b                 the whole leaf, as a ``full`` sync sends it

With b = 2 (bf16) indices pay off below c/n = 1/32, the bitmap up to c/n = 15/16, and dense above
that: a leaf is never sent in more bytes than a full sync would send it. An fp32 master copy moves
nearly every bf16 entry each step (dense), stochastic rounding of bf16 weights a few percent
(bitmap), the KL variant's sub-ulp steps almost none (indices).

Bits, not values, are compared, so a -0 → +0 flip or a NaN is sent like any other change and the
receiver ends up bit-identical to the sender's cast, in every encoding: both sides only move bits
(a scatter, a select, an integer prefix sum), no arithmetic on the values.

JAX needs static shapes, and c differs every step. The changed values (and indices) are therefore
padded to a *bucket* size: the smallest m·2^e ≥ c with m ∈ {4, 5, 6, 7} (at most 25 % padding,
a handful of compiled shapes per leaf over a run), never more than n. Padding slots carry the
index n (one past the end), which the receiver's scatter drops. The padded arrays are what crosses
the wire, their bytes are what the sync reports, and the choice of encoding counts them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

INDEX_DTYPE = jnp.int32
INDEX_BYTES = 4
MIN_BUCKET = 64   # = 4·2⁴; smaller patches are padded to it
ENCODINGS = ("indices", "bitmap", "dense")


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


def capacity(count: int, size: int) -> int:
    """Padded number of changed entries a patch of a ``size``-entry leaf carries."""
    return min(bucket_size(count), size)


def encoding_bytes(count: int, size: int, itemsize: int) -> dict[str, int]:
    """{encoding: bytes on the wire} for ``count`` changed entries of a ``size``-entry leaf."""
    slots = capacity(count, size)
    return {"indices": slots * (INDEX_BYTES + itemsize),
            "bitmap": math.ceil(size / 8) + slots * itemsize,
            "dense": size * itemsize}


def choose_encoding(count: int, size: int, itemsize: int) -> tuple[str | None, int]:
    """(the cheapest encoding, its bytes); (None, 0) when nothing changed. Ties go to the
    simpler encoding (dense, then indices)."""
    if count == 0:
        return None, 0
    options = encoding_bytes(count, size, itemsize)
    name = min(("dense", "indices", "bitmap"), key=options.__getitem__)
    return name, options[name]


def check_indexable(path: str, size: int) -> None:
    """Flat int32 indices address at most 2³¹ − 1 entries per leaf (Qwen2.5-7B's largest: 1.9e9)."""
    if size >= np.iinfo(np.int32).max:
        raise ValueError(f"sparse sync: leaf {path!r} has {size} entries, more than int32 flat "
                         f"indices can address; use sync mode 'full' or 'factors' for this model")


def _bits(x: jax.Array) -> jax.Array:
    unsigned = {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned)


def _changed(new: jax.Array, old: jax.Array) -> jax.Array:
    """Leaf-shaped bool: the entries whose bits differ."""
    return _bits(new) != _bits(old)


def _numbered(changed: jax.Array) -> jax.Array:
    """Leaf-shaped int32: how many changed entries precede each entry in flat (row-major) order.

    Counted in two levels over the leaf's rows (its last axis): the changed entries before each
    row, then those before the entry within its row. Exact integers in any summation order. Not one
    prefix sum over the flattened leaf: that is a reduce-window as long as the leaf, and for a leaf
    sharded over both of its axes (an embedding [V, d] on an fsdp × tensor mesh) XLA's partitioner
    made of it a program that ran for over an hour on SmolLM2's 49152 × 576 embedding on 4 CPU
    devices (0.8 s in two levels).
    """
    rows = changed.reshape(-1, changed.shape[-1] if changed.ndim else 1)
    per_row = jnp.sum(rows, axis=1, dtype=jnp.int32)
    before_row = jnp.cumsum(per_row, dtype=jnp.int32) - per_row
    within_row = jnp.cumsum(rows, axis=1, dtype=jnp.int32) - rows
    return (before_row[:, None] + within_row).reshape(changed.shape)


@jax.jit
def count_changes(new: dict[str, jax.Array], old: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """{path: number of entries whose bits differ} (int32 scalars, one program for all leaves)."""
    return {path: jnp.sum(_changed(new[path], old[path]), dtype=jnp.int32) for path in new}


def _changed_values(new: jax.Array, changed: jax.Array, slots: int):
    """(flat indices, values) of the changed entries in index order, padded with index size:
    each changed entry is scattered into the slot its number names."""
    slot = jnp.where(changed, _numbered(changed), slots).reshape(-1)
    flat_index = jnp.arange(new.size, dtype=INDEX_DTYPE)
    indices = jnp.full((slots,), new.size, INDEX_DTYPE).at[slot].set(flat_index, mode="drop")
    return indices, jnp.take(new.reshape(-1), indices, mode="clip")


@functools.partial(jax.jit, static_argnames="capacity")
def encode(new: jax.Array, old: jax.Array, *, capacity: int) -> tuple[jax.Array, jax.Array]:
    """(indices [capacity] int32, values [capacity]) of the changed entries, padded with index size."""
    return _changed_values(new, _changed(new, old), capacity)


@functools.partial(jax.jit, static_argnames="capacity")
def encode_bitmap(new: jax.Array, old: jax.Array, *, capacity: int) -> tuple[jax.Array, jax.Array]:
    """(bitmap [⌈size/8⌉] uint8, values [capacity]): bit i (big-endian within a byte, as
    ``jnp.packbits``) says whether flat entry i changed; the values are the changed entries'."""
    changed = _changed(new, old)
    return jnp.packbits(changed.reshape(-1)), _changed_values(new, changed, capacity)[1]


def apply_patch(leaf: jax.Array, indices: jax.Array, values: jax.Array) -> jax.Array:
    """leaf with leaf.flat[indices] = values; padding indices (== size) are dropped."""
    flat = leaf.reshape(-1).at[indices].set(values.astype(leaf.dtype), mode="drop")
    return flat.reshape(leaf.shape)


def apply_bitmap(leaf: jax.Array, bitmap: jax.Array, values: jax.Array) -> jax.Array:
    """leaf with its j-th changed entry (in flat order) set to values[j]: the bitmap's entries are
    numbered by `_numbered`, an exact integer count whatever order XLA sums in."""
    changed = jnp.unpackbits(bitmap, count=leaf.size).astype(bool).reshape(leaf.shape)
    new = jnp.take(values.astype(leaf.dtype), _numbered(changed), mode="clip")
    return jnp.where(changed, new, leaf)
