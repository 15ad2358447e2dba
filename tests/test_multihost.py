"""More than one process: 2 processes × 4 CPU devices on JAX's distributed runtime, against one
process with 8 (the same global mesh), and what happens when a process is missing or dies.

The two-process runs are real `launch.train` processes started by `launch/local_cluster.sh`, with
CPU collectives through gloo; the single-process reference runs in this pytest process.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from logra_jax import checkpoint as checkpoint_lib
from logra_jax import distributed, host_arrays
from logra_jax import metrics as metrics_lib
from process_env import without_device_count
from tiny_config import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.py"]


@pytest.fixture(scope="module")
def answering(tmp_path_factory) -> dict:
    """configs/tiny.py's overrides for a model whose rewards vary from step to step: a tiny decoder
    (Hugging Face folder) whose next token is, at every position, end-of-text or "7" about evenly,
    on GSM8K-format questions whose answer is 7. A completion earns 1 when it is "7" alone (about
    a quarter of them), so reward, accuracy and length differ between steps and between rows;
    configs/tiny.py's random model earns −0.01 on every row of every step.

    The weights: the embeddings' first feature set to 8 standard deviations for every token, so
    that it dominates the last hidden state after the final norm; the head reads that feature
    only, into the two tokens' logits (+2 each: ~16 after the norm, all others 0); the layers'
    output projections scaled by 0.3, so they add a little without outweighing it. Every weight
    stays trainable and the layers stay live (their gradients are not zero)."""
    from logra_jax.data.gsm8k import load_gsm8k
    from logra_jax.models import Decoder, ModelConfig, gguf_loader
    from logra_jax.models.hf_export import write_hf_folder
    from logra_jax.rl.policy import Policy
    from logra_jax.tree_paths import leaves_with_paths

    folder = tmp_path_factory.mktemp("answering")
    tokenizer = gguf_loader.smollm2_tokenizer()
    (seven,) = tokenizer.encode("7")
    shape = dict(tiny_config().model.tiny)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, **dict(shape, tie_embeddings=False))
    weights = {path: np.array(jax.device_get(value)) for path, value in
               leaves_with_paths(Policy.params_of(Decoder(config, rngs=nnx.Rngs(0))))}
    embedding = weights["embed_tokens/embedding"]
    embedding[:, 0] = 8 * embedding.std()
    head = weights["lm_head/kernel"]
    head[:] = 0.0
    head[0, [tokenizer.eos_id, seven]] = 2.0
    for path in weights:
        if path.endswith(("o_proj/kernel", "down_proj/kernel")):
            weights[path] *= 0.3
    write_hf_folder(config, weights, tokenizer, folder / "hf")

    gsm8k = folder / "gsm8k"
    gsm8k.mkdir()
    lines = [json.dumps({"question": f"Question {i}: which number comes after six?",
                         "answer": "Six and one make seven.\n#### 7"}) for i in range(64)]
    for split in ("train", "test"):
        (gsm8k / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    load_gsm8k(gsm8k, "train", cache_dir=folder / "cache")   # prepared once, before the processes
    return dict(model=dict(source=str(folder / "hf")),
                data=dict(source="gsm8k", gsm8k_dir=str(gsm8k), gsm8k_cache_dir=str(folder / "cache")))


def _flags(overrides: dict, prefix: str = "--config") -> list[str]:
    """``overrides`` (nested dicts) as ``--config.section.key=value`` flags."""
    return [flag for key, value in overrides.items()
            for flag in (_flags(value, f"{prefix}.{key}") if isinstance(value, dict)
                         else [f"{prefix}.{key}={value}"])]


def _env(**extra) -> dict:
    """Each process gets LOGRA_HOST_DEVICES=4 from the launcher, not the suite's 8 devices."""
    return without_device_count(**extra)


class Cluster:
    """``bash launch/local_cluster.sh`` as its own process group, its output in files: a test that
    fails (or a cluster that hangs in a collective) kills the whole group in `stop`, and nothing
    here waits without a timeout or on a pipe that a child of the group still holds."""

    def __init__(self, command: list[str], env: dict, logs: pathlib.Path):
        logs.mkdir(parents=True, exist_ok=True)
        self.out, self.err = logs / "cluster.out", logs / "cluster.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err,
                                         start_new_session=True)

    def stderr(self) -> str:
        return self.err.read_text()

    def wait(self, timeout: float) -> int:
        """The launcher's exit status; a cluster still running after ``timeout`` is a failure."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the cluster did not end within {timeout:.0f} s: {self.stderr()[-3000:]}")

    def stop(self) -> None:
        """Kills every process of the group (the launcher and the launch.train processes)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)


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
        answering, tmp_path):
    """Two processes train; a SIGTERM to process 1 alone stops both after the same step with a
    checkpoint; the same command resumes on 2 × 4 devices to step 3. Compared with one process on
    8 devices (the same global mesh) trained 3 steps straight, on the `answering` model, whose
    rewards vary between steps and rows."""
    from logra_jax.rl import trainer as trainer_lib

    workdir = tmp_path / "two"
    command = _cluster_command(workdir, "--config.max_steps=3", *_flags(answering))
    first = Cluster(command, _cluster_env(workdir), tmp_path / "first")
    try:
        metrics, deadline = workdir / "metrics.jsonl", time.monotonic() + 400
        while not (metrics.exists() and metrics.read_text().strip()):   # step 1 is done
            if first.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no step 1 (status {first.proc.poll()}): {first.stderr()[-3000:]}")
            time.sleep(0.2)
        subprocess.run(["pkill", "-TERM", "-f", f"{workdir} .*process_id=1"], check=True,
                       timeout=60)
        status = first.wait(timeout=300)
    finally:
        first.stop()
    err = first.stderr()
    assert status == 128 + signal.SIGTERM, err[-3000:]
    # Gloo's line per connected communicator (about 12 a process) is left out of what each prints.
    printed = first.out.read_text() + (tmp_path / "logs" / "process_1.log").read_text()
    assert "peer ranks" not in printed, printed[:2000]
    assert "stopped because another process was stopped after step" in err
    (stopped_at,) = [int(p.name) for p in (workdir / "checkpoints").iterdir()]
    assert stopped_at < 3

    resumed = Cluster(command, _cluster_env(workdir), tmp_path / "resumed")
    try:
        status = resumed.wait(timeout=400)
    finally:
        resumed.stop()
    assert status == 0, (resumed.stderr()[-3000:]
                         + (tmp_path / "logs" / "process_1.log").read_text()[-3000:])
    assert f"resumed from {workdir / 'checkpoints'} at step {stopped_at}" in resumed.stderr()

    one = trainer_lib.Run(tiny_config(answering), tmp_path / "one")
    one.loop()
    one.close()

    # metrics.jsonl: one row per step, from process 0 alone.
    two_rows = metrics_lib.read_jsonl(metrics)
    one_rows = metrics_lib.read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert [r["step"] for r in two_rows] == [1, 2, 3]
    assert len(one_rows) == 3
    # The premise: rewards and lengths differ between steps, so equal ones say the same rollouts.
    assert len({r["reward"] for r in one_rows}) > 1 and len(
        {r["completions/mean_length"] for r in one_rows}) > 1, one_rows
    # The rollouts are the same tokens (sampling is per row, on the row's own device), so the
    # rewards, accuracies and lengths are equal exactly.
    for a, b in zip(two_rows, one_rows):
        for key in ("reward", "accuracy", "completions/mean_length"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    # Each step's loss, gradient norm and entropy: equal to float32 reduction order. The gradient
    # and the loss's means are summed over the 8 devices through gloo in another order than in one
    # process, and from step 2 on the weights differ by that rounding too: measured relative gaps
    # 0 at step 1, up to 3.7e-7 (loss), 1.1e-6 (grad_norm) and 3.4e-7 (entropy) at steps 2–3
    # (XLA:CPU, 2 × 4 against 1 × 8 devices, one micro-batch of 8 rows; with two of 4 rows, up to
    # 4.0e-6 and 4.2e-6). The REINFORCE loss
    # weighs every sampled token's log-prob by its row's advantage, so it is a digest of the
    # rollouts; the entropy is another. A gradient wrong by a constant factor shows in grad_norm
    # (the norm before clipping; RowAdam and AdamW cancel a uniform scale in the weights).
    assert len({r["loss"] for r in one_rows}) == 3   # the steps differ: a mix-up would show
    for a, b in zip(two_rows, one_rows):
        for key in ("loss", "grad_norm", "entropy"):
            np.testing.assert_allclose(a[key], b[key], rtol=2e-5, err_msg=f"step {a['step']}: {key}")

    # The weights: equal to fp32 rounding. Not bit for bit, by construction: the gradient's
    # all-reduce over the 8 devices sums in another order through gloo than within one process,
    # and that rounding passes into every update (measured: the largest weight gap 9.5e-5 of the
    # largest weight move, which the clipped, normalised updates of this model make 8.8e-3).
    t = one.parts
    initial = _flat(t.initial_params)
    saved = checkpoint_lib.Checkpointer(workdir / "checkpoints").restore_params(
        3, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        t.initial_params, t.param_shardings))
    single, multi = _flat(one.params), _flat(saved)
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


def _two_processes(tmp_path, args: list[list[str]], **config) -> list[subprocess.Popen]:
    """Two `launch.train` processes of one runtime, started by hand (the launcher gives both the
    same arguments), process i with ``args[i]``; output in tmp_path/process_i.log."""
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(2):
        with open(tmp_path / f"process_{i}.log", "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "launch.train", *TINY, *args[i],
                 f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                 "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
                 *_flags(config)],
                cwd=ROOT, env=_env(LOGRA_HOST_DEVICES="4"), stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait_all(procs, timeout: float) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_processes_given_different_configs_or_workdirs_stop_before_writing_and_say_which(tmp_path):
    """Process 1 with another learning rate and another --workdir: both processes stop before
    anything is written, each with one line naming the keys that differ and the processes (a run
    trained on the mixture, or hung in its first checkpoint for minutes)."""
    workdirs = [tmp_path / "w0", tmp_path / "w1"]
    procs = _two_processes(tmp_path, [["--workdir", str(workdirs[0])],
                                      ["--workdir", str(workdirs[1]),
                                       "--config.optimizer.logra.learning_rate=0.01"]])
    assert _wait_all(procs, timeout=240) == [1, 1]
    for i in range(2):
        last = (tmp_path / f"process_{i}.log").read_text().strip().splitlines()[-1]
        assert last.startswith("error: the 2 processes of this run disagree at the start of the "
                               "run: "), last
        own = json.dumps(tiny_config().optimizer.logra.learning_rate)
        assert f"optimizer.logra.learning_rate is {own} on process 0, 0.01 on process 1" in last, last
        assert f'workdir is "{workdirs[0]}" on process 0, "{workdirs[1]}" on process 1' in last, last
    assert not any(w.exists() for w in workdirs)   # each created its workdir and took it back


def test_a_process_left_waiting_for_its_peer_stops_naming_what_it_waited_for(tmp_path):
    """Process 1 fails before the run's start (its --workdir is a file): process 0, waiting for
    it there, stops at once with one line naming the point and process 1's own error line, and
    takes back the workdir it created."""
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    procs = _two_processes(tmp_path, [["--workdir", str(tmp_path / "w")],
                                      ["--workdir", str(blocked)]])
    statuses = _wait_all(procs, timeout=240)
    log = (tmp_path / "process_0.log").read_text()
    assert statuses == [1, 1], log[-3000:]
    assert log.strip().splitlines()[-1] == (
        f"error: process 1 of 2 stopped before the start of the run: error: workdir {blocked} is "
        f"a file, not a folder; pass a folder for metrics and checkpoints"), log[-3000:]
    assert not (tmp_path / "w").exists()


def test_the_local_cluster_stops_the_others_when_one_process_fails(tmp_path):
    script = ("import sys, time\n"
              "pid = int([a.split('=')[1] for a in sys.argv if 'process_id' in a][0])\n"
              "sys.exit(3) if pid == 1 else time.sleep(120)\n")
    tic = time.monotonic()
    cluster = Cluster(["bash", "launch/local_cluster.sh", "2", sys.executable, "-c", script],
                      _env(), tmp_path)
    try:
        status = cluster.wait(timeout=100)
    finally:
        cluster.stop()
    assert status == 3
    assert "process 1 exited with status 3; stopping the others" in cluster.stderr()
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
