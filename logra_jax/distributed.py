"""More than one process: JAX's distributed runtime, started from the ``distributed`` config section.

One process per host (or several on one machine, `launch/local_cluster.sh`) runs the same command;
`initialize` joins them into one runtime, after which ``jax.devices()`` lists every process's devices
and one mesh spans them all. What each process then does differently is small and lives where it
is used: each samples and grades its own rows of the batch (rollout.py, `sharding.process_rows`),
process 0 alone writes metrics (metrics.py), and every process takes part in each checkpoint
(orbax writes each array's shards from the process that holds them).

Failures are bounded by two timeouts of JAX's coordination service, both in the config:

- ``initialization_timeout``: how long `initialize` waits for all processes to register. A process
  that cannot reach the coordinator first gets one clear error from `_check_reachable`; the
  coordinator itself, left waiting for processes that never come, is stopped by JAX with a
  ``DEADLINE_EXCEEDED ... RegisterTask`` message after this time.
- ``heartbeat_timeout``: a process that dies (or hangs) stops sending heartbeats; after this time the
  service stops every other process with ``The following tasks are unhealthy (stopped sending
  heartbeats)``. A collective that waits for the dead process waits at most this long.

Before a run writes anything, its processes `agree` on what must be the same everywhere (the
config, the workdir's real path, the checkpoints there; after the restore the step and the data
position): each publishes its values in the coordination service's key-value store and reads the
others', polling, so SIGTERM and SIGINT still stop a process that waits. A difference ends every
process with one line naming the key and the processes; a process that never publishes ends the
others after ``initialization_timeout``, naming what they waited for.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

AUTO = "auto"   # coordinator_address: let JAX read the cluster's environment (SLURM, TPU pod slices)


def is_multiprocess(cfg: ml_collections.ConfigDict) -> bool:
    """Whether the config asks for JAX's distributed runtime (before it is started)."""
    return bool(cfg.coordinator_address)


def validate(cfg: ml_collections.ConfigDict) -> None:
    """The section's values alone: an address needs a process count ≥ 2 and an id below it."""
    address, n, pid = cfg.coordinator_address, cfg.num_processes, cfg.process_id
    if not address:
        if n > 1 or pid > 0:
            raise ValueError(f"distributed.num_processes={n}, process_id={pid} without a "
                             f"distributed.coordinator_address: give process 0's host:port (or "
                             f"'{AUTO}' on a cluster JAX detects), or leave all three unset for one "
                             f"process")
        return
    if not (cfg.initialization_timeout > 0 and cfg.heartbeat_timeout > 0):
        raise ValueError(f"distributed.initialization_timeout and heartbeat_timeout must be > 0 "
                         f"seconds, got {cfg.initialization_timeout} and {cfg.heartbeat_timeout}")
    if address == AUTO:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"distributed.coordinator_address={address!r}: expected host:port (process "
                         f"0's address and a free port, e.g. 10.0.0.1:12345) or '{AUTO}'")
    if n < 2:
        raise ValueError(f"distributed.num_processes={n}: a coordinator address needs ≥ 2 processes "
                         f"(leave the address empty for one)")
    if not 0 <= pid < n:
        raise ValueError(f"distributed.process_id={pid}: must be in [0, {n}) for {n} processes")


def _check_reachable(address: str, timeout: float) -> None:
    """A process other than the coordinator tries to open a TCP connection to it for up to
    ``timeout`` seconds (the coordinator may still be starting): JAX's own failure here is a fatal
    abort naming an RPC, this is one line naming the address and what to check."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ValueError(f"cannot reach the coordinator at {address} within {timeout:g} s "
                                 f"(distributed.initialization_timeout): {e.strerror or e}; start "
                                 f"process 0 there, or check the address and that the port is "
                                 f"open") from None
            time.sleep(0.5)


def initialize(cfg: ml_collections.ConfigDict) -> None:
    """Joins JAX's distributed runtime when the section asks for it; nothing for one process.

    Must run before any jax computation (the backends see every process's devices only after it).
    On CPU the collectives between processes go through gloo.
    """
    validate(cfg)
    if not is_multiprocess(cfg):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = dict(initialization_timeout=int(cfg.initialization_timeout),
                    heartbeat_timeout_seconds=int(cfg.heartbeat_timeout))
    if cfg.coordinator_address == AUTO:
        jax.distributed.initialize(**timeouts)
    else:
        if cfg.process_id > 0:
            _check_reachable(cfg.coordinator_address, cfg.initialization_timeout)
        logging.info("distributed: process %d of %d, coordinator %s; waiting up to %d s for the "
                     "others (distributed.initialization_timeout)", cfg.process_id,
                     cfg.num_processes, cfg.coordinator_address, cfg.initialization_timeout)
        jax.distributed.initialize(cfg.coordinator_address, cfg.num_processes, cfg.process_id,
                                   **timeouts)
    logging.info("distributed: process %d of %d joined; %d of %d devices are local",
                 jax.process_index(), jax.process_count(), jax.local_device_count(),
                 jax.device_count())


def check_joined(cfg: ml_collections.ConfigDict) -> None:
    """The runtime must be what the section asks for: code that builds a run in its own process
    (not through launch.train) has to call `initialize` first."""
    if not is_multiprocess(cfg) or cfg.coordinator_address == AUTO:
        return
    if jax.process_count() != cfg.num_processes:
        raise ValueError(f"distributed.num_processes={cfg.num_processes}, but the runtime has "
                         f"{jax.process_count()} process(es): call logra_jax.distributed."
                         f"initialize(config.distributed) before any jax computation "
                         f"(launch.train does)")


def is_primary() -> bool:
    """Process 0: the one that writes metrics, config.json and the progress bar."""
    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """True on every process when ``flag`` is true on any (e.g. a stop request that reached one
    host): each process must leave the loop after the same step, or the others would wait in a
    collective for it."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


def barrier(name: str) -> None:
    """Waits until every process reaches the same named point (no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


POLL_SECONDS = 0.2   # between reads of the key-value store: signals are handled in between
EXIT_KEY = "logra/exit/"   # + process index: why that process ended before training


def agree(what: str, facts: dict[str, Any], timeout: float) -> None:
    """Every process of the run must hold the same ``facts`` ({name: JSON-able value}); ``what``
    names the point of the run they are compared at (unique per point). One process: nothing.

    Raises ValueError naming each fact that differs, its value on each process, when they do not
    agree, and when a process has not published its own within ``timeout`` seconds (it failed
    before this point, or is stuck). A dict fact is compared key by key (a config's dotted
    keys), and the keys that differ are named."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed
    client = jax_distributed.global_state.client
    me, count = jax.process_index(), jax.process_count()
    key = f"logra/agree/{what}/"
    client.key_value_set(key + str(me), json.dumps(facts, sort_keys=True, default=str))
    deadline = time.monotonic() + timeout
    published: dict[int, dict] = {}
    while len(published) < count:
        for p in range(count):
            if p not in published:
                text = _try_get(client, key + str(p))
                if text is not None:
                    published[p] = json.loads(text)
        # A process that ended without publishing here (one that published, then found the
        # same disagreement, may have ended too: its facts are compared below).
        for p in range(count):
            ended = _try_get(client, f"{EXIT_KEY}{p}") if p not in published else None
            if ended is not None:
                text = _try_get(client, key + str(p))   # published since the read above?
                if text is None:
                    raise ValueError(f"process {p} of {count} stopped before {what}: {ended}")
                published[p] = json.loads(text)
        if len(published) < count:
            if time.monotonic() > deadline:
                missing = ", ".join(str(p) for p in range(count) if p not in published)
                raise ValueError(f"process(es) {missing} of {count} did not reach {what} within "
                                 f"{timeout:.0f} s (distributed.initialization_timeout): each "
                                 f"process's own output says why it stopped or where it waits")
            time.sleep(POLL_SECONDS)
    differences = []
    for name in facts:
        values = {p: published[p].get(name) for p in range(count)}
        if isinstance(facts[name], dict):
            keys = sorted(set().union(*(v or {} for v in values.values())))
            for k in keys:
                at = {p: (values[p] or {}).get(k, "<absent>") for p in range(count)}
                if len({json.dumps(v, sort_keys=True) for v in at.values()}) > 1:
                    differences.append(_difference(k, at))
        elif len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            differences.append(_difference(name, values))
    if differences:
        raise ValueError(f"the {count} processes of this run disagree at {what}: "
                         f"{'; '.join(differences)}; every process must be started with the same "
                         f"config and --workdir (a folder all of them reach by one real path)")


def announce_exit(reason: str) -> None:
    """Tells the other processes that this one is ending with ``reason`` (its one error or
    stopped line), so that one waiting for it in `agree` stops at once, naming it, instead of
    waiting out the timeout (and this process's exit, which waits for every process at JAX's
    shutdown barrier, ends with theirs). Nothing for one process, or before the runtime joined."""
    from jax._src import distributed as jax_distributed
    client = jax_distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return
    try:
        client.key_value_set(f"{EXIT_KEY}{jax.process_index()}", reason)
    except Exception as e:  # noqa: BLE001  the coordinator may be gone already: the exit goes on
        logging.warning("could not tell the other processes that this one stops: %s", e)


def _try_get(client, key: str) -> str | None:
    """``key``'s value in the store, or None while no process has set it (key_value_try_get
    raises NOT_FOUND for a missing key)."""
    try:
        return client.key_value_try_get(key)
    except Exception as e:  # noqa: BLE001  jaxlib raises its own runtime error for NOT_FOUND
        if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
            return None
        raise


def _difference(name: str, values: dict[int, Any]) -> str:
    shown = ", ".join(f"{json.dumps(v, default=str)} on process {p}" for p, v in values.items())
    return f"{name} is {shown}"
