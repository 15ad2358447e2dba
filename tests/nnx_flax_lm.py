"""A small transformer built only from flax's own layers, for the tests of logra_jax.nnx_sketch.

Nothing here knows about LoGRA. embedding → a stack of blocks made by ``nnx.vmap`` and run by
``nnx.scan``, optionally under ``nnx.remat`` (attention: ``nnx.MultiHeadAttention``, whose q/k/v/o are ``nnx.LinearGeneral``
with kernels (L, d, heads, head_dim) and (L, heads, head_dim, d); MLP: ``nnx.Linear``) → one
Gemma-style attention of ``nnx.Einsum`` layers (q 'BTD,NDH->BTNH', kv 'BSD,CKDH->CBSKH',
o 'BTNH,NHD->BTD': kernels whose in axis sits between out axes) → ``nnx.Linear`` head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

TARGETS = r"(attn/(query|key|value|out)|mlp/(up|down)|top/(q|kv|o))/kernel$"


class MLP(nnx.Module):
    def __init__(self, d: int, f: int, rngs: nnx.Rngs):
        self.up = nnx.Linear(d, f, rngs=rngs)
        self.down = nnx.Linear(f, d, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    def __init__(self, d: int, f: int, heads: int, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d, rngs=rngs)
        self.mlp = MLP(d, f, rngs)

    def __call__(self, h, mask):
        h = h + self.attn(self.norm1(h), mask=mask)
        return h + self.mlp(self.norm2(h))


class EinsumAttention(nnx.Module):
    def __init__(self, d: int, heads: int, head_dim: int, rngs: nnx.Rngs):
        self.head_dim = head_dim
        self.q = nnx.Einsum("BTD,NDH->BTNH", (heads, d, head_dim), rngs=rngs)
        self.kv = nnx.Einsum("BSD,CKDH->CBSKH", (2, heads, d, head_dim), rngs=rngs)
        self.o = nnx.Einsum("BTNH,NHD->BTD", (heads, head_dim, d), rngs=rngs)

    def __call__(self, x, mask):
        q = self.q(x)
        k, v = self.kv(x)
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / jnp.sqrt(float(self.head_dim))
        probs = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
        return self.o(jnp.einsum("BNTS,BSNH->BTNH", probs, v))


class FlaxLM(nnx.Module):
    def __init__(self, vocab: int = 32, d: int = 16, f: int = 32, heads: int = 2,
                 num_layers: int = 2, *, remat: bool = False, rngs: nnx.Rngs):
        self.remat = remat
        self.embed = nnx.Embed(vocab, d, rngs=rngs)

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_block(rngs):
            return Block(d, f, heads, rngs)
        self.layers = make_block(rngs)
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.top = EinsumAttention(d, heads, d // heads, rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)                       # (b, 1, t, t)

        def body(h, block, mask):
            return block(h, mask)
        if self.remat:   # backward recomputes each block from its input
            body = nnx.remat(body)
        run = nnx.scan(body, in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
        h = run(self.embed(tokens), self.layers, mask)
        h = h + self.top(self.norm(h), mask)
        return self.head(h)


def next_token_loss(model, tokens):
    """Mean next-token cross-entropy (fp32)."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
