"""What a run prints: progress fields that say what they are, one line per step without the
progress bar, and a closing line of what it trained (logra_jax/metrics.py, launch/train.py)."""

import functools
import shutil

from launch import train as train_cli
from logra_jax import metrics
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


def test_launch_train_says_what_it_trained(trained_tiny_run, shipped_tiny_trainer, tmp_path,
                                           monkeypatch, capsys):
    """configs/tiny.py has no progress bar: step 3 is one line, then the closing summary."""
    workdir = tmp_path / "workdir"
    shutil.copytree(trained_tiny_run.workdir, workdir)
    monkeypatch.setattr(trainer_lib, "Run",
                        functools.partial(trainer_lib.Run, trainer=shipped_tiny_trainer))
    capsys.readouterr()
    train_cli.run(tiny_config(dict(max_steps=3)), str(workdir))
    step, done = capsys.readouterr().out.splitlines()
    assert step.startswith("step 3/3: reward ") and step.endswith(" s/step") and "kl" not in step
    assert done.startswith("done: trained steps 3–3 of 3 in "), done
    assert done.endswith(f"; metrics in {workdir / 'metrics.jsonl'}; checkpoint 3 in "
                         f"{workdir / 'checkpoints'}"), done
