"""KVCache: the keys and values of every layer for incremental decoding, as a pytree."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys/values of all layers for ``S`` slots, stacked over layers so ``lax.scan`` slices them.

    k:     [L, b, kv_heads, head_dim, S] and v: [L, b, kv_heads, S, head_dim], compute dtype:
           each in the layout of its attention product, so XLA's CPU backend multiplies the
           cache as it lies. Decoding a token reads every slot of every layer in two products,
           q·K (contracting head_dim) and weights·V (contracting S); with both as [b, S, kv, d]
           it wrote a transposed copy of each layer's whole K and V before those products, and
           ran them as slow general dots (SmolLM2 at batch 16: attention's products 17 → 4 ms
           of a decode step in a per-operation profile; docs/results/sampler.md).
    index: int32 scalar, the next slot to write (may be traced: writes use dynamic_update_slice).
    mask:  bool [b, S], True where a slot holds a real token (padding and unwritten slots are False).

    A call with ``t`` new tokens writes slots [index, index + t) and returns a cache with
    ``index + t``; query i (slot index + i) attends to slots j ≤ index + i with mask[j].
    The decoder rejects an overflow (index + t > S) when index is concrete; under jit, with index
    traced, the caller must guarantee it (dynamic_update_slice would clamp the write position).
    """

    k: jax.Array
    v: jax.Array
    index: jax.Array
    mask: jax.Array

    @property
    def per_layer(self) -> bool:
        """True when k and v are tuples of one array per layer (the stack's layout less L)."""
        return isinstance(self.k, tuple)

    @property
    def max_len(self) -> int:
        return (self.v[0] if self.per_layer else self.v).shape[-2]

    @property
    def batch_size(self) -> int:
        return (self.k[0] if self.per_layer else self.k).shape[-4]

    def unstacked(self) -> "KVCache":
        """The same cache with one key and one value array per layer (a decode loop then updates
        each layer's slot in place instead of re-assembling a stack)."""
        if self.per_layer:
            return self
        return dataclasses.replace(self, k=tuple(self.k), v=tuple(self.v))

    @classmethod
    def create(cls, *, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
               dtype=jnp.float32) -> "KVCache":
        """An empty cache: zero keys/values, index 0, no valid slot."""
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs batch > 0 and max_len > 0, got batch={batch}, "
                             f"max_len={max_len}")
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(k=jnp.zeros(shape[:3] + (head_dim, max_len), dtype), v=jnp.zeros(shape, dtype),
                   index=jnp.zeros((), jnp.int32), mask=jnp.zeros((batch, max_len), bool))
