"""What a command sets up in its own process before jax starts, in one explicit call.

Every entry point's ``main`` calls `setup` once its flags are parsed and before anything imports
jax: importing ``launch`` or one of its commands changes no environment variable and no file
descriptor, so a library user or a test that imports them keeps its own process as it was.
`setup` does, in order:

- the device count: XLA:CPU simulates ``devices`` devices (``LOGRA_HOST_DEVICES`` overrides it, an
  ``XLA_FLAGS`` that already sets a count wins over both), so a CPU run takes the sharded code
  path a GPU node runs; accelerators ignore it;
- the platform: where libtpu or the CUDA plugin is installed (they compile for TPU and GPU
  targets) but the machine has neither a TPU nor a GPU, ``JAX_PLATFORMS=cpu``, so JAX does not
  try those backends first (a page of libtpu warnings and libtpu's lock file held for the whole
  run; the CUDA plugin's "Unable to load CUDA" traceback);
- XLA:CPU's thread pool (`size_cpu_thread_pool`);
- the CUDA plugin's libraries loaded with their driver-less log lines held back (`load_cuda_plugin_quietly`);
- log lines: the project's own as plain lines, other libraries' only from ERROR up
  (`plain_log_lines`); ``verbose`` keeps absl's format and everything at INFO.

`check_backend` then starts JAX's backend and turns a platform that cannot start (``JAX_PLATFORMS=cuda``
on a machine without a GPU) into one line.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import importlib
import importlib.util
import logging as std_logging
import os
import pathlib
import re
import sys
import tempfile
import threading
from typing import Iterator

# Threads per simulated CPU device in XLA:CPU's pool: how many collectives one device may be
# waiting in at once (see size_cpu_thread_pool).
CPU_THREADS_PER_DEVICE = 2
HOST_DEVICES_ENV = "LOGRA_HOST_DEVICES"


class SetupError(RuntimeError):
    """A process whose backend cannot start as asked; the message is the one line to print."""


def setup(devices: int | None, *, verbose: bool = False) -> None:
    """Prepares this process for jax (see the module docstring); must run before jax is imported.

    ``devices``: how many CPU devices to simulate; None leaves the count and XLA:CPU's pool as they
    are (a command that starts no backend of its own, or whose child processes set their own: they
    inherit this environment). ``verbose``: keep JAX's start-up messages and absl's log format."""
    if devices is not None:   # a bad count is the user's: one line, before anything else
        try:
            devices = host_device_count(devices)
        except SetupError as e:
            sys.exit(f"error: {e}")
    if "jax" in sys.modules:
        raise RuntimeError("launch.process.setup must run before jax is imported: the device "
                           "count, the platform and XLA:CPU's pool are read when jax starts")
    if "JAX_PLATFORMS" not in os.environ and _accelerator_plugin_without_its_device():
        os.environ["JAX_PLATFORMS"] = "cpu"
    if devices is not None:
        simulate_host_devices(devices)
    if not verbose:
        load_cuda_plugin_quietly()
    plain_log_lines(verbose)


def host_device_count(default: int) -> int:
    """The CPU devices to simulate: ``LOGRA_HOST_DEVICES`` if set, else ``default``. A value that
    is not a whole number ≥ 1 is a `SetupError` naming it: ``int()``'s traceback otherwise, and
    at 0 JAX fails to start a backend, which reads as a platform problem (JAX_PLATFORMS) that no
    platform setting fixes."""
    given = os.environ.get(HOST_DEVICES_ENV)
    if given is None:
        return default
    try:
        count = int(given.strip())
    except ValueError:
        raise SetupError(f"{HOST_DEVICES_ENV}={given!r} is not a whole number: it is how many CPU "
                         f"devices XLA simulates; set it to 1 or more, or unset it (this "
                         f"command's default: {default})") from None
    if count < 1:
        raise SetupError(f"{HOST_DEVICES_ENV}={given}: XLA simulates at least 1 CPU device; set "
                         f"it to 1 or more, or unset it (this command's default: {default})")
    return count


def simulate_host_devices(count: int) -> int:
    """XLA:CPU simulates ``count`` devices (``LOGRA_HOST_DEVICES`` overrides it, and an ``XLA_FLAGS``
    that already sets a count wins over both), with a thread pool sized for them. Returns the count
    in effect."""
    flags = os.environ.get("XLA_FLAGS", "")
    match = re.search(r"xla_force_host_platform_device_count=(\d+)", flags)
    if match:
        count = int(match.group(1))
    else:
        count = host_device_count(count)
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    size_cpu_thread_pool(count)
    return count


def size_cpu_thread_pool(devices: int) -> None:
    """Give XLA:CPU's thread pool two threads per simulated device, so that its collectives cannot
    starve each other of threads. Must run before jax starts its CPU backend.

    XLA:CPU runs every device's program on one shared pool of max(cores, devices) threads (its
    ``NPROC`` variable stands in for the core count), and a collective holds its thread until every
    device of its group has arrived. Its thunk executor runs what is ready concurrently, and one
    device can wait in two collectives at once; with one thread per device, the last device to
    arrive then finds no thread left: XLA aborts with "Expected 8 threads to join the rendezvous,
    but only 7 of them arrived" (docs/reliability.md has the run that showed it). On a machine with
    ``2 × devices`` cores or more, or with ``NPROC`` already set, nothing changes. GPUs and TPUs do
    not run collectives on a shared host pool.
    """
    if "NPROC" in os.environ:
        return
    threads = CPU_THREADS_PER_DEVICE * devices
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (cores or 1) < threads:
        os.environ["NPROC"] = str(threads)


# Gloo (the CPU collectives between processes) prints a line per communicator it connects, with
# std::cout and no switch to turn it off: ~12 per process of a two-process run, from the
# collectives' threads at once, so the lines' pieces interleave ("[Gloo] Rank [Gloo] Rank 2 is
# connected to 7 ...\n3 is connected to 7 ...\n"). What a fully connected communicator prints is
# made of these pieces and numbers only; one short of its peers adds "[Gloo] Rank i is NOT
# connected to: [...]", which is not.
_GLOO_START = b"[Gloo] Rank "
_GLOO_PIECES = (_GLOO_START, b" is connected to ", b" peer ranks. ",
                b"Expected number of connected peer ranks is : ", b"\n")


class RoutineGlooLines:
    """Drops gloo's routine connection lines from a byte stream fed in pieces (`feed`, then
    `close`), passing everything else on in order.

    A gloo burst starts at "[Gloo] Rank " and runs while the bytes are `_GLOO_PIECES` and digits.
    It is dropped when it ends after a newline at something else (or at the stream's end): every
    line of it said "connected", however the threads interleaved them. A burst that meets anything
    else mid-line — "is NOT connected to: [0]", a failure, or output of another kind — is passed
    on whole, with what follows. Bytes are held only while undecided: a burst in progress, or an
    end that may be the start of one."""

    def __init__(self):
        self._held = b""
        self._in_burst = False

    def feed(self, data: bytes) -> bytes:
        buffer, out = self._held + data, b""
        while buffer:
            if not self._in_burst:
                start = buffer.find(_GLOO_START)
                if start < 0:
                    keep = _partial_start(buffer)
                    out += buffer[:len(buffer) - keep]
                    buffer = buffer[len(buffer) - keep:]
                    break
                out, buffer, self._in_burst = out + buffer[:start], buffer[start:], True
            end, state = _burst_end(buffer)
            if state == "more":    # undecided until more bytes come
                break
            if state == "routine":
                buffer = buffer[end:]
            else:                  # not gloo's routine lines: the burst so far is passed on
                out, buffer = out + buffer[:end], buffer[end:]
            self._in_burst = False
        self._held = buffer
        return out

    def close(self) -> bytes:
        """What is still held when the stream ends: nothing of a burst that ended a line."""
        held, self._held = self._held, b""
        if self._in_burst and held.endswith(b"\n") and _burst_end(held + b"\0")[1] == "routine":
            return b""
        return held


def _partial_start(buffer: bytes) -> int:
    """How many bytes at the end of ``buffer`` begin "[Gloo] Rank " (0: none)."""
    for size in range(min(len(buffer), len(_GLOO_START) - 1), 0, -1):
        if _GLOO_START.startswith(buffer[-size:]):
            return size
    return 0


def _burst_end(buffer: bytes) -> tuple[int, str]:
    """(bytes the burst at the start of ``buffer`` covers, "routine" | "other" | "more")."""
    position, last = 0, b""
    while position < len(buffer):
        rest = buffer[position:]
        piece = next((p for p in _GLOO_PIECES if rest.startswith(p)), None)
        if piece is None and rest[:1].isdigit():
            piece = rest[:len(rest) - len(rest.lstrip(b"0123456789"))]
            if len(piece) == len(rest):
                return position, "more"   # the number may go on
        if piece is None:
            if any(p.startswith(rest) for p in _GLOO_PIECES):
                return position, "more"
            return position, ("routine" if last == b"\n" else "other")
        position, last = position + len(piece), piece
    return position, "more"


def drop_routine_gloo_lines() -> None:
    """For the rest of this process, file descriptor 1 passes through a pipe that drops gloo's
    routine connection lines (`RoutineGlooLines`) and forwards everything else as it comes: gloo
    writes them with std::cout, past ``sys.stdout``, from the collectives' own threads, and has
    no switch for them. Called by a command that joins other processes (`launch.train` with
    ``distributed.num_processes`` > 1), after `setup`. At exit what is left is forwarded."""
    sys.stdout.flush()
    original = os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)

    def forward():
        lines = RoutineGlooLines()
        while True:
            try:
                data = os.read(read_end, 1 << 16)
            except OSError:
                data = b""
            out = lines.feed(data) if data else lines.close()
            if out:
                os.write(original, out)
            if not data:
                break
        os.close(read_end)

    thread = threading.Thread(target=forward, name="gloo-lines", daemon=True)
    thread.start()

    def finish():   # fd 1 back: the pipe's last writer closes, and the thread forwards the rest
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.dup2(original, 1)
        thread.join(timeout=10)
    atexit.register(finish)


def _accelerator_plugin_without_its_device() -> bool:
    """True where libtpu (the tpu or test extra) or the CUDA plugin (gpu-plan) is installed, to
    compile for TPU or GPU targets, but this machine has no TPU chip and no GPU."""
    plugins = [name for name in ("libtpu", "jax_cuda12_plugin")
               if importlib.util.find_spec(name) is not None]
    devices = (glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
               + glob.glob("/dev/nvidia[0-9]*"))
    return bool(plugins) and not devices


class Captured:
    """What a `captured_stderr` block wrote to file descriptor 2 (``text``, once the block ends)."""
    text = ""


@contextlib.contextmanager
def captured_stderr() -> Iterator[Captured]:
    """Runs the block with file descriptor 2 sent to a temporary file; afterwards ``.text`` of the
    yielded object holds what was written there, and fd 2 is what it was. C++ libraries (XLA, the
    CUDA plugin) log to fd 2 directly, past ``sys.stderr``; the caller decides what to pass on."""
    captured = Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            captured.text = held.read().decode("utf-8", "replace")


# What the CUDA plugin's libraries log when they load on a machine without a GPU driver (absl's
# preamble, then cudart's "Could not find cuda drivers on your machine, GPU will not be used."),
# once per library: four lines on every `import jax` and backend start.
_CUDA_STUB_NOISE = ("before absl::InitializeLog() is called", "cudart_stub.cc")


def load_cuda_plugin_quietly() -> None:
    """Load the CUDA plugin's libraries (the gpu-plan extra: XLA:GPU plans GPU nodes on any
    machine) with their driver-less log lines held back, so no command prints them on a CPU-only
    machine: a one-line ``error:`` stays one line. Anything else they print is passed on.

    jax imports the plugin itself (at ``import jax`` and when its backends start); loading the same
    libraries first makes jax's loads find them loaded, and a library logs only on its first load.
    The plugin's XLA:GPU reads its log level once, as it loads: INFO lines off (each GPU compile
    logs its scheduler's budget and "Performing a deviceless compilation"), warnings kept, e.g.
    "Can't reduce memory use below ...". Where a GPU driver is present nothing is loaded here.
    """
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
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    try:
        with captured_stderr() as held:
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
        if level is None:
            del os.environ["TF_CPP_MIN_LOG_LEVEL"]
    sys.stderr.write("".join(line for line in held.text.splitlines(keepends=True)
                             if not any(noise in line for noise in _CUDA_STUB_NOISE)))


# The project's own code: its log records are messages to the user.
_OWN = tuple(str(pathlib.Path(__file__).resolve().parents[1] / part) + os.sep
             for part in ("logra_jax", "launch"))


class _PlainLines(std_logging.Formatter):
    """A record of the project's own as the line a user reads: ``warning: …`` / ``error: …`` /
    the message itself; another library's keeps absl's format (it only shows from ERROR up)."""

    def __init__(self, absl_format: std_logging.Formatter | None):
        super().__init__()
        self._absl = absl_format

    def format(self, record: std_logging.LogRecord) -> str:
        if not _is_own(record):
            return self._absl.format(record) if self._absl else super().format(record)
        prefix = ("error: " if record.levelno >= std_logging.ERROR else
                  "warning: " if record.levelno >= std_logging.WARNING else "")
        return prefix + record.getMessage()


def _is_own(record: std_logging.LogRecord) -> bool:
    return os.path.abspath(record.pathname).startswith(_OWN)


def _quiet_others(record: std_logging.LogRecord) -> bool:
    """Another library's record reaches the log only from ERROR up (JAX's "Unable to initialize
    backend 'tpu'", orbax's per-save lines are INFO; a failure is not)."""
    return _is_own(record) or record.levelno >= std_logging.ERROR


def plain_log_lines(verbose: bool) -> None:
    """absl's handler prints the project's records as plain lines and drops other libraries' below
    ERROR; ``verbose``: absl's own format for every record from INFO up."""
    from absl import logging
    logging.use_absl_handler()
    logging.set_verbosity(logging.INFO)
    handler = logging.get_absl_handler()
    handler.python_handler.filters = [f for f in handler.python_handler.filters
                                      if f is not _quiet_others]
    if verbose:
        return
    handler.python_handler.addFilter(_quiet_others)
    handler.setFormatter(_PlainLines(handler.python_handler.formatter))


def start_backend(*, verbose: bool = False) -> None:
    """`check_backend` for a command with nothing to join first: its failure is the command's one
    ``error:`` line (exit status 1)."""
    try:
        check_backend(verbose=verbose)
    except SetupError as e:
        sys.exit(f"error: {e}")


def check_backend(*, verbose: bool = False) -> None:
    """Starts JAX's backend (after `setup`, and after ``jax.distributed.initialize`` where a run
    has several processes); a platform that cannot start is a `SetupError` naming
    ``JAX_PLATFORMS`` and jax's or the plugin's reason: with ``JAX_PLATFORMS=cuda`` on a machine
    without a GPU, JAX logs the CUDA plugin's traceback and then fails with a bare AssertionError.
    ``verbose``: jax's own logs and traceback instead."""
    import jax
    if verbose:
        jax.devices()
        return
    held: list[std_logging.LogRecord] = []

    class Hold(std_logging.Handler):
        def emit(self, record):
            held.append(record)

    bridge = std_logging.getLogger("jax._src.xla_bridge")
    hold, propagate = Hold(std_logging.WARNING), bridge.propagate
    bridge.addHandler(hold)
    bridge.propagate = False
    try:
        jax.devices()
    except Exception as e:   # noqa: BLE001  jax raises AssertionError, RuntimeError, ...
        asked = os.environ.get("JAX_PLATFORMS", "")
        reasons = [str(r.exc_info[1]) if r.exc_info else r.getMessage().splitlines()[0]
                   for r in held] + [str(e)]
        why = "; ".join(dict.fromkeys(r for r in reasons if r.strip())) or type(e).__name__
        if not asked:
            raise SetupError(f"jax cannot start a backend on this machine ({why})") from e
        wanted = "a CUDA device" if re.search(r"cuda|gpu", asked) else f"platform {asked!r}"
        raise SetupError(f"JAX_PLATFORMS={asked} asks for {wanted}, but jax cannot start it on "
                         f"this machine ({why}); unset JAX_PLATFORMS (or set it to cpu) to run "
                         f"on the CPU") from e
    finally:
        bridge.removeHandler(hold)
        bridge.propagate = propagate
    for record in held:   # a plugin that failed while another platform started: still said
        bridge.handle(record)
