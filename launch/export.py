"""Export a trained policy as a Hugging Face folder (config.json, safetensors, tokenizer files).

    python -m launch.export --workdir runs/default [--step N] --out runs/default/hf \
        [--dtype bfloat16]

Reads the run's config.json and checkpoint ``--step`` (default: the latest) and writes a folder
that ``transformers.AutoModelForCausalLM.from_pretrained`` (and vLLM / SGLang) load, and that
``--config.model.source`` reads back. The SmolLM2 GGUF source exports as a Llama folder.
"""

import sys

from absl import flags

from launch import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's workdir.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_OUT = flags.DEFINE_string("out", None, "The new folder (must not exist or be empty).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "Convert every tensor (default: as trained).")


def main(argv):
    del argv
    from launch import process
    process.setup(1)
    process.start_backend()
    from logra_jax.export import export_run  # imports jax: after the setup
    try:
        out, step = export_run(_WORKDIR.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    print(f"exported step {step} of {_WORKDIR.value} to {out}")


if __name__ == "__main__":
    cli.run(main, required=("workdir", "out"))
