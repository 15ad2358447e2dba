"""A training run's policy as a Hugging Face folder: the workdir's config and checkpoint → files.

The run's own config.json (written by the trainer) says which model it trained; that model is
built (its weights are the template), the checkpoint's params are restored into it and written
by `models.hf_export.write_hf_folder` (a LoRA run's adapters merged into the base first, by
`restore_policy`, which launch.evaluate uses too). Any source the loaders read exports: a
Llama/Qwen/Gemma folder as its own architecture, the SmolLM2 GGUF and ``model.source="tiny"`` as
a Llama folder.
"""

from __future__ import annotations

import json
import pathlib

import jax
import ml_collections
import numpy as np

from logra_jax import checkpoint as checkpoint_lib
from logra_jax.models.hf_export import write_hf_folder
from logra_jax.optim.lora import LORA_KEY, merge_adapters
from logra_jax.rl import build, optimizers
from logra_jax.rl.policy import Policy
from logra_jax.tree_paths import leaves_with_paths


def read_run_config(workdir: str | pathlib.Path) -> ml_collections.ConfigDict:
    """The config a training run wrote into its workdir (config.json)."""
    config_file = pathlib.Path(workdir) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{workdir} holds no config.json: not a training run's workdir")
    try:
        return ml_collections.ConfigDict(json.loads(config_file.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from e


def restore_policy(workdir: str | pathlib.Path, params, *, step: int | None = None):
    """(step, weights): the policy of ``workdir``'s checkpoint ``step`` (default: the latest) as
    one set of model weights laid out like ``params`` (the model's own, e.g. its initial weights;
    adapters in it are ignored).

    The run's config.json says which optimizer saved it: a LoRA run's checkpoint holds the frozen
    base plus ``params["lora"]``, restored with that layout and folded into the base
    (W + s·Aᵀ·Bᵀ, `merge_adapters`), so every run reads back as the same model."""
    workdir = pathlib.Path(workdir)
    adapters = optimizers.adapters_of(read_run_config(workdir).optimizer)
    if not (workdir / "checkpoints").is_dir():
        raise FileNotFoundError(f"{workdir} has no checkpoints folder")
    ckpt = checkpoint_lib.Checkpointer(workdir / "checkpoints")
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise FileNotFoundError(f"{workdir} holds no complete checkpoint")
        step = max(steps) if step is None else step
        if step not in steps:
            raise ValueError(f"{workdir} has no checkpoint of step {step}; it has {sorted(steps)}")
        base = {k: v for k, v in params.items() if k != LORA_KEY}
        restored = ckpt.restore_params(step, base if adapters is None else adapters.added_to(base))
    finally:
        ckpt.close()
    if LORA_KEY in restored:
        restored = merge_adapters(restored, adapters.scale)
    return step, restored


def export_run(workdir: str | pathlib.Path, out: str | pathlib.Path, *, step: int | None = None,
               dtype: str | None = None) -> tuple[pathlib.Path, int]:
    """(folder, step): the policy of ``workdir``'s checkpoint ``step`` (default: the latest)."""
    config = read_run_config(workdir)
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"export folder {out} exists and is not empty; choose a new one")
    model, tokenizer = build.build_model(config.model, mesh=None)
    step, params = restore_policy(workdir, Policy.params_of(model), step=step)
    weights = {path: np.asarray(jax.device_get(value)) for path, value in leaves_with_paths(params)}
    return write_hf_folder(model.config, weights, tokenizer, out, dtype=dtype), step
