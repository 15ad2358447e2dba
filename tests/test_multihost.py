"""More than one process: 2 processes × 4 CPU devices on JAX's distributed runtime, against one
process with 8 (the same global mesh), and what happens when a process is missing or dies.

The two-process runs are real `launch.train` processes started by `launch/local_cluster.sh`, with
CPU collectives through gloo; the single-process reference runs in this pytest process.
"""

import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from logra_jax import checkpoint as checkpoint_lib
from logra_jax import distributed, host_arrays
from logra_jax import metrics as metrics_lib
from process_env import without_device_count

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.py"]


def _env(**extra) -> dict:
    """Each process gets LOGRA_HOST_DEVICES=4 from the launcher, not the suite's 8 devices."""
    return without_device_count(**extra)


def _cluster_command(workdir, *args) -> list[str]:
    return ["bash", "launch/local_cluster.sh", "2", sys.executable, "-m", "launch.train", *TINY,
            "--workdir", str(workdir), *args]


def _cluster_env(workdir) -> dict:
    """Process 1's log beside the workdir (the session's compilation cache is inherited: the
    resume compiles the same programs)."""
    return _env(LOGRA_CLUSTER_LOGS=str(pathlib.Path(workdir).parent / "logs"))


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def test_two_processes_train_stop_together_resume_and_match_one_process_with_eight_devices(
        shipped_tiny_trainer, tmp_path):
    """Two processes train; a SIGTERM to process 1 alone stops both after the same step with a
    checkpoint; the same command resumes on 2 × 4 devices to step 3. Compared with one process on
    8 devices (the same global mesh) trained 3 steps straight."""
    from configs import tiny
    from logra_jax.rl import trainer as trainer_lib

    workdir = tmp_path / "two"
    first = subprocess.Popen(_cluster_command(workdir, "--config.max_steps=3"), cwd=ROOT,
                             env=_cluster_env(workdir), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = workdir / "metrics.jsonl", time.monotonic() + 400
        while not (metrics.exists() and metrics.read_text().strip()):   # step 1 is done
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.2)
        subprocess.run(["pkill", "-TERM", "-f", f"{workdir} .*process_id=1"], check=True)
        _, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped because another process was stopped after step" in err
    (stopped_at,) = [int(p.name) for p in (workdir / "checkpoints").iterdir()]
    assert stopped_at < 3

    resumed = subprocess.run(_cluster_command(workdir, "--config.max_steps=3"), cwd=ROOT,
                             env=_cluster_env(workdir), capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, (resumed.stderr[-3000:]
                                     + (tmp_path / "logs" / "process_1.log").read_text()[-3000:])
    assert f"resumed from {workdir / 'checkpoints'} at step {stopped_at}" in resumed.stderr

    config = tiny.get_config()
    one = trainer_lib.Run(config, tmp_path / "one", trainer=shipped_tiny_trainer)
    one.loop()
    one.close()

    # metrics.jsonl: one row per step, from process 0 alone.
    two_rows = metrics_lib.read_jsonl(metrics)
    one_rows = metrics_lib.read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert [r["step"] for r in two_rows] == [1, 2, 3]
    # The rollouts are the same tokens (sampling is per row, on the row's own device), so the
    # rewards and lengths are equal exactly.
    for a, b in zip(two_rows, one_rows):
        for key in ("reward", "accuracy", "completions/mean_length"):
            assert a[key] == b[key], (a["step"], key)
    # Each step's loss, gradient norm and entropy: equal to float32 reduction order (the gradient
    # and the loss's means are summed over the 8 devices through gloo in another order than in
    # one process; measured ≤ 1.2e-7 relative, about an ulp, XLA:CPU). The tiny config's reward
    # is the same for every row, so its REINFORCE loss is −A·w̄·(the batch's mean token log-prob),
    # A changing with the running baseline from step to step: a digest of the sampled tokens'
    # log-probs, which another token anywhere would move by far more than this tolerance; the
    # entropy (every position's, over the completions) is another. A gradient wrong by a constant
    # factor shows in grad_norm (RowAdam and AdamW cancel it in the weights).
    assert len(two_rows) == len(one_rows) == 3
    assert len({r["loss"] for r in one_rows}) == 3   # the steps differ: a mix-up would show
    for a, b in zip(two_rows, one_rows):
        for key in ("loss", "grad_norm", "entropy"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-6, err_msg=f"step {a['step']}: {key}")

    # The weights: equal to fp32 rounding. Not bit for bit, by construction: the gradient's
    # all-reduce over the 8 devices sums in another order through gloo than within one process
    # (measured here: ~1e-7 relative on the loss), and that rounding passes into every update.
    t = shipped_tiny_trainer
    saved = checkpoint_lib.Checkpointer(workdir / "checkpoints").restore_params(
        3, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        t.initial_params, t.param_shardings))
    initial, single, multi = _flat(t.initial_params), _flat(one.params), _flat(saved)
    moved = np.abs(single - initial).max()
    assert moved > 1e-4                          # three updates moved the weights
    losses = [(a["loss"], b["loss"]) for a, b in zip(two_rows, one_rows)]
    assert np.abs(multi - single).max() <= 1e-3 * moved, (np.abs(multi - single).max() / moved,
                                                          losses)


def test_a_process_that_cannot_reach_the_coordinator_says_so_within_its_timeout(tmp_path):
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    tic = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "launch.train", *TINY, "--workdir", str(tmp_path),
         f"--config.distributed.coordinator_address=127.0.0.1:{port}",
         "--config.distributed.num_processes=2", "--config.distributed.process_id=1",
         "--config.distributed.initialization_timeout=3"],
        cwd=ROOT, env=_env(LOGRA_HOST_DEVICES="4"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"error: cannot reach the coordinator at 127.0.0.1:{port} within 3 s")
    assert time.monotonic() - tic < 60


def test_a_process_that_dies_stops_the_others_within_the_heartbeat_timeout(tmp_path):
    """No launcher here (a real cluster has none): JAX's coordination service notices the missing
    heartbeats and stops process 0, which would otherwise wait for its peer in a collective."""
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    heartbeat = 8
    logs = [tmp_path / f"process_{i}.log" for i in range(2)]
    procs = []
    for i in range(2):
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "launch.train", *TINY, "--workdir", str(tmp_path / "w"),
                 f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                 "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
                 f"--config.distributed.heartbeat_timeout={heartbeat}"],
                cwd=ROOT, env=_env(LOGRA_HOST_DEVICES="4"), stdout=log, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 180
        while "joined" not in logs[1].read_text():   # both are in the runtime
            assert procs[1].poll() is None and time.monotonic() < deadline, logs[1].read_text()[-2000:]
            time.sleep(0.5)
        procs[1].send_signal(signal.SIGKILL)
        tic = time.monotonic()
        rc = procs[0].wait(timeout=heartbeat + 90)
        waited = time.monotonic() - tic
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert rc != 0
    assert "stopped sending heartbeats" in logs[0].read_text()
    assert waited < heartbeat + 60, waited


def test_the_local_cluster_stops_the_others_when_one_process_fails():
    script = ("import sys, time\n"
              "pid = int([a.split('=')[1] for a in sys.argv if 'process_id' in a][0])\n"
              "sys.exit(3) if pid == 1 else time.sleep(120)\n")
    tic = time.monotonic()
    done = subprocess.run(["bash", "launch/local_cluster.sh", "2", sys.executable, "-c", script],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=100)
    assert done.returncode == 3
    assert "process 1 exited with status 3; stopping the others" in done.stderr
    assert time.monotonic() - tic < 60


# --- the pieces, in this one process ---------------------------------------------------------
def test_the_distributed_section_rejects_half_given_layouts():
    from configs import base
    cfg = base.get_config().distributed
    distributed.validate(cfg)                                  # empty: one process
    for change, words in ((dict(num_processes=2), "without a distributed.coordinator_address"),
                          (dict(coordinator_address="node0"), "expected host:port"),
                          (dict(coordinator_address="node0:123", num_processes=1), "≥ 2 processes"),
                          (dict(coordinator_address="node0:123", num_processes=2, process_id=2),
                           "must be in [0, 2)"),
                          (dict(coordinator_address="auto", heartbeat_timeout=0), "must be > 0")):
        bad = cfg.copy_and_resolve_references()
        bad.update(change)
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace(")", r"\)")):
            distributed.validate(bad)
    asked = cfg.copy_and_resolve_references()
    asked.update(coordinator_address="node0:123", num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="call logra_jax.distributed.initialize"):
        distributed.check_joined(asked)                        # this process runs alone


def test_process_rows_local_rows_and_host_shards_on_one_process():
    from jax.sharding import NamedSharding, PartitionSpec
    from logra_jax import sharding as sharding_lib
    mesh = sharding_lib.make_mesh({"fsdp": 4, "tensor": 2})
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    assert host_arrays.process_rows(rows, 8) == slice(0, 8)   # one process holds every row
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    g = host_arrays.from_process_rows(x, rows, 8)
    assert g.sharding == rows
    np.testing.assert_array_equal(host_arrays.local_rows(g), x)
    np.testing.assert_array_equal(host_arrays.to_host(g), x)
    tree = {"w": jax.device_put(x, NamedSharding(mesh, PartitionSpec("fsdp", "tensor"))),
            "b": jax.device_put(np.float32(2.0), NamedSharding(mesh, PartitionSpec()))}
    copy = host_arrays.HostShards(tree)
    back = copy.to_devices()
    assert back["w"].sharding == tree["w"].sharding
    np.testing.assert_array_equal(np.asarray(back["w"]), x)
    np.testing.assert_array_equal(copy.to_numpy()["w"], x)
    assert copy.to_numpy()["b"] == 2.0
