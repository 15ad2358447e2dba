"""Whether a GPU's decode kernels compute what the layers do, on the device itself: the `kernels`
part of `make gpu-check` (launch/gpu_check.py).

    python -m launch.kernel_check [--shape smollm2_135m] [--layers 4] [--rows 1,16] [--steps 8] \
        [--dtypes float32,bfloat16]

The sampler decodes on one GPU with each RMSNorm and the attention as kernels of the project's own
(logra_jax/models/decode_kernels.py). Their arithmetic is checked on a CPU through Pallas'
interpreter (tests/test_decode_kernels.py) and XLA:GPU compiles them without a GPU, but only a
GPU runs the Triton kernels themselves. This runs a model of a published shape (random weights;
``--layers`` of them: every layer runs the same kernels, and fewer compile sooner) on the first
device: a left-padded prompt prefilled into the KV cache, then ``--steps`` decode
steps with per-layer weights (q, k and v held as one, as the sampler decodes on one GPU) with the
kernels and without them (XLA's own ops), and prints one JSON line per batch and dtype: the
largest difference of the logits over all steps, and of the caches after them, each relative to
the largest magnitude of its reference, beside a tolerance. fp32 with fp32 products (no TF32):
the two differ by the order of sums; bf16 also by the softmax weights, which the layers round to
bf16 before they multiply V and the kernel does not. A wrong slot, rotation, mask or bias is off
by the values' own size. Exits 1 with an ``error:`` line when a figure is beyond its tolerance.
"""

from __future__ import annotations

import dataclasses
import json

from absl import flags

from launch import cli

_SHAPE = flags.DEFINE_string("shape", "smollm2_135m", "A published model shape "
                             "(logra_jax/model_shapes.py), or 'tiny' (configs' tiny decoder).")
_LAYERS = flags.DEFINE_integer("layers", 4, "Layers of the model (0: the shape's own).")
_ROWS = flags.DEFINE_list("rows", ["1", "16"], "Batch sizes to decode.")
_STEPS = flags.DEFINE_integer("steps", 8, "Decode steps after the prompt.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Compute dtypes to check.")
_PROMPT = flags.DEFINE_integer("prompt_length", 16, "Prompt tokens (the first row left-padded by 3).")

# Largest difference relative to the reference's largest magnitude, per dtype.
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}


def model_config(shape: str, dtype: str, layers: int = 0):
    from logra_jax import model_shapes
    from logra_jax.models.config import ModelConfig, tiny
    if shape == "tiny":
        config = tiny(dtype=dtype, param_dtype=dtype)
    elif shape in model_shapes.MODEL_SHAPES:
        config = ModelConfig(**model_shapes.MODEL_SHAPES[shape], dtype=dtype, param_dtype=dtype)
    else:
        raise ValueError(f"--shape {shape!r}: expected 'tiny' or one of "
                         f"{sorted(model_shapes.MODEL_SHAPES)}")
    return dataclasses.replace(config, num_layers=layers) if layers else config


def compare(config, rows: int, steps: int, prompt_length: int) -> dict:
    """Logits and caches of ``steps`` decode steps with the kernels and without, on the default
    device: their largest differences relative to the references' largest magnitudes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from logra_jax.models import Decoder, decode_kernels
    if not decode_kernels.fits(config):
        raise ValueError(f"the decode kernels do not fit this model ({config})")
    model = Decoder(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (rows, prompt_length + steps), 0,
                                config.vocab_size)
    padding = jnp.zeros((rows, 1), jnp.int32).at[0].set(min(3, prompt_length - 1))
    prompt_mask = jnp.arange(prompt_length)[None] >= padding
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0).astype(jnp.int32)

    def run(kernels: bool):
        @jax.jit
        def program(state):
            m = nnx.merge(graphdef, state)
            _, cache = m(tokens[:, :prompt_length], positions=positions, segment_mask=prompt_mask,
                         cache=m.init_cache(rows, prompt_length + steps), prefill=True)
            cache, layers = cache.unstacked(), m.unstacked_layers(fuse_qkv=True)
            logits = []
            for i in range(steps):
                step_logits, cache = m(tokens[:, prompt_length + i:prompt_length + i + 1],
                                       positions=positions[:, -1:] + 1 + i, cache=cache,
                                       layers=layers, kernels=kernels)
                logits.append(step_logits)
            return jnp.concatenate(logits, axis=1), (cache.k, cache.v)

        with jax.default_matmul_precision("highest"):
            return jax.tree.map(lambda a: np.asarray(a, np.float32), program(state))

    got, want = run(True), run(False)

    def relative(a, b):
        return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))

    caches = [relative(a, b) for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]))]
    return dict(logits_rel_diff=relative(got[0], want[0]), cache_rel_diff=max(caches))


def main(argv):
    del argv
    from launch import process
    process.setup(1)   # on CPU: one device, as the sampler on one GPU
    import jax
    try:
        rows = [int(r) for r in _ROWS.value]
    except ValueError:
        raise SystemExit(f"error: --rows {','.join(_ROWS.value)}: expected batch sizes, e.g. 1,16")
    if any(r < 1 for r in rows) or _STEPS.value < 1 or _PROMPT.value < 2 or _LAYERS.value < 0:
        raise SystemExit("error: --rows and --steps must be ≥ 1, --prompt_length ≥ 2 and --layers ≥ 0")
    unknown = sorted(set(_DTYPES.value) - set(TOLERANCE))
    if unknown or not _DTYPES.value:
        raise SystemExit(f"error: --dtypes {','.join(_DTYPES.value)}: expected some of "
                         f"{', '.join(TOLERANCE)}")
    try:
        model_config(_SHAPE.value, "float32")
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    backend = jax.default_backend()
    kernels = "Triton" if backend == "gpu" else "Pallas' interpreter"
    failed = []
    for dtype in _DTYPES.value:
        tolerance = TOLERANCE[dtype]
        config = model_config(_SHAPE.value, dtype, _LAYERS.value)
        for batch in rows:
            found = compare(config, batch, _STEPS.value, _PROMPT.value)
            ok = max(found.values()) <= tolerance
            record = dict(shape=_SHAPE.value, layers=config.num_layers, dtype=dtype, rows=batch,
                          steps=_STEPS.value,
                          backend=backend, device_kind=jax.devices()[0].device_kind,
                          kernels=kernels, tolerance=tolerance, ok=ok, **found)
            print(json.dumps(record), flush=True)
            if not ok:
                failed.append(f"{dtype} at {batch} rows: logits {found['logits_rel_diff']:.3g}, "
                              f"cache {found['cache_rel_diff']:.3g} of their size")
    if failed:
        raise SystemExit(f"error: the decode kernels ({kernels}) differ from the layers beyond "
                         f"the tolerance: {'; '.join(failed)}; a run decodes without them with "
                         f"--config.rl.decode_weights=stacked")


if __name__ == "__main__":
    cli.run(main)
