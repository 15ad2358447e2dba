"""Train a policy with LoGRA (or dense AdamW) by RL.

    python -m launch.train --config configs/default.py --workdir runs/default \
        [--config.max_steps=20] [--config.optimizer.name=adamw] ...

The workdir receives metrics.jsonl, TensorBoard events and orbax checkpoints; running the same
command again resumes from the latest complete checkpoint. On several hosts every one runs the
same command with its ``--config.distributed.*`` (README "More than one machine";
``bash launch/local_cluster.sh N python -m launch.train ...`` tries it on one machine).
"""

import sys

from launch import simulate_host_devices

simulate_host_devices(8)  # before jax is imported

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from logra_jax import config as config_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where metrics and checkpoints go (resumes).")
flags.mark_flags_as_required(["config", "workdir"])


def run(config, workdir: str) -> None:
    """Builds and trains; bad input, a refused resume or a diverged run end as one ``error:`` line
    and exit status 1 (SystemExit), a SIGTERM / SIGINT as one ``stopped:`` line and 128 + signum."""
    from logra_jax import distributed
    try:
        distributed.initialize(config.distributed)  # before any jax computation
    except ValueError as e:
        sys.exit(f"error: {e}")
    from logra_jax.rl import trainer  # imports jax: after the flags are parsed
    try:
        job = trainer.Run(config, workdir)
    except (ValueError, FileNotFoundError) as e:  # bad config or input: one line, no traceback
        sys.exit(f"error: {e}")
    try:
        job.loop()
    except trainer.Preempted as e:  # checkpoint saved: one line, and the signal's exit status
        job.close()
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except (ValueError, FileNotFoundError) as e:  # e.g. a workdir holding another config's run
        job.close()
        sys.exit(f"error: {e}")
    job.close()


def main(argv):
    del argv
    run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    config_lib.check_argv(sys.argv[1:], required=("config", "workdir"))
    logging.set_verbosity(logging.INFO)
    app.run(main)
