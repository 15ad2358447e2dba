"""A tiny language model for the optimizer tests, built from the project's sketch-aware Linear.

embedding → a scanned stack of blocks (q_proj, up_proj, down_proj: stacked kernels (L, in, out),
plus a per-layer norm scale) → an unstacked gate_proj → lm_head. Targets under the default
pattern: layers/q_proj, layers/up_proj, layers/down_proj (stacked) and gate_proj (plain).
Parameters are a nested dict of arrays, probes a {kernel path: SketchProbe} dict — the project's
trainer conventions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from logra_jax.models.linear import Linear


def _rms(h):
    return h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + 1e-6)


class Block(nnx.Module):
    def __init__(self, d: int, f: int, rngs: nnx.Rngs):
        self.norm = nnx.Param(jnp.ones((d,)))
        self.q_proj = Linear(d, d, rngs=rngs)
        self.up_proj = Linear(d, f, rngs=rngs)
        self.down_proj = Linear(f, d, rngs=rngs)

    def __call__(self, h, probes: dict):
        x = _rms(h) * self.norm[...]
        h = h + jnp.tanh(self.q_proj(x, probes.get("q_proj")))
        return h + self.down_proj(jax.nn.gelu(self.up_proj(x, probes.get("up_proj"))),
                                  probes.get("down_proj"))


class TinyLM(nnx.Module):
    def __init__(self, vocab: int, d: int, f: int, num_layers: int, rngs: nnx.Rngs,
                 remat: bool = True):
        self.remat = remat
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, d)))

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_block(rngs):
            return Block(d, f, rngs)
        self.layers = make_block(rngs)
        self.gate_proj = Linear(d, d, rngs=rngs)
        self.lm_head = Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens, probes: dict | None = None):
        probes = probes or {}
        layer_probes = {path.split("/")[1]: p for path, p in probes.items()
                        if path.startswith("layers/")}
        block_def, block_state = nnx.split(self.layers)

        def body(h, xs):
            state, p = xs
            return nnx.merge(block_def, state)(h, p), None
        if self.remat:
            # As the real decoder does for training (models/llama.py `remat`): backward recomputes a
            # layer from its input. Without it, scan keeps every value the backward needs, and
            # Linear's stop_gradient(kernel) is one: a copy of each stacked target kernel.
            body = jax.checkpoint(body, prevent_cse=False)
        h = self.embed[...][tokens]
        h, _ = jax.lax.scan(body, h, (block_state, layer_probes))
        h = h + jnp.tanh(self.gate_proj(_rms(h), probes.get("gate_proj/kernel")))
        return self.lm_head(_rms(h))


def build(vocab=32, d=8, f=16, num_layers=2, seed=0, remat=True):
    """(graphdef, params dict, logits_fn(params, tokens, probes=None))."""
    model = TinyLM(vocab, d, f, num_layers, nnx.Rngs(seed), remat=remat)
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)

    def logits_fn(params, tokens, probes=None):
        return nnx.merge(graphdef, params)(tokens, probes)
    return graphdef, params, logits_fn


def abstract_build(vocab, d, f, num_layers, remat=True):
    """Shapes only (no arrays): (abstract params dict, logits_fn) for compile-only checks."""
    abstract = nnx.eval_shape(lambda: TinyLM(vocab, d, f, num_layers, nnx.Rngs(0), remat=remat))
    graphdef, state = nnx.split(abstract, nnx.Param)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))

    def logits_fn(params, tokens, probes=None):
        return nnx.merge(graphdef, params)(tokens, probes)
    return params, logits_fn


def next_token_loss(logits_fn):
    """Mean next-token cross-entropy of ``logits_fn(params, tokens, probes)`` (fp32 softmax)."""
    def loss(params, tokens, probes=None):
        logits = logits_fn(params, tokens[:, :-1], probes)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    return loss
