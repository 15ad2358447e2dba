"""The first part of `make gpu-check` (launch/gpu_check.py): what this machine runs, as one JSON line.

    python -m launch.gpu_check_versions

Python, jax, jaxlib, flax, optax, orbax-checkpoint and the CUDA plugins' versions, JAX's backend,
its first device's kind, the device count, the allocator's limit and XLA_PYTHON_CLIENT_MEM_FRACTION.
The check runs it first and alone: it also says which backend the other parts will meet.
"""

import importlib.metadata
import json
import os
import platform

from launch import cli


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cuda_plugins() -> dict[str, str]:
    """{distribution: version} of the installed JAX CUDA plugins."""
    return {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()
            if d.metadata["Name"] and d.metadata["Name"].lower().startswith(("jax-cuda", "jax_cuda"))}


def versions() -> dict:
    import jax
    devices = jax.devices()
    stats = devices[0].memory_stats() or {}
    return dict(
        python=platform.python_version(), jax=jax.__version__, jaxlib=version("jaxlib"),
        flax=version("flax"), optax=version("optax"), orbax_checkpoint=version("orbax-checkpoint"),
        cuda_plugins=cuda_plugins(), backend=jax.default_backend(),
        device_kind=devices[0].device_kind, device_count=len(devices),
        bytes_limit=stats.get("bytes_limit"),
        mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))


def main(argv) -> None:
    del argv
    from launch import process
    process.setup(1)   # on CPU: one device, as the one-device parts see it
    print(json.dumps(versions()))


if __name__ == "__main__":
    cli.run(main)
