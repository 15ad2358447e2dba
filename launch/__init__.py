"""Command-line entry points (``python -m launch.<name>``)."""

import os


def simulate_host_devices(count: int) -> None:
    """Make a CPU run see ``count`` devices, so the sharded code path is the one a GPU node runs.

    Must run before jax is imported. ``LOGRA_HOST_DEVICES`` overrides ``count``, and an
    ``XLA_FLAGS`` that already sets a device count wins over both. Accelerators ignore the flag.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    count = int(os.environ.get("LOGRA_HOST_DEVICES", count))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def cpu_model() -> str:
    """The host CPU's model name (what ``lscpu | grep "Model name"`` prints): benchmark tables say
    which CPU kind their numbers come from, since XLA picks other kernels on AVX2 and AVX-512."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown CPU"
