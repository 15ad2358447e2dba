"""Command-line entry points (``python -m launch.<name>``)."""

import os
import re
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
        match = re.search(r"xla_force_host_platform_device_count=(\d+)", flags)
        size_cpu_thread_pool(int(match.group(1)) if match else 1)
        return
    count = int(os.environ.get("LOGRA_HOST_DEVICES", count))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    size_cpu_thread_pool(count)


# Threads per simulated CPU device in XLA:CPU's pool: how many collectives one device may be
# waiting in at once (see size_cpu_thread_pool).
_CPU_THREADS_PER_DEVICE = 2


def size_cpu_thread_pool(devices: int) -> None:
    """Give XLA:CPU's thread pool two threads per simulated device, so that its collectives cannot
    starve each other of threads. Must run before jax starts its CPU backend.

    XLA:CPU runs every device's program on one shared pool of max(cores, devices) threads (its
    ``NPROC`` variable stands in for the core count), and a collective holds its thread until every
    device of its group has arrived. Its thunk executor runs what is ready concurrently, and one
    device can wait in two collectives at once; with one thread per device, the last device to
    arrive then finds no thread left. Measured (jax 0.10.2, 2 cores, 8 devices, so a pool of 8):
    ``python -m launch.train --config configs/tiny.py --workdir W
    --config.optimizer.logra.variant=kl --config.rl.algorithm=reinforce
    --config.optimizer.logra.others=frozen`` aborted at its first step after 40 s. Its log showed
    device 0 waiting in an all-gather over devices {0, 4} and, on a second thread, in one over all
    8, where devices 0–6 held the other seven threads and device 7 never arrived (rendezvous.cc:
    "Expected 8 threads to join the rendezvous, but only 7 of them arrived"). With a pool of 16
    it trains. On a machine with ``2 × devices`` cores or more, or with ``NPROC`` already set,
    nothing changes. GPUs and TPUs do not run collectives on a shared host pool.
    """
    if "NPROC" in os.environ:
        return
    threads = _CPU_THREADS_PER_DEVICE * devices
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (cores or 1) < threads:
        os.environ["NPROC"] = str(threads)


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
