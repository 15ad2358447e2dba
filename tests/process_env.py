"""The environment of a test's `python -m launch.*` subprocess that sets its own device count."""

import os

# XLA:CPU's elemental emitters instead of its MLIR fusion emitters, for a command's own programs:
# at LLVM level 0 (the suite's) they compile the tiny update in 0.4 of the time (10.3 → 4.1 s; the
# tiny sampler's generate 3.6 → 1.2 s; at the default level they make no difference), and
# tests/test_preemption.py's two training processes took 51 → 38 s of CPU. Not in the pytest
# process itself: there some tests compare two programs bit for bit that only the fusion emitters
# make equal (tests/test_nnx_sketch.py: our decoder's gradients through nnx_sketch against its
# explicit probes; tests/optim/test_optim_logra.py: inject_hyperparams), and a test that compares
# a command's numbers with this process's own (tests/test_multihost.py) keeps this process's.
ELEMENTAL_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def with_elemental_emitters(flags: str) -> str:
    """``flags`` (an XLA_FLAGS value) with ``ELEMENTAL_EMITTERS``, unless it sets the emitters."""
    return flags if "xla_cpu_use_fusion_emitters" in flags else f"{flags} {ELEMENTAL_EMITTERS}".strip()


def without_device_count(*, this_process_emitters: bool = False, **extra) -> dict:
    """This process's environment, plus ``extra``, without the suite's 8-device XLA flag (the
    command simulates its own devices: `launch/process.py: setup`), and with XLA:CPU's elemental
    emitters unless ``this_process_emitters`` (its numbers are compared with this process's).
    Everything else is kept: the worker's compilation cache and LLVM level 0 for XLA's CPU code —
    dropping XLA_FLAGS whole compiled the memory report's tiny update at the default level,
    40.5 → 25.7 s of CPU with every printed number the same."""
    env = dict(os.environ, **extra)
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                     if "xla_force_host_platform_device_count" not in f)
    env["XLA_FLAGS"] = flags if this_process_emitters else with_elemental_emitters(flags)
    return env
