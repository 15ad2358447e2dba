"""Train a policy with LoGRA (or dense AdamW) by RL.

    python -m launch.train --config configs/default.py --workdir runs/default \
        [--config.max_steps=20] [--config.optimizer.name=adamw] ... [--fresh] [--verbose]

The workdir receives metrics.jsonl, TensorBoard events and orbax checkpoints; running the same
command again resumes from the latest complete checkpoint. One run at a time holds a workdir, and
a run that cannot continue what a workdir holds is refused (``--fresh`` moves that aside and starts
over; docs/reliability.md). On several hosts every one runs the same command with its
``--config.distributed.*`` (docs/distributed.md; ``bash launch/local_cluster.sh N
python -m launch.train ...`` tries it on one machine).
"""

import sys

from launch import simulate_host_devices

simulate_host_devices(8)  # before jax is imported

import logging as std_logging  # noqa: E402

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from configs import base  # noqa: E402
from logra_jax import config as config_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where metrics and checkpoints go (resumes).")
_FRESH = flags.DEFINE_bool("fresh", False, "Start over in a workdir that holds an earlier run: its "
                           "checkpoints, config.json, metrics and events move to previous-<time>/.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Errors with their traceback, and JAX's start-up "
                             "messages.")
flags.mark_flags_as_required(["config", "workdir"])

# Anticipated failures: bad values, unreadable or malformed files (UnicodeDecodeError and
# json.JSONDecodeError are ValueErrors), a workdir in use, a write that fails. Each is raised with
# a message naming the key or the file, and ends as that one line.
EXPECTED_ERRORS = (ValueError, OSError)


def warn_ignored_options(config) -> None:
    """One line per option the chosen algorithm does not read, set to a non-default value."""
    for key in config_lib.ignored_options(config, base.get_config()):
        print(f"warning: {key} is not used by rl.algorithm={config.rl.algorithm!r}; it has no "
              f"effect on this run", file=sys.stderr)


def run(config, workdir: str, *, fresh: bool = False, verbose: bool = False) -> None:
    """Builds and trains; bad input, a refused resume, a workdir in use, a failed write or a
    diverged run end as one ``error:`` line and exit status 1 (SystemExit), a SIGTERM / SIGINT as
    one ``stopped:`` line and 128 + signum. ``verbose``: errors keep their traceback."""
    from logra_jax import distributed

    def fail(e: Exception):
        if verbose:
            raise e
        sys.exit(f"error: {e}")

    try:
        distributed.initialize(config.distributed)  # before any jax computation
    except ValueError as e:
        fail(e)
    from logra_jax.rl import trainer  # imports jax: after the flags are parsed
    warn_ignored_options(config)
    try:
        job = trainer.Run(config, workdir, fresh=fresh)
    except EXPECTED_ERRORS as e:  # bad config, input or workdir: nothing was written
        fail(e)
    try:
        job.loop()
    except trainer.Preempted as e:  # checkpoint saved: one line, and the signal's exit status
        job.close()
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except EXPECTED_ERRORS as e:  # e.g. a diverged run, a checkpoint that cannot be written
        job.close()
        fail(e)
    job.close()
    if job.summary is not None:   # what the run did, with or without a progress bar
        print(f"done: {job.summary}", flush=True)


def quiet_startup() -> None:
    """JAX logs at INFO that it looked for a TPU and found none ("Unable to initialize backend
    'tpu'") on every machine without one: true, harmless, and it buried the one line that matters."""
    std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)


def main(argv):
    del argv
    if not _VERBOSE.value:
        quiet_startup()
    run(_CONFIG.value, _WORKDIR.value, fresh=_FRESH.value, verbose=_VERBOSE.value)


if __name__ == "__main__":
    config_lib.check_argv(sys.argv[1:], required=("config", "workdir"))
    logging.set_verbosity(logging.INFO)
    app.run(main)
