"""Command-line entry points (``python -m launch.<name>``)."""

import os
import statistics
import sys


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


# What the CUDA plugin's libraries log when they load on a machine without a GPU driver (absl's
# preamble, then cudart's "Could not find cuda drivers on your machine, GPU will not be used."),
# once per library: four lines on every `import jax` and backend start.
_CUDA_STUB_NOISE = ("before absl::InitializeLog() is called", "cudart_stub.cc")


def load_cuda_plugin_quietly() -> None:
    """Load the CUDA plugin's libraries (the gpu-plan extra: XLA:GPU plans GPU nodes on any
    machine) with their driver-less log lines held back, so no command prints them on a CPU-only
    machine: a one-line ``error:`` stays one line. Anything else they print is passed on.

    jax imports the plugin itself (at ``import jax`` and when its backends start), whichever code
    path runs; loading the same libraries first makes jax's loads find them loaded, and a library
    logs only on its first load. The libraries are not jax: importing them leaves JAX_PLATFORMS
    and XLA_FLAGS free to be set after this. Where a GPU driver is present nothing is logged, and
    nothing is loaded here.
    """
    import glob
    import importlib
    import importlib.util
    import tempfile
    if glob.glob("/dev/nvidiactl") or "jax" in sys.modules:
        return
    plugin = importlib.util.find_spec("jax_cuda12_plugin")
    if plugin is None or not plugin.submodule_search_locations:
        return
    modules = sorted({os.path.basename(path).split(".")[0] for folder in plugin.submodule_search_locations
                      for path in glob.glob(os.path.join(folder, "*.so"))
                      if not os.path.basename(path).startswith("lib")})
    pjrt = importlib.util.find_spec("jax_plugins")
    libraries = [path for folder in (pjrt.submodule_search_locations if pjrt else [])
                 for path in glob.glob(os.path.join(folder, "xla_cuda12", "*.so"))]
    sys.stderr.flush()
    saved = os.dup(2)
    # The plugin's XLA:GPU reads its log level once, as it loads: INFO lines off (each GPU compile
    # logs its scheduler's budget and "Performing a deviceless compilation"), its warnings kept,
    # e.g. "Can't reduce memory use below ...". jaxlib's own libraries, loaded later, keep theirs.
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            for module in modules:
                try:
                    importlib.import_module(f"jax_cuda12_plugin.{module}")
                except ImportError:
                    pass   # jax reports a broken plugin itself when it imports it
            import ctypes
            for library in libraries:   # the PJRT plugin jax dlopens when its backends start
                try:
                    ctypes.CDLL(library)
                except OSError:
                    pass
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if level is None:
                del os.environ["TF_CPP_MIN_LOG_LEVEL"]
        held.seek(0)
        kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                if not any(noise in line for noise in _CUDA_STUB_NOISE)]
    sys.stderr.write("".join(kept))


load_cuda_plugin_quietly()


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
