"""Command-line entry points (``python -m launch.<name>``)."""

import os
import statistics


def _no_local_tpu() -> bool:
    """True where libtpu is installed (the tpu or test extra: it compiles for TPU targets) but this
    machine has no TPU chip. JAX would then try to start a TPU backend first, print a page of
    libtpu warnings, fail, and hold libtpu's lock file for the whole run (another process's TPU
    compile then fails on it)."""
    import glob
    import importlib.util
    if importlib.util.find_spec("libtpu") is None:
        return False
    return not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def simulate_host_devices(count: int) -> None:
    """Make a CPU run see ``count`` devices, so the sharded code path is the one a GPU node runs.

    Must run before jax is imported. ``LOGRA_HOST_DEVICES`` overrides ``count``, and an
    ``XLA_FLAGS`` that already sets a device count wins over both. Accelerators ignore the flag.
    Where libtpu is installed without a TPU chip, JAX is told not to look for one (GPUs, where
    present, are still found: ``JAX_PLATFORMS`` is set only when none is).
    """
    if "JAX_PLATFORMS" not in os.environ and _no_local_tpu():
        import glob
        if not glob.glob("/dev/nvidia[0-9]*"):
            os.environ["JAX_PLATFORMS"] = "cpu"
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


def paired_ratio(times: dict, run: str, baseline: str) -> tuple[float, float, float]:
    """(median, min, max) over rounds i of ``times[run][i] / times[baseline][i]``.

    Benchmarks here alternate the runs they compare, round by round, so the two timings of a round
    ran back to back, and a slow spell of a shared machine scales both. The ratio of two medians
    taken over all rounds mixes spells (AdamW's median on the 2-core VM of 2026-12-02 moved 12.5–16.6
    s between hours); the median of per-round ratios is the paired estimate.
    """
    ratios = [a / b for a, b in zip(times[run], times[baseline], strict=True)]
    if not ratios:
        return (float("nan"),) * 3
    return statistics.median(ratios), min(ratios), max(ratios)
