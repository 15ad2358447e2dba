"""The compile targets by name: GPU nodes (perf/gpu.py) and TPU slices (perf/tpu.py), one kind of
object (perf/target.py), for `launch.memory`, `launch.memory_table` and the tests."""

from __future__ import annotations

from logra_jax.perf import gpu, tpu
# The compile step and the TPU compiler's refusal, where the planner looks for them.
from logra_jax.perf.target import DoesNotFit, Target, compile_or_refuse, gib_text  # noqa: F401


def target(name: str) -> Target:
    """The target called ``name``: a Cloud TPU slice (v5p-16) or a GPU node (h100-8)."""
    if name in tpu.TARGETS:
        return tpu.TARGETS[name]
    if name in gpu.TARGETS:
        return gpu.TARGETS[name]
    raise ValueError(f"unknown target {name!r}; known: cpu, {', '.join(names())}")


def names() -> list[str]:
    return [*gpu.TARGETS, *tpu.TARGETS]


def platform_of(devices) -> str:
    """The platform ("cpu", "gpu", "tpu") of a mesh's or a device list's first device."""
    first = devices.devices.flat[0] if hasattr(devices, "devices") else list(devices)[0]
    return first.platform


def compiler_options_for(mesh) -> dict:
    """Options every program compiled for ``mesh``'s devices needs, by their platform."""
    if platform_of(mesh) == "gpu":
        return gpu.COMPILER_OPTIONS
    return {}
