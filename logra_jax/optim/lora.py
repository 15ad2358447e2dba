"""LoRA (Hu et al. 2021), the baseline most RL users reach for: a frozen base plus trained adapters.

Every target kernel W (in, out) gets a rank-r adapter, and the layer computes

    y = x·W + s·(x·Aᵀ)·Bᵀ,        A: (r, in) ~ U(±1/√in),  B: (out, r) = 0,  s = α / r

so training starts at the base model. Only A and B are trained (AdamW on them, the base frozen in
the model's param_dtype — 2 bytes per parameter in bf16). The adapter is a probe of the model's
``Linear`` (the side branch the LoGRA sketch probe uses, with a trained A instead of a seeded
one), so the sampler, the update and the KL probes all run base + adapter without a merged copy.
``merge_adapters`` folds them in for export: W ← W + s·Aᵀ·Bᵀ.

The adapters live in the params dict under ``params["lora"]``, keyed by the target's path with
"/" written "." (orbax keys), each {"a": (*stack, r, in), "b": (*stack, out, r)}; checkpoints and
resume then carry them like any parameter.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from logra_jax.optim.targets import SketchSpec
from logra_jax.tree_paths import leaves_with_paths, map_with_paths

LORA_KEY = "lora"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One target's adapter as the model's ``Linear`` reads a probe: y += (x·projection()ᵀ)·factorᵀ."""

    a: jax.Array
    b: jax.Array
    scale: float = dataclasses.field(metadata=dict(static=True))
    factor_is_zero = False   # B is trained: the general branch, not sketched_matmul's B = 0 shortcut

    @property
    def factor(self) -> jax.Array:
        return self.b

    def projection(self, in_dim: int, dtype) -> jax.Array:
        """s·A (r, in): the scale sits on A so the layer's product is the textbook s·B·A."""
        if self.a.shape[-1] != in_dim:
            raise ValueError(f"LoRA adapter A has input width {self.a.shape[-1]}, the layer {in_dim}")
        return (self.a * self.scale).astype(dtype)


def adapter_key(path: str) -> str:
    return path.replace("/", ".")


def kernel_path(key: str) -> str:
    return key.replace(".", "/")


def init_adapters(params: dict, targets: str, rank: int, seed: int) -> dict:
    """{adapter key: {"a", "b"}} for every kernel ``targets`` matches: A uniform in ±1/√in (the
    Kaiming-uniform bound PEFT uses), B zero, in the kernel's dtype; r capped at min(in, out)."""
    spec = SketchSpec(targets=targets, rank=rank)
    out = {}
    key = jax.random.PRNGKey(seed)
    for i, (path, kernel) in enumerate(leaves_with_paths(params)):
        if not spec.is_target(path):
            continue
        *stack, in_dim, out_dim = kernel.shape
        r = min(rank, in_dim, out_dim)
        bound = 1.0 / math.sqrt(in_dim)
        a = jax.random.uniform(jax.random.fold_in(key, i), (*stack, r, in_dim), jnp.float32,
                               -bound, bound)
        out[adapter_key(path)] = {"a": a.astype(kernel.dtype),
                                  "b": jnp.zeros((*stack, out_dim, r), kernel.dtype)}
    if not out:
        raise ValueError(f"LoRA targets {targets!r} match no parameter")
    return out


def adapter_probes(adapters: dict, scale: float) -> dict[str, LoraAdapter]:
    """{kernel path: LoraAdapter}, what the model takes as ``probes``."""
    return {kernel_path(k): LoraAdapter(v["a"], v["b"], scale) for k, v in adapters.items()}


def merge_adapters(params: dict, scale: float) -> dict:
    """The params without ``"lora"``, every target W replaced by W + s·Aᵀ·Bᵀ (fp32 sum, then the
    kernel's dtype): one model whose logits equal base + adapters."""
    adapters = params.get(LORA_KEY, {})
    merged = {k: v for k, v in params.items() if k != LORA_KEY}

    def add(path, leaf):
        adapter = adapters.get(adapter_key(path))
        if adapter is None:
            return leaf
        delta = jnp.einsum("...ri,...or->...io", adapter["a"].astype(jnp.float32),
                           adapter["b"].astype(jnp.float32))
        return (leaf.astype(jnp.float32) + scale * delta).astype(leaf.dtype)

    return map_with_paths(add, merged)
