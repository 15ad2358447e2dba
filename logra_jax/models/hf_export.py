"""Write our decoder's weights as a Hugging Face folder that transformers (and vLLM, SGLang) load.

The inverse of hf_loader: our stacked kernels (L, in, out) become per-layer ``weight`` (out, in),
``scale`` → ``weight``, ``embedding`` → ``weight``; config.json names the Hugging Face architecture
that has exactly this config's features (`hf_model_type`), in transformers ≥ 5's format
(``rope_parameters``) with the older ``rope_theta``/``rope_scaling`` fields beside it for readers
that predate it. Tokenizer files and generation_config.json come from our Tokenizer.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from logra_jax.models import hf_loader
from logra_jax.models.config import ModelConfig
from logra_jax.models.tokenizer import Tokenizer

_DTYPE_NAMES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
                np.dtype(np.float16): "F16"}
_TORCH_DTYPE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def hf_model_type(c: ModelConfig) -> str:
    """The Hugging Face model_type whose architecture is exactly ``c``'s (ValueError if none is)."""
    gemma = dict(qk_norm=c.qk_norm, mlp_activation=c.mlp_activation == "gelu_tanh",
                 norm_unit_offset=c.norm_unit_offset, sandwich_norms=c.sandwich_norms,
                 embed_scale=c.embed_scale)
    if all(gemma.values()) and not c.qkv_bias:
        return "gemma3_text"
    gemma_only = [k for k, v in gemma.items() if v and k != "qk_norm"]
    gemma_only += ["layer_types with sliding layers"] if any(c.sliding_layers) else []
    gemma_only += (["query_pre_attn_scalar ≠ head_dim"]
                   if c.query_pre_attn_scalar not in (None, c.head_dim) else [])
    if gemma_only:
        raise ValueError(f"no Hugging Face architecture has {gemma_only} without all of Gemma 3's "
                         f"features {sorted(gemma)}")
    if c.qk_norm and c.qkv_bias:
        raise ValueError("no Hugging Face architecture has both q/k/v biases and q/k norms")
    return "qwen3" if c.qk_norm else "qwen2" if c.qkv_bias else "llama"


def _rope_dict(theta: float, scaling) -> dict:
    out = {"rope_type": "default" if scaling is None else scaling.rope_type, "rope_theta": theta}
    if scaling is not None:
        out["factor"] = scaling.factor
        if scaling.rope_type == "llama3":
            out.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                       original_max_position_embeddings=scaling.original_max_position_embeddings)
    return out


def hf_config(c: ModelConfig, tokenizer: Tokenizer, dtype_name: str) -> dict:
    """config.json for ``c``."""
    model_type = hf_model_type(c)
    out = dict(
        architectures=[ARCHITECTURES[model_type]], model_type=model_type,
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_embeddings,
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
        dtype=_TORCH_DTYPE[dtype_name], torch_dtype=_TORCH_DTYPE[dtype_name],
        rope_theta=c.rope_theta)
    full_rope = _rope_dict(c.rope_theta, c.rope_scaling)
    if c.rope_scaling is not None:
        out["rope_scaling"] = full_rope
    if model_type == "gemma3_text":
        types = {"full": "full_attention", "sliding": "sliding_attention"}
        local = c.rope_local_theta or c.rope_theta
        scalar = c.query_pre_attn_scalar or c.head_dim
        out.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                   query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                   sliding_window=c.sliding_window or c.max_position_embeddings,
                   layer_types=[types[t] for t in (c.layer_types or ("full",) * c.num_layers)],
                   rope_local_base_freq=local, final_logit_softcapping=None,
                   attn_logit_softcapping=None,
                   rope_parameters={"full_attention": full_rope,
                                    "sliding_attention": _rope_dict(local, None)})
    else:
        out.update(hidden_act="silu", attention_bias=False, mlp_bias=False, rope_parameters=full_rope)
        if model_type != "llama":
            out.update(use_sliding_window=False)
    return out


def hf_tensors(c: ModelConfig, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{HF tensor name: array} from our {param path: array} (a checkpoint's params, flattened)."""
    tensors = {"model.embed_tokens.weight": weights["embed_tokens/embedding"],
               "model.norm.weight": weights["norm/scale"]}
    for hf_name, (path, transpose) in hf_loader.layer_tensors(c).items():
        stacked = np.asarray(weights[path])
        for i in range(c.num_layers):
            tensors[f"model.layers.{i}.{hf_name}"] = stacked[i].T if transpose else stacked[i]
    if not c.tie_embeddings:
        tensors["lm_head.weight"] = np.asarray(weights["lm_head/kernel"]).T
    return tensors


def write_safetensors(path: pathlib.Path, tensors: Mapping[str, np.ndarray]) -> None:
    """The safetensors format hf_loader.read_safetensors reads: an 8-byte little-endian header
    length, the JSON header {name: {dtype, shape, data_offsets}}, then each tensor's C-order bytes.
    Written by hand for bf16 (safetensors' numpy backend has no bfloat16)."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: cannot write dtype {array.dtype} to safetensors")
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _DTYPE_NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)   # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for data in blobs:
            f.write(data)


def write_tokenizer(tokenizer: Tokenizer, folder: pathlib.Path) -> None:
    """tokenizer.json, tokenizer_config.json (special tokens, chat template) and nothing model-specific."""
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
              "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token}
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def write_hf_folder(config: ModelConfig, weights: Mapping[str, np.ndarray], tokenizer: Tokenizer,
                    out: str | pathlib.Path, *, dtype: str | None = None,
                    max_shard_bytes: int = 5 * 2 ** 30) -> pathlib.Path:
    """config.json, model.safetensors (or shards + model.safetensors.index.json above
    ``max_shard_bytes``), tokenizer files and generation_config.json in ``out``.

    ``dtype`` ("float32" | "bfloat16") converts every tensor; default: as the weights are stored.
    ``out`` must not exist or be an empty folder (nothing is overwritten).
    """
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"export folder {out} exists and is not empty; choose a new one")
    tensors = hf_tensors(config, weights)
    if dtype is not None:
        target = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}.get(dtype)
        if target is None:
            raise ValueError(f"export dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        tensors = {k: np.asarray(v).astype(target) for k, v in tensors.items()}
    dtypes = {np.asarray(v).dtype for v in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"weights mix dtypes {sorted(map(str, dtypes))}; pass dtype= to export one")
    dtype_name = _DTYPE_NAMES[dtypes.pop()]
    hf = hf_config(config, tokenizer, dtype_name)   # before writing anything: it may refuse
    out.mkdir(parents=True, exist_ok=True)

    shards, size = [{}], 0
    for name, array in tensors.items():
        if size and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", shards[0])
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(out / file, shard)
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(a.nbytes for a in tensors.values())
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(hf, indent=1) + "\n")
    write_tokenizer(tokenizer, out)
    generation = {"bos_token_id": tokenizer.bos_id, "pad_token_id": tokenizer.pad_id,
                  "eos_token_id": list(tokenizer.stop_ids) if len(tokenizer.stop_ids) > 1
                  else tokenizer.eos_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
    return out
