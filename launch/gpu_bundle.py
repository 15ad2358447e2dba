"""The air-gapped GPU check's bundle: one .tar.gz of at most 64 MiB.

    python -m launch.gpu_bundle [--out runs/gpu_bundle.tar.gz] [--wheels runs/gpu_wheels]

It holds, under ``logra_jax/``: the source tree (git's tracked and unignored files, as they are in
the working tree: no .venv, no runs), ``bundle/smollm2_header.gguf`` — the first 1.8 MB of the
SmolLM2 GGUF, its metadata without the weights, all the tokenizer needs (the whole 98 MB file would
not fit) — the wheels of ``--wheels`` in ``bundle/wheels/`` (what a CUDA machine with its own jax
and flax lacks; `make gpu-bundle` downloads them first, docs/gpu.md lists them; ``--wheels ""``
leaves them out), and ``bundle/README.md`` with the commands to run there. `make gpu-check` picks
up ``bundle/site`` and the header by itself.
"""

import pathlib
import subprocess
import sys
import tarfile

from absl import flags

from launch import cli

_OUT = flags.DEFINE_string("out", "runs/gpu_bundle.tar.gz", "The bundle to write.")
_WHEELS = flags.DEFINE_string("wheels", "runs/gpu_wheels", "Folder of wheels to ship (\"\": none).")

LIMIT = 64 * 2**20
ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP = "logra_jax"
HEADER = "bundle/smollm2_header.gguf"

README = """# logra_jax GPU check bundle

On the GPU machine (its own CUDA jax and flax; no registry needed), from this folder:

    python3 -m pip install --no-index --no-deps --target bundle/site bundle/wheels/*.whl
    make gpu-check PYTHON=python3          # or: GPU_CHECK_OUT=/some/dir make gpu-check ...
    # without make, the same:
    LOGRA_TOKENIZER_GGUF=$PWD/{header} PYTHONPATH=$PWD/bundle/site python3 -m launch.gpu_check

`make gpu-check` adds bundle/site to PYTHONPATH and reads the tokenizer from {header}
(LOGRA_TOKENIZER_GGUF). It writes runs/gpu_check/gpu_check.md and gpu_check.json. docs/gpu.md
says what each part measures.

Wheels: {wheels}
"""


def source_files() -> list[str]:
    """The repository's files git tracks or would track (not ignored), that exist."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    return sorted(f for f in listed if f and (ROOT / f).is_file())


def main(argv):
    del argv
    from launch import process
    process.setup(None)   # quiet: reading the GGUF imports jax, which starts no backend here
    from logra_jax.models import gguf_loader
    wheels = sorted(pathlib.Path(_WHEELS.value).glob("*.whl")) if _WHEELS.value else []
    if _WHEELS.value and not wheels:
        sys.exit(f"error: no wheels in {_WHEELS.value!r}: `make gpu-bundle` downloads them there "
                 f"first (docs/gpu.md lists them), or pass --wheels '' for a bundle without")
    out = pathlib.Path(_OUT.value)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = out.with_name(out.name + ".header.gguf")
    try:
        gguf_loader.write_gguf_header(gguf_loader.smollm2_gguf_path(), header)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    readme = out.with_name(out.name + ".README.md")
    readme.write_text(README.format(header=HEADER, wheels=", ".join(w.name for w in wheels) or
                                    "none (built with --wheels '')"))
    with tarfile.open(out, "w:gz") as tar:
        for name in source_files():
            tar.add(ROOT / name, f"{TOP}/{name}")
        tar.add(header, f"{TOP}/{HEADER}")
        tar.add(readme, f"{TOP}/bundle/README.md")
        for wheel in wheels:
            tar.add(wheel, f"{TOP}/bundle/wheels/{wheel.name}")
    header.unlink()
    readme.unlink()
    size = out.stat().st_size
    if size > LIMIT:
        sys.exit(f"error: {out} is {size / 2**20:.1f} MiB, over the {LIMIT / 2**20:.0f} MiB a GPU "
                 f"check may carry; ship fewer wheels")
    print(f"{out}: {size / 2**20:.1f} MiB ({len(source_files())} source files, the tokenizer header, "
          f"{len(wheels)} wheels)")


if __name__ == "__main__":
    cli.run(main)
