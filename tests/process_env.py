"""The environment of a test's `python -m launch.*` subprocess that sets its own device count."""

import os


def without_device_count(**extra) -> dict:
    """This process's environment, plus ``extra``, without the suite's 8-device XLA flag (the
    command simulates its own devices: `launch/process.py: setup`). Everything
    else is kept: the worker's compilation cache, LLVM level 0 and the elemental emitters for
    XLA's CPU code (tests/emitters.py) — dropping
    XLA_FLAGS whole compiled the memory report's tiny update at the default level, 40.5 → 25.7 s
    of CPU with every printed number the same."""
    env = dict(os.environ, **extra)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    return env
