"""One real update's peak device memory beside XLA's plan of it (``launch.step_time --peak_memory``).

For an accelerator, one optimizer per process (a device's high-water mark cannot be reset): the
update of a config's model shape with random weights is compiled; when XLA's plan needs more than
the device may hold (its allocator's ``bytes_limit``, or a budget given) it is not run and the
result says ``does not fit: needs X GiB``, X being XLA's figure; so does a RESOURCE_EXHAUSTED from
XLA itself, with the figure its message or log states. Otherwise it runs once and the device's
``peak_bytes_in_use`` is read.
"""

import contextlib
import sys
import time

from launch.process import captured_stderr
from launch.update_bench import random_update
from logra_jax.perf.machines import GIB



def device_limit(device, budget_gib: float | None) -> tuple[int | None, str]:
    """(bytes one device may hold, where that figure comes from): ``budget_gib`` when given, else
    the allocator's ``bytes_limit`` (on a GPU: XLA_PYTHON_CLIENT_MEM_FRACTION of its memory); a
    CPU reports none."""
    if budget_gib is not None:
        return int(budget_gib * GIB), f"--memory_budget_gib {budget_gib:g}"
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return (int(limit), "the device's bytes_limit") if limit else (None, "none (this device reports no limit)")


@contextlib.contextmanager
def _stderr_copied(into: list):
    """Runs the block with XLA's C++ log lines (file descriptor 2) captured, then writes them to
    stderr and appends them to ``into``: XLA states what a program needs ("only reduced to
    167.29GiB") in a log line, not in the exception."""
    log = None
    try:
        with captured_stderr() as log:
            yield
    finally:
        if log is not None:
            sys.stderr.write(log.text)
            into.append(log.text)


def _does_not_fit(result: dict, needs: int, why: str) -> dict:
    return dict(result, fits=False, needs_bytes=needs, why=why,
                message=f"does not fit: needs {needs / GIB:.2f} GiB ({why})")


def peak_memory(config, optimizer: str, budget_gib: float | None = None) -> dict:
    """One real update of ``config``'s model: device peak bytes vs XLA's prediction (per device).

    The update is compiled first; when XLA's plan of it needs more than the device may hold
    (`device_limit`) it is not run, and the result says ``does not fit: needs X GiB`` with XLA's
    figure — as it does when XLA itself refuses (RESOURCE_EXHAUSTED, anywhere from building the
    weights to running the update): then the figure is the one XLA states in its message or log."""
    import jax
    from logra_jax import model_shapes
    from logra_jax.perf import oom
    from logra_jax.rl.build import build_mesh

    config.optimizer.name = optimizer
    mesh = build_mesh(dict(config.mesh), jax.devices(), spare_devices=True)
    limit, limit_source = device_limit(mesh.devices.flat[0], budget_gib)
    result = {"optimizer": optimizer, "model": config.model.source, "devices": mesh.size,
              "backend": jax.default_backend(), "device_kind": mesh.devices.flat[0].device_kind,
              "limit_bytes": limit, "limit_source": limit_source}
    logs: list[str] = []
    try:
        model_config = model_shapes.model_config_from(config.model)
        update, params, opt_state, batch = random_update(config, model_config, mesh)
        result["params"] = sum(x.size for x in jax.tree.leaves(params))
        tic = time.perf_counter()
        with _stderr_copied(logs):
            compiled = update.jitted(params, opt_state).lower(params, opt_state, batch).compile()
        result["compile_seconds"] = time.perf_counter() - tic
        predicted = oom.planned_peak(compiled.memory_analysis())
        result["predicted_peak"] = predicted
        if limit is not None and predicted > limit:
            stated = oom.xla_needs("".join(logs))
            why = (f"XLA:{jax.default_backend().upper()}'s plan of the update, "
                   f"{jax.devices()[0].device_kind}; the limit is {limit / GIB:.2f} GiB, "
                   f"{limit_source}")
            if stated:
                why += f"; XLA's log: {stated[1]}"
            return _does_not_fit(result, predicted, why)
        tic = time.perf_counter()   # the program just compiled (a second compile of 7B: minutes)
        params, opt_state, metrics = compiled(params, opt_state, batch)
        jax.block_until_ready((params, opt_state, metrics))
        result["first_update_seconds"] = time.perf_counter() - tic
    except Exception as e:   # XLA's refusal is a result; anything else is not
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        stated = oom.xla_needs("".join(logs) + "\n" + str(e))
        first = str(e).strip().splitlines()[0]
        if stated is None:
            return dict(result, fits=False, needs_bytes=None, why=first,
                        message=f"does not fit: XLA refused it without a figure ({first})")
        return _does_not_fit(result, stated[0], f"XLA refused it: {stated[1]}")
    stats = [d.memory_stats() or {} for d in mesh.devices.flat]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    # A CPU keeps no allocator statistics: no measured peak there, only XLA's prediction.
    return dict(result, fits=True, peak_bytes_in_use=max(peaks) if peaks else None)
