"""What the ``launch.*`` commands do to their own process: importing one changes nothing, its
``main`` sets the process up (launch/process.py) before jax starts, and what it prints is its own
lines, not a library's start-up noise. Real processes: environments and file descriptors are a
process's."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from process_env import without_device_count

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Every ``python -m launch.<name>``: the modules of launch/ that run as a program.
COMMANDS = tuple(sorted(p.stem for p in (ROOT / "launch").glob("*.py")
                        if 'if __name__ == "__main__":' in p.read_text()))
# The commands that read a config file (``--config``: launch/cli.py's flag, or any other).
WITH_CONFIG = tuple(c for c in COMMANDS if re.search(r"define_config\(|DEFINE_config",
                                                     (ROOT / "launch" / f"{c}.py").read_text()))

# Imports ``launch`` and the named modules with os.dup2 watched; prints what changed.
IMPORT_AND_COMPARE = """
import os, sys
before = dict(os.environ)
dup2, redirected = os.dup2, []
os.dup2 = lambda *args, **kwargs: (redirected.append(args), dup2(*args, **kwargs))[1]
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print(changed, redirected, 'jax' in sys.modules)
"""


@pytest.mark.parametrize("command", COMMANDS)
def test_importing_a_command_changes_no_environment_variable_and_no_file_descriptor(command):
    done = subprocess.run([sys.executable, "-c", IMPORT_AND_COMPARE, "launch", f"launch.{command}",
                           "logra_jax", "logra_jax.config"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[] [] False", (done.stdout, done.stderr[-2000:])


def test_every_command_is_found():
    """The lists above are read from launch/: a command that stops being found would go unchecked."""
    assert {"train", "cost", "memory", "step_time", "gpu_check_versions"} <= set(COMMANDS)
    assert {"train", "cost", "memory", "step_time"} <= set(WITH_CONFIG)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_flag_is_one_error_line(command):
    """absl parses every command's line (`launch.cli.run`): a flag it does not define is one line
    and status 1, before the command imports anything heavy (a fraction of a second)."""
    done = subprocess.run([sys.executable, "-m", f"launch.{command}", "--no_such_flag=1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (
        1, "", "error: Unknown command line flag 'no_such_flag'\n"), done.stderr[-3000:]


@pytest.mark.parametrize("command", WITH_CONFIG)
def test_a_config_file_typo_is_one_error_line_in_every_command(command, tmp_path):
    """A key configs/base.py lacks, set inside a config file, is refused by whichever command reads
    it: one line naming the file, the line and the nearest key."""
    typo = tmp_path / "typo.py"
    typo.write_text("from configs import tiny\n\n\ndef get_config():\n    c = tiny.get_config()\n"
                    "    c.rl.num_generation = 4\n    return c\n")
    done = subprocess.run([sys.executable, "-m", f"launch.{command}", "--config", str(typo)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        f"error: config file {typo}:6: rl.num_generation is not a key of configs/base.py "
        f"(nearest: rl.num_generations)"], done.stderr[-3000:]


def test_setup_gives_the_device_count_and_the_pool_and_must_come_before_jax():
    script = ("import os, sys\n"
              "from launch import process\n"
              "process.setup(3)\n"
              "import jax\n"
              "print(jax.device_count(), os.environ.get('NPROC'))\n"
              "try:\n    process.setup(3)\nexcept RuntimeError as e:\n    print(e)\n")
    env = without_device_count()
    for name in ("NPROC", "JAX_PLATFORMS", "LOGRA_HOST_DEVICES"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    count, pool = done.stdout.splitlines()[0].split()
    cores = len(os.sched_getaffinity(0))
    assert (int(count), pool) == (3, "6" if cores < 6 else "None"), done.stdout
    assert done.stdout.splitlines()[1].startswith("launch.process.setup must run before jax")
    assert done.stderr == "", done.stderr   # the CUDA plugin's driver-less lines held back


def test_a_successful_export_prints_only_its_own_line(trained_tiny_run, tmp_path):
    """No CUDA-plugin traceback, no libtpu errors: one line on stdout, nothing on stderr."""
    env = without_device_count()
    env.pop("JAX_PLATFORMS", None)   # the suite's; a user's shell has none
    done = subprocess.run([sys.executable, "-m", "launch.export", "--workdir",
                           str(trained_tiny_run.workdir), "--out", str(tmp_path / "hf")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", done.stderr[-3000:]
    assert done.stdout.splitlines() == [f"exported step 2 of {trained_tiny_run.workdir} to "
                                        f"{tmp_path / 'hf'}"], done.stdout


@pytest.mark.parametrize("mesh, advice", [
    ("fsdp=3,tensor=3", "needs 9 devices, and h100-8 has 8: give a mesh of at most 8 devices "
                        "(or a multiple of 8 with --hosts: one node holds 8)"),
    ("fsdp=16", "needs 16 devices, and h100-8 has 8: give a mesh of at most 8 devices, or "
                "--hosts 2 for that many nodes of 8"),
])
def test_a_mesh_larger_than_the_target_gets_advice_that_works(mesh, advice):
    """The advice names what the target can take (the simulated CPU device count has nothing to
    do with a compile target's devices); ``--hosts 2`` with fsdp=16 plans: see docs/reliability.md."""
    done = subprocess.run([sys.executable, "-m", "launch.memory", "--config", "configs/tiny.py",
                           "--target", "h100-8", "--mesh", mesh], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=without_device_count())
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines == [f"error: --mesh {mesh} {advice}"], done.stderr[-3000:]


def test_the_suite_leaves_no_temporary_folder(tmp_path):
    """tests/conftest.py's compilation cache and tfds folders go when the process that made them
    ends (a pytest run of one small file, in a temporary folder of its own)."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_layering.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("logra_")] == []


@pytest.mark.parametrize("value, says", [
    ("abc", "error: LOGRA_HOST_DEVICES='abc' is not a whole number: it is how many CPU devices XLA "
            "simulates; set it to 1 or more, or unset it (this command's default: 8)"),
    ("0", "error: LOGRA_HOST_DEVICES=0: XLA simulates at least 1 CPU device; set it to 1 or more, "
          "or unset it (this command's default: 8)"),
    ("-2", "error: LOGRA_HOST_DEVICES=-2: XLA simulates at least 1 CPU device; set it to 1 or "
           "more, or unset it (this command's default: 8)")])
def test_a_bad_host_device_count_is_one_error_line(value, says, monkeypatch):
    """`setup` refuses a LOGRA_HOST_DEVICES that is no count first thing, as every command's one
    line (int()'s traceback before; at 0, jax's failed start blamed on JAX_PLATFORMS). In this
    process: the refusal comes before `setup` looks at jax, which the suite has imported."""
    from launch import process
    monkeypatch.setenv("LOGRA_HOST_DEVICES", value)
    with pytest.raises(SystemExit) as done:
        process.setup(8)
    assert str(done.value.code) == says
    monkeypatch.setenv("LOGRA_HOST_DEVICES", " 3 ")
    assert process.host_device_count(8) == 3
    monkeypatch.delenv("LOGRA_HOST_DEVICES")
    assert process.host_device_count(8) == 8


GLOO_OK = b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
GLOO_SHORT = b"[Gloo] Rank 1 is connected to 0 peer ranks. Expected number of connected peer ranks is : 1"


def test_gloos_routine_connection_lines_are_dropped_and_its_failures_kept():
    """What `drop_routine_gloo_lines` passes on, fed in pieces as a pipe delivers them: gloo's
    lines of communicators connected in full are dropped — interleaved by its threads too, as a
    two-process run printed them —; a short count with its "NOT connected" line, and every other
    byte, pass in order; a last partial line is passed as soon as it cannot be gloo's."""
    from launch.process import RoutineGlooLines
    interleaved = (b"[Gloo] Rank [Gloo] Rank 2 is connected to 7 peer ranks. Expected number of "
                   b"connected peer ranks is : 7\n3 is connected to 7 peer ranks. Expected number "
                   b"of connected peer ranks is : 7\n")
    not_connected = b"[Gloo] Rank 1 is NOT connected to: [0]\n"
    stream = (b"step 1/3: reward 0.1\n" + GLOO_OK + b"\n" + interleaved + b"step 2/3\n"
              + GLOO_SHORT + b"\n" + not_connected + GLOO_OK + b"\nprompt> ")
    want = (b"step 1/3: reward 0.1\nstep 2/3\n" + GLOO_SHORT + b"\n" + not_connected
            + b"prompt> ")
    for size in (1, 7, 64, len(stream)):   # the same output whatever the reads' sizes
        lines = RoutineGlooLines()
        out = b"".join(lines.feed(stream[i:i + size]) for i in range(0, len(stream), size))
        assert out == want, (size, out)
        assert lines.close() == b""
    lines = RoutineGlooLines()
    assert lines.feed(b"done [Glo") == b"done "    # may still become gloo's: held
    assert lines.feed(b"ve]") == b"[Glove]"        # cannot: passed on
    assert lines.feed(GLOO_OK + b"\n") == b"" and lines.close() == b""   # the stream's end
    lines = RoutineGlooLines()
    assert lines.feed(GLOO_OK) == b"" and lines.close() == GLOO_OK   # a line cut short: kept


def test_the_gloo_filter_passes_the_processs_own_output_to_the_end():
    """In a real process (file descriptors are a process's): after `drop_routine_gloo_lines`,
    what C++ writes to fd 1 directly (as gloo does) and Python prints both arrive, in order, the
    routine gloo line left out — the last byte too, forwarded as the process exits."""
    ok, short = GLOO_OK + b"\n", GLOO_SHORT + b"\n[Gloo] Rank 1 is NOT connected to: [0]\n"
    script = ("import os, sys\n"
              "from launch import process\n"
              "process.drop_routine_gloo_lines()\n"
              "print('before', flush=True)\n"
              f"os.write(1, {ok!r})\n"
              "print('middle', flush=True)\n"
              f"os.write(1, {short!r})\n"
              "print('after', end='')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"before\nmiddle\n" + short + b"after", done.stdout
