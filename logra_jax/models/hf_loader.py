"""Read a local Hugging Face Llama / Qwen2 / Qwen3 / Gemma 3 folder into our config, layout and tokenizer.

Layout change: HF stores a linear layer's ``weight`` as (out, in) per layer; we store ``kernel`` =
weightᵀ (in, out) stacked over layers (L, in, out). Norm ``weight`` → ``scale``, embedding ``weight``
→ ``embedding``.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import ml_dtypes
import numpy as np

from logra_jax.models.config import ModelConfig
from logra_jax.models.rope import RopeScaling
from logra_jax.models.tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text")
# Multimodal Gemma 3 ("gemma3") stores its language model under one of these prefixes (the
# original checkpoints and transformers' saves; newer in-memory names) beside the vision tower.
_LANGUAGE_MODEL_PREFIXES = (("model.", "lm_head.weight"),
                            ("language_model.model.", "language_model.lm_head.weight"),
                            ("model.language_model.", "lm_head.weight"))
_VISION = re.compile(r"(model\.)?(vision_tower|multi_modal_projector)\..*")

# Per-layer HF tensor name (after "model.layers.{i}.") → our stacked path and whether to transpose.
_LAYER_TENSORS = {
    "input_layernorm.weight": ("layers/input_layernorm/scale", False),
    "post_attention_layernorm.weight": ("layers/post_attention_layernorm/scale", False),
    "self_attn.q_proj.weight": ("layers/self_attn/q_proj/kernel", True),
    "self_attn.k_proj.weight": ("layers/self_attn/k_proj/kernel", True),
    "self_attn.v_proj.weight": ("layers/self_attn/v_proj/kernel", True),
    "self_attn.o_proj.weight": ("layers/self_attn/o_proj/kernel", True),
    "mlp.gate_proj.weight": ("layers/mlp/gate_proj/kernel", True),
    "mlp.up_proj.weight": ("layers/mlp/up_proj/kernel", True),
    "mlp.down_proj.weight": ("layers/mlp/down_proj/kernel", True),
}
_QK_NORM_TENSORS = {
    "self_attn.q_norm.weight": ("layers/self_attn/q_norm/scale", False),
    "self_attn.k_norm.weight": ("layers/self_attn/k_norm/scale", False),
}
_SANDWICH_TENSORS = {
    "pre_feedforward_layernorm.weight": ("layers/pre_feedforward_layernorm/scale", False),
    "post_feedforward_layernorm.weight": ("layers/post_feedforward_layernorm/scale", False),
}
_BIAS_TENSORS = {
    "self_attn.q_proj.bias": ("layers/self_attn/q_proj/bias", False),
    "self_attn.k_proj.bias": ("layers/self_attn/k_proj/bias", False),
    "self_attn.v_proj.bias": ("layers/self_attn/v_proj/bias", False),
}
# Present in some older checkpoints, recomputed by us: safe to skip.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Memory-mapped arrays of a .safetensors file.

    The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
    data_offsets}} and the raw bytes. Read by hand because ``safetensors``' numpy backend cannot
    return bfloat16 (the dtype most checkpoints use); ml_dtypes gives numpy a bfloat16.
    """
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if raw.size < 8:
        raise ValueError(f"{path} is not a safetensors file (too short)")
    header_len = int(raw[:8].view("<u8")[0])
    if 8 + header_len > raw.size:
        raise ValueError(f"{path} is cut short: its header says it takes bytes 8 to "
                         f"{8 + header_len}, but the file has {raw.size} bytes (copy or download "
                         f"it again)")
    try:
        header = json.loads(bytes(raw[8:8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a safetensors file: unreadable header ({e})") from e
    data = raw[8 + header_len:]
    tensors = {}
    for name, info in sorted(header.items(), key=lambda item: _data_end(item[1])):
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]]).newbyteorder("<")
        expected = math.prod(info["shape"]) * dtype.itemsize
        if end > data.size:   # a file cut short (an interrupted copy or download)
            total = 8 + header_len + max(_data_end(i) for i in header.values())
            raise ValueError(f"{path} is cut short: tensor {name!r} ({info['dtype']} "
                             f"{tuple(info['shape'])}) takes bytes {8 + header_len + begin} to "
                             f"{8 + header_len + end}, but the file has {raw.size} of the "
                             f"{total} bytes its header describes (copy or download it again)")
        if end - begin != expected:
            raise ValueError(f"{path}: tensor {name!r} ({info['dtype']} {tuple(info['shape'])}) "
                             f"needs {expected} bytes, its header gives it {end - begin}")
        tensors[name] = data[begin:end].view(dtype).reshape(info["shape"])
    return tensors


def _data_end(info) -> int:
    """Where a header entry's bytes end in the data section (0 for ``__metadata__``)."""
    return int(info["data_offsets"][1]) if isinstance(info, dict) and "data_offsets" in info else 0


def _safetensors_files(folder: pathlib.Path) -> list[pathlib.Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard files that do not exist: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


# The keys each RoPE type reads from a rope_parameters / rope_scaling dict; others are errors.
_ROPE_KEYS = {"default": set(), "linear": {"factor"},
              "llama3": {"factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}}
_ROPE_COMMON_KEYS = {"rope_type", "type", "rope_theta"}


def _rope(params: dict, where: str, default_theta: float) -> tuple[float, RopeScaling | None]:
    """(θ, scaling) from a Hugging Face RoPE dict; a type or field we do not implement is an error."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_KEYS:
        raise ValueError(f"config.json {where}: rope type {rope_type!r} is not supported "
                         f"(supported: {sorted(_ROPE_KEYS)})")
    unknown = sorted(set(params) - _ROPE_KEYS[rope_type] - _ROPE_COMMON_KEYS)
    if unknown:
        raise ValueError(f"config.json {where}: fields {unknown} of rope type {rope_type!r} are not "
                         "implemented")
    theta = float(params.get("rope_theta", default_theta))
    if rope_type == "default":
        return theta, None
    missing = sorted(_ROPE_KEYS[rope_type] - set(params))
    if missing:
        raise ValueError(f"config.json {where}: rope type {rope_type!r} needs {missing}")
    return theta, RopeScaling(rope_type, **{k: params[k] for k in _ROPE_KEYS[rope_type]})


def _require(hf: dict, field: str, allowed, why: str):
    if hf.get(field) not in allowed:
        raise ValueError(f"config.json {field}={hf.get(field)!r} is not supported ({why})")


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig from a parsed config.json; unsupported architecture features are errors that
    name the field (never a silent fallback to something else)."""
    if hf.get("model_type") == "gemma3":   # the multimodal checkpoint: its language model
        hf = dict(hf.get("text_config") or {}, model_type="gemma3_text")
        if "num_hidden_layers" not in hf:
            raise ValueError("config.json model_type 'gemma3' has no text_config with the language "
                             "model's shape")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type {model_type!r} is not supported; "
                         f"supported: {SUPPORTED_MODEL_TYPES}")
    gemma = model_type == "gemma3_text"
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    expected = "gelu_pytorch_tanh" if gemma else "silu"
    if activation != expected:
        raise ValueError(f"config.json hidden activation {activation!r} is not supported for "
                         f"{model_type} (only {expected})")
    _require(hf, "mlp_bias", (None, False), "no MLP biases")
    if model_type != "qwen2":  # Qwen2's q/k/v bias is implied; the others' attention_bias adds o_proj's
        _require(hf, "attention_bias", (None, False), "it also biases o_proj")
    _require(hf, "use_sliding_window", (None, False), "sliding windows only for Gemma 3's layer_types")
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        _require(hf, field, (None,), "no logit soft-capping in this decoder")
    _require(hf, "use_bidirectional_attention", (None, False), "causal attention only")
    # transformers ≥ 5 writes rope_parameters (per layer type for Gemma 3); older files have
    # rope_theta + rope_scaling (+ rope_local_base_freq for Gemma 3).
    rope = hf.get("rope_parameters") or {}
    legacy = dict(hf.get("rope_scaling") or {}, **({"rope_theta": hf["rope_theta"]} if "rope_theta" in hf else {}))
    values = {}
    if gemma:
        full = rope.get("full_attention") if "full_attention" in rope else (rope or legacy)
        theta, scaling = _rope(full, "rope (full attention layers)", 1e6)
        local_params = rope.get("sliding_attention") or {
            "rope_theta": hf.get("rope_local_base_freq", 1e4)}
        local_theta, local_scaling = _rope(local_params, "rope (sliding attention layers)", 1e4)
        if local_scaling is not None:
            raise ValueError("config.json rope (sliding attention layers): a rope scaling on the "
                             "sliding layers is not implemented")
        layer_types = hf.get("layer_types")
        if layer_types is None:
            pattern = hf.get("sliding_window_pattern", 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(hf["num_hidden_layers"])]
        names = {"sliding_attention": "sliding", "full_attention": "full"}
        unknown = sorted(set(layer_types) - set(names))
        if unknown:
            raise ValueError(f"config.json layer_types {unknown} are not supported ({sorted(names)})")
        values.update(qk_norm=True, mlp_activation="gelu_tanh", norm_unit_offset=True,
                      sandwich_norms=True, embed_scale=True,
                      query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                      layer_types=tuple(names[t] for t in layer_types),
                      sliding_window=hf.get("sliding_window"), rope_local_theta=local_theta)
    else:
        layer_types = set(hf.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError(f"config.json layer_types {sorted(layer_types)} are not supported for "
                             f"{model_type} (only full_attention)")
        theta, scaling = _rope(rope or legacy, "rope", 10000.0)
    num_heads = hf["num_attention_heads"]
    values.update(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        intermediate_size=hf["intermediate_size"], rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=(model_type == "qwen2"),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        # Llama, Qwen2 and Qwen3 configs default to untied embeddings, Gemma 3 to tied.
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048))
    values.update(overrides)
    return ModelConfig(**values)


def layer_tensors(c: ModelConfig) -> dict[str, tuple[str, bool]]:
    """{HF per-layer tensor name: (our stacked path, transposed?)} for this config's features."""
    return dict(_LAYER_TENSORS, **(_BIAS_TENSORS if c.qkv_bias else {}),
                **(_QK_NORM_TENSORS if c.qk_norm else {}),
                **(_SANDWICH_TENSORS if c.sandwich_norms else {}))


def read_hf_folder(folder: str | pathlib.Path, **overrides) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """(config, {our param path: array}, tokenizer) from a local HF folder.

    ``overrides`` replace ModelConfig fields (dtype, param_dtype, remat). Missing or mis-shaped
    tensors raise ValueError naming the HF tensor.
    """
    folder = pathlib.Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    hf = json.loads(config_file.read_text())
    config = config_from_hf(hf, **overrides)
    tensors: dict[str, np.ndarray] = {}
    for file in _safetensors_files(folder):
        tensors.update(read_safetensors(file))
    prefix, head = _LANGUAGE_MODEL_PREFIXES[0]
    if hf.get("model_type") == "gemma3":   # only the language model is read; the vision tower is not
        tensors = {k: v for k, v in tensors.items() if not _VISION.fullmatch(k)}
        prefix, head = next(((p, h) for p, h in _LANGUAGE_MODEL_PREFIXES
                             if f"{p}embed_tokens.weight" in tensors), _LANGUAGE_MODEL_PREFIXES[0])

    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{folder}: tensor {name!r} is missing from the safetensors files")
        array = tensors[name]
        if tuple(array.shape) != shape:
            raise ValueError(f"{folder}: tensor {name!r} has shape {tuple(array.shape)}, expected {shape}")
        used.add(name)
        return array

    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    hf_shapes = {  # HF (out, in) shapes of one layer
        "input_layernorm.weight": (c.hidden_size,), "post_attention_layernorm.weight": (c.hidden_size,),
        "self_attn.q_proj.weight": (q_dim, c.hidden_size), "self_attn.k_proj.weight": (kv_dim, c.hidden_size),
        "self_attn.v_proj.weight": (kv_dim, c.hidden_size), "self_attn.o_proj.weight": (c.hidden_size, q_dim),
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        "self_attn.q_proj.bias": (q_dim,), "self_attn.k_proj.bias": (kv_dim,),
        "self_attn.v_proj.bias": (kv_dim,),
        "self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,),
        "pre_feedforward_layernorm.weight": (c.hidden_size,),
        "post_feedforward_layernorm.weight": (c.hidden_size,),
    }
    per_layer = layer_tensors(c)
    weights: dict[str, np.ndarray] = {
        "embed_tokens/embedding": take(f"{prefix}embed_tokens.weight", (c.vocab_size, c.hidden_size)),
        "norm/scale": take(f"{prefix}norm.weight", (c.hidden_size,)),
    }
    for hf_name, (path, transpose) in per_layer.items():
        layers = [take(f"{prefix}layers.{i}.{hf_name}", hf_shapes[hf_name]) for i in range(c.num_layers)]
        weights[path] = np.stack([a.T if transpose else a for a in layers])
    if not c.tie_embeddings:
        weights["lm_head/kernel"] = take(head, (c.vocab_size, c.hidden_size)).T
    elif head in tensors:
        used.add(head)  # some tied checkpoints still store the (identical) head
    unused = sorted(n for n in tensors if n not in used and not _IGNORED.fullmatch(n))
    if unused:
        raise ValueError(f"{folder}: tensors not used by a {c.num_layers}-layer model: {unused[:8]}"
                         f"{' ...' if len(unused) > 8 else ''}")

    tokenizer = Tokenizer.from_hf_dir(folder)
    if tokenizer.vocab_size > c.vocab_size:
        raise ValueError(f"{folder}: tokenizer has {tokenizer.vocab_size} tokens but the model's "
                         f"vocab_size is {c.vocab_size}")
    return config, weights, tokenizer
