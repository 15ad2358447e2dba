"""ModelConfig: the hyper-parameters of our decoder family (SmolLM2, Llama 3.1, Qwen2/3, Gemma 3)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from logra_jax.models.rope import RopeScaling

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
MLP_ACTIVATIONS = ("silu", "gelu_tanh")   # SwiGLU (Llama, Qwen) | GeGLU with tanh-GELU (Gemma)
LAYER_TYPES = ("full", "sliding")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder; validated on construction.

    ``dtype`` is the compute dtype of activations and matmuls, ``param_dtype`` the storage dtype of the
    (master) weights — e.g. bf16 compute over fp32 params. ``remat`` wraps each scanned layer in
    ``jax.checkpoint`` so backward recomputes the layer instead of storing its activations.

    The defaults are a Llama/SmolLM2 decoder. The other families switch on features:
      Qwen2      qkv_bias
      Qwen3      qk_norm (an RMSNorm over head_dim on every query and key head, before RoPE)
      Llama 3.1  rope_scaling=RopeScaling("llama3", ...)
      Gemma 3    qk_norm, mlp_activation="gelu_tanh", norm_unit_offset (RMSNorm scale 1 + w),
                 sandwich_norms (norms after attention and MLP too, four per layer), embed_scale
                 (embeddings × √d), query_pre_attn_scalar (scores × its −½ power instead of
                 head_dim's), layer_types with "sliding" layers that see the last sliding_window
                 tokens and rotate with rope_local_theta; "full" layers use rope_theta/rope_scaling.
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
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    mlp_activation: str = "silu"
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    layer_types: tuple[str, ...] = ()         # per layer "full" | "sliding"; () = all full
    sliding_window: int | None = None
    rope_local_theta: float | None = None     # sliding layers' RoPE base (default: rope_theta)

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
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"ModelConfig.mlp_activation must be one of {MLP_ACTIVATIONS}, "
                             f"got {self.mlp_activation!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"ModelConfig.rope_scaling must be a RopeScaling or None, "
                             f"got {self.rope_scaling!r}")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(f"ModelConfig.query_pre_attn_scalar must be > 0, got "
                             f"{self.query_pre_attn_scalar!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_layers} layers")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"ModelConfig.layer_types: {unknown} are not among {LAYER_TYPES}")
        if "sliding" in self.layer_types and not (isinstance(self.sliding_window, int)
                                                  and self.sliding_window > 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive int when layers are "
                             f"'sliding', got {self.sliding_window!r}")
        if self.rope_local_theta is not None and not self.rope_local_theta > 0:
            raise ValueError(f"ModelConfig.rope_local_theta must be > 0, got {self.rope_local_theta!r}")
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

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend only to the last ``sliding_window`` tokens?"""
        return tuple(t == "sliding" for t in self.layer_types) or (False,) * self.num_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def tiny(**overrides) -> ModelConfig:
    """A few-thousand-parameter decoder for tests: 2 layers, GQA 4:2, untied head, qkv bias."""
    base = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                intermediate_size=64, rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True,
                tie_embeddings=False, max_position_embeddings=128)
    base.update(overrides)
    return ModelConfig(**base)
