"""What a run prints: progress fields that say what they are, one line per step without the
progress bar, a closing line of what it trained (logra_jax/metrics.py, launch/train.py), and no
compiler warning."""

import functools
import shutil

from configs import tiny
from launch import train as train_cli
from logra_jax import metrics
from logra_jax.config import values as config_values
from logra_jax.perf import memory
from logra_jax.rl import build
from logra_jax.rl import assembly
from logra_jax.rl import trainer as trainer_lib
from tiny_config import tiny_config

ROWS = [{"reward": 0.5, "kl": 0.0, "time/step": 1.5}, {"reward": 0.25, "kl": 0.0, "time/step": 2.5}]


def test_without_a_bar_each_step_is_one_line_and_kl_only_when_measured(tmp_path, capsys):
    writer = metrics.MetricsWriter(tmp_path, total_steps=2, tensorboard=False, progress=False,
                                   kl_measured=False)
    for step, row in enumerate(ROWS, 1):
        writer.write(step, row)
    writer.close()
    assert capsys.readouterr().out.splitlines() == ["step 1/2: reward 0.5, 1.5 s/step",
                                                    "step 2/2: reward 0.25, 2.5 s/step"]
    assert writer.summary() == (f"trained steps 1–2 of 2 in 4 s (2 s/step), mean reward 0.375 "
                                f"(last 0.25); metrics in {tmp_path / 'metrics.jsonl'}")


def test_the_bar_labels_seconds_per_step(tmp_path):
    writer = metrics.MetricsWriter(tmp_path / "a", total_steps=2, tensorboard=False, kl_measured=True)
    writer.write(1, ROWS[0])
    assert writer._bar.postfix == "reward=0.5, kl=0, s/step=1.5"
    writer.close()


def test_launch_train_says_what_it_trained(trained_tiny_run, shipped_tiny_parts, tmp_path,
                                           monkeypatch, capsys):
    """configs/tiny.py has no progress bar: step 3 is one line, then the closing summary. The
    config is checked once, before jax (the run takes the rest of its recipe from there)."""
    workdir = tmp_path / "workdir"
    shutil.copytree(trained_tiny_run.workdir, workdir)
    monkeypatch.setattr(trainer_lib, "Run",
                        functools.partial(trainer_lib.Run, parts=shipped_tiny_parts))
    checked = []
    check_values = config_values.check_values
    monkeypatch.setattr(config_values, "check_values",
                        lambda config: checked.append(config) or check_values(config))
    capsys.readouterr()
    train_cli.run(tiny_config(dict(max_steps=3)), str(workdir))
    assert len(checked) == 1
    step, done = capsys.readouterr().out.splitlines()
    assert step.startswith("step 3/3: reward ") and step.endswith(" s/step") and "kl" not in step
    assert done.startswith("done: trained steps 3–3 of 3 in "), done
    assert done.endswith(f"; metrics in {workdir / 'metrics.jsonl'}; checkpoint 3 in "
                         f"{workdir / 'checkpoints'}"), done


def test_the_tiny_update_compiles_without_the_partitioners_warning(capfd):
    """configs/tiny.py's update on the suite's 8 devices: no ``[SPMD] Involuntary full
    rematerialization`` (docs/reliability.md). Its micro-batch of 8 rows gives every device one;
    the control, 4 rows, must warn, which also shows that XLA's C++ warnings reach this capture.
    Each program is compiled with one extra option, at its default value, so that the suite's
    persistent cache has no entry for it: a cache hit compiles nothing and would print nothing."""
    def warnings(**rl):
        config = tiny.get_config()
        config.rl.update(rl)
        lowered = memory.lower_update(config, build.build_mesh(config.mesh)).lowered
        capfd.readouterr()
        lowered.compile({"xla_dump_max_hlo_modules": -1})
        return [line for line in capfd.readouterr().err.splitlines() if "[SPMD]" in line]

    assert warnings() == []
    assert any("Involuntary full rematerialization" in line for line in warnings(micro_batch_size=4))


def test_a_micro_batch_that_does_not_split_over_the_devices_is_named_first(caplog):
    """Before XLA's warning, the run's own line says which key causes it and what to set."""
    config = tiny_config(dict(rl=dict(micro_batch_size=4)))
    mesh = build.build_mesh(config.mesh)
    assert build.uneven_micro_batches(tiny.get_config().rl, mesh) is None
    with caplog.at_level("WARNING"):
        assembly.build_run(config)
    assert [record.getMessage() for record in caplog.records if record.levelname == "WARNING"] == [
        "rl.micro_batch_size=4 rows do not split over the 8 devices of the mesh's fsdp axis, so "
        "XLA lays out the update itself and may warn of an 'Involuntary full rematerialization'; "
        "a multiple of 8 gives every device its own rows"]
