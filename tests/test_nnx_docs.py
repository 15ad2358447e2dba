"""docs/optax_api.md's "LoGRA on your own NNX model" example runs as written and lowers the loss:
a few LoGRA steps (sketches from the backward pass, nnx.Optimizer, nnx.jit) on a transformer of
flax's own layers with a scanned layer stack."""

import pathlib
import re

import jax
import numpy as np
from flax import nnx

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "optax_api.md"


def _example() -> str:
    """The first python block of the page's section 3."""
    text = DOC.read_text()
    section = text[text.index("## 3. LoGRA on your own NNX model"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_pages_nnx_example_runs_as_written_and_learns(capsys):
    namespace = {"__name__": "optax_api_example"}
    exec(compile(_example(), str(DOC), "exec"), namespace)
    losses = namespace["losses"]
    printed = capsys.readouterr().out
    assert f"loss {losses[0]:.3f} → {losses[-1]:.3f}" in printed
    assert losses[-1] < 0.6 * losses[0]
    # the page quotes what it prints (to within a backend's rounding)
    quoted = re.search(r"it prints `loss ([0-9.]+) → ([0-9.]+)`", DOC.read_text())
    np.testing.assert_allclose([float(quoted[1]), float(quoted[2])], [losses[0], losses[-1]],
                               atol=0.02)
    # the model is as it was: flax's classes, no probe attributes, the targets still kernels
    model, sketch = namespace["model"], namespace["sketch"]
    assert type(model.layers.attn.query) is nnx.LinearGeneral
    assert type(model.layers.up) is nnx.Linear
    paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model))]
    assert not any("logra" in p for p in paths)
    params = {"/".join(map(str, p)): v[...]
              for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for path, target in sketch.targets.items():
        assert params[path].shape == target.info.kernel_shape
        assert np.all(np.isfinite(jax.device_get(params[path])))
