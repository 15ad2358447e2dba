"""Tests run on CPU with 8 simulated devices; this must happen before jax is imported anywhere."""

import os

# LLVM's optimisation level 0 for XLA's CPU code: the suite's tiny programs spend far longer
# compiling than running (measured: tests/optim/test_optim_logra.py + tests/test_lora.py, 71 s → 42 s).
# Benchmarks and real runs keep the default; what a test checks (exact-by-construction merges,
# bit-equal resumes and syncs) holds at any level, since both sides of a comparison share it.
# And XLA:CPU's elemental emitters instead of its fusion emitters: at level 0 they compile in 0.4
# of the time (tests/emitters.py; a developer's own setting of them wins).
from emitters import with_elemental_emitters  # noqa: E402

os.environ["XLA_FLAGS"] = with_elemental_emitters(
    (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
     " --xla_backend_optimization_level=0").strip())
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Two threads per device in XLA:CPU's pool, as every launch.* command has: with one, a device
# waiting in two collectives at once starves another (launch/process.py: size_cpu_thread_pool).
from launch.process import size_cpu_thread_pool  # noqa: E402

size_cpu_thread_pool(8)
# One persistent compilation cache per pytest-xdist worker, inherited by the launch.* subprocesses
# it starts: the many real-process tests (signals, bad input, resumes, two-process runs) compile the
# same train step again and again, and a cached program loads in a fraction of the compile. Every
# program is kept, not only those over JAX's default second of compile: a warm 1-step tiny
# launch.train compiles ~90 small programs of ~40 ms each (measured: 31.7 s cold, 16.9 s warm with
# the default, 13.9 s warm keeping all).
# No size limit: a limit is what turns on JAX's file lock, and with it every write globs the whole
# folder and rereads each entry's access-time file (jax/_src/lru_cache.py: _evict_if_needed), so a
# session's thousands of small programs make the writes quadratic (measured: 44 ms a write at 1,000
# entries, 475 ms at 10,000; tests/test_model_logprobs.py 7.7 s on an empty cache, 17.1 s beside
# 3,000 entries). Without the lock an entry is written in place, so no two workers share a folder;
# a worker's processes that compile one program at once may, rarely, read an entry half written,
# which JAX reports as a warning and compiles again (jax/_src/compiler.py: _cache_read).
# Each worker also gets its own tfds data folder (tfds prepares a dataset in place; set before
# tensorflow_datasets is imported). The process that makes a folder removes it when it exits
# (the launch.* subprocesses that use it end first): a session leaves nothing in /tmp.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402


def _own_temporary_folder(prefix: str) -> str:
    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
# A worker inherits the controller's environment: LOGRA_TEST_OWN_CACHES says the folder there is
# the suite's own (not one a developer set), so the worker replaces it with a folder of its own.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ or os.environ.get("LOGRA_TEST_OWN_CACHES"):
    os.environ["LOGRA_TEST_OWN_CACHES"] = "1"
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _own_temporary_folder(f"logra_xla_{_WORKER}_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ.pop("JAX_COMPILATION_CACHE_MAX_SIZE", None)
if _WORKER != "main":
    os.environ["TFDS_DATA_DIR"] = _own_temporary_folder(f"logra_tfds_{_WORKER}_")

import pathlib  # noqa: E402

import pytest  # noqa: E402

# The files whose tests run longest (real processes, many compiled trainers), longest first.
# `make test` hands whole files to two xdist workers in collection order
# (--dist loadfile --no-loadscope-reorder); xdist's default order, most tests first, started the
# two-test preemption file and the two-process file last, and one worker then ran them alone while
# the other idled. Longest first leaves the many short files to even out the end.
LONGEST_FIRST = ("test_gpu_cost.py", "test_trainer_sync.py", "test_multihost.py", "test_sync.py",
                 "test_pipeline.py", "test_tpu_compile.py", "test_gpu_compile.py", "test_gpu_check.py",
                 "test_tpu_casts.py", "test_model_decoder.py", "test_baselines.py", "test_preemption.py",
                 "test_bad_input.py", "test_trainer.py", "test_sampler.py", "test_sampler_slots.py",
                 "test_memory.py", "test_assembly.py", "test_nnx_sketch.py", "test_workdir.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest keep order


SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared"
GSM8K_DIR = SHARED / "data" / "gsm8k"


@pytest.fixture(scope="session")
def gsm8k_dir() -> pathlib.Path:
    """The real GSM8K JSONL files that CI provides beside the repository: a developer without
    them skips the tests that read them; on CI (CI=true) their absence is a failure, since those
    tests would otherwise pass there by not running."""
    if not (GSM8K_DIR / "test.jsonl").exists():
        why = f"GSM8K files not found at {GSM8K_DIR} (CI provides ../shared/data/gsm8k)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{why}; CI=true, so this is a failure, not a skip", pytrace=False)
        pytest.skip(why)
    return GSM8K_DIR


@pytest.fixture(scope="session")
def shipped_tiny_parts():
    """The parts of a run of configs/tiny.py as shipped (compiled once for the modules that run
    them)."""
    from configs import tiny
    from logra_jax.rl import assembly
    return assembly.build_run(tiny.get_config())


@pytest.fixture(scope="session")
def trained_tiny_run(shipped_tiny_parts, tmp_path_factory):
    """configs/tiny.py trained 2 steps (weights moved, checkpoint 2 written; every=2), as the
    finished Run; tests read its workdir (``run.workdir``) and copy it before changing anything."""
    from configs import tiny
    from logra_jax.rl import trainer as trainer_lib
    config = tiny.get_config()
    config.max_steps = 2
    run = trainer_lib.Run(config, tmp_path_factory.mktemp("trained"), parts=shipped_tiny_parts)
    run.loop()
    run.close()
    assert (run.workdir / "checkpoints" / "2").is_dir()
    return run
