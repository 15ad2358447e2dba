"""Command-line entry points (``python -m launch.<name>``)."""

import os
import statistics


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
