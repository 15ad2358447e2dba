"""Train a policy with LoGRA (or dense AdamW) by RL.

    python -m launch.train --config configs/default.py --workdir runs/default \
        [--config.max_steps=20] [--config.optimizer.name=adamw] ... [--fresh] [--verbose]

The workdir receives metrics.jsonl, TensorBoard events and orbax checkpoints; running the same
command again resumes from the latest complete checkpoint. One run at a time holds a workdir, and
a run that cannot continue what a workdir holds is refused (``--fresh`` moves that aside and starts
over; docs/reliability.md). ``--config`` also takes a run's own ``config.json``, to repeat that run.
On several hosts every one runs the same command with its ``--config.distributed.*``
(docs/distributed.md; ``bash launch/local_cluster.sh N python -m launch.train ...`` tries it on one
machine).
"""

import sys

from absl import flags

from configs import base
from launch import cli
from logra_jax import config as config_lib

_CONFIG = cli.define_config(help_string="A configs/*.py file, or a run's config.json.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where metrics and checkpoints go (resumes).")
_FRESH = flags.DEFINE_bool("fresh", False, "Start over in a workdir that holds an earlier run: its "
                           "checkpoints, config.json, metrics and events move to previous-<time>/.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Errors with their traceback, and JAX's start-up "
                             "messages.")

# launch.train simulates 8 CPU devices where there is no accelerator (LOGRA_HOST_DEVICES: another
# count), so a CPU run takes the sharded path of an 8-GPU node.
HOST_DEVICES = 8

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
    one ``stopped:`` line and 128 + signum. ``verbose``: errors keep their traceback.

    The checks that need nothing but the config and the workdir's path come first, before jax is
    imported: a bad value is refused in a moment, and nothing is created."""
    from logra_jax.rl import stopping, workdir as workdir_lib

    def fail(e: BaseException):
        _announce_exit(f"error: {e}")
        if verbose:
            raise e
        sys.exit(f"error: {e}")

    try:
        config_lib.validate(config)
        workdir_lib.check_path(workdir)
    except ValueError as e:
        fail(e)
    warn_ignored_options(config)
    job = None
    try:
        from launch import process
        from logra_jax import distributed
        try:
            if distributed.is_multiprocess(config.distributed) and not verbose:
                process.drop_routine_gloo_lines()   # gloo's per-communicator "connected" lines
            distributed.initialize(config.distributed)  # before any jax computation
            stopping.reinstall()   # JAX's distributed runtime installs its own SIGTERM handler
            process.check_backend(verbose=verbose)
        except (ValueError, process.SetupError) as e:
            fail(e)
        from logra_jax.rl import assembly, trainer  # imports jax
        try:   # checked above: the recipe's other half, not a second check
            job = trainer.Run(config, workdir, fresh=fresh, recipe=assembly.Recipe.of(config))
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
    except stopping.Interrupted as e:  # before the first step: nothing trained, nothing kept
        if job is not None:
            job.close()
        stopped_before_training(e)
    job.close()
    if job.summary is not None:   # what the run did, with or without a progress bar
        print(f"done: {job.summary}", flush=True)


def stopped_before_training(e) -> None:
    """The one line of a run stopped by a signal before its first step, and the signal's status."""
    _announce_exit(f"stopped: {e}")
    print(f"stopped: {e}; nothing was trained", file=sys.stderr)
    sys.exit(128 + e.signum)


def _announce_exit(line: str) -> None:
    """The other processes of a multi-process run learn why this one ends (they may be waiting
    for it before the first step: `distributed.agree`)."""
    if "logra_jax.distributed" in sys.modules:   # jax is imported and the runtime may be joined
        sys.modules["logra_jax.distributed"].announce_exit(line)


def main(argv):
    del argv
    from launch import process
    from logra_jax.rl import stopping
    stopping.install()   # first: a signal from here on stops the run cleanly
    try:
        process.setup(HOST_DEVICES, verbose=_VERBOSE.value)
        run(_CONFIG.value, _WORKDIR.value, fresh=_FRESH.value, verbose=_VERBOSE.value)
    except stopping.Interrupted as e:   # while jax was being imported, before run's own handling
        stopped_before_training(e)


if __name__ == "__main__":
    cli.run(main, required=("config", "workdir"))
