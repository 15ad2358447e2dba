"""ModelConfig: the hyper-parameters of a Llama-family decoder (SmolLM2, Llama, Qwen2)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder; validated on construction.

    ``dtype`` is the compute dtype of activations and matmuls, ``param_dtype`` the storage dtype of the
    (master) weights — e.g. bf16 compute over fp32 params. ``remat`` wraps each scanned layer in
    ``jax.checkpoint`` so backward recomputes the layer instead of storing its activations.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = True
    max_position_embeddings: int = 2048
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"ModelConfig.{name} must be one of {sorted(DTYPES)}, "
                                 f"got {getattr(self, name)!r}")

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        return DTYPES[self.param_dtype]

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def tiny(**overrides) -> ModelConfig:
    """A few-thousand-parameter decoder for tests: 2 layers, GQA 4:2, untied head, qkv bias."""
    base = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                intermediate_size=64, rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True,
                tie_embeddings=False, max_position_embeddings=128)
    base.update(overrides)
    return ModelConfig(**base)
