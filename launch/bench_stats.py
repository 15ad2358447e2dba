"""What a benchmark table states besides its timings: the CPU it ran on, paired ratios, and
timings taken in alternation."""

import statistics
import time


def cpu_model() -> str:
    """The host CPU's model name (what ``lscpu | grep "Model name"`` prints): benchmark tables say
    which CPU kind their numbers come from, since XLA picks other kernels on AVX2 and AVX-512."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown CPU"


def paired_ratio(times: dict, run: str, baseline: str) -> tuple[float, float, float]:
    """(median, min, max) over rounds i of ``times[run][i] / times[baseline][i]``.

    Benchmarks here alternate the runs they compare, round by round, so the two timings of a round
    ran back to back, and a slow spell of a shared machine scales both. The ratio of two medians
    taken over all rounds mixes spells (a shared machine's speed moves between hours); the median
    of per-round ratios is the paired estimate.
    """
    ratios = [a / b for a, b in zip(times[run], times[baseline], strict=True)]
    if not ratios:
        return (float("nan"),) * 3
    return statistics.median(ratios), min(ratios), max(ratios)


def interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each of ``fns`` (label → call), after one compiling call each, timed in
    alternating order round by round so that background load hits them alike."""
    import jax
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {label: [] for label in fns}
    order = list(fns)
    for i in range(repeats):
        for label in (order if i % 2 == 0 else order[::-1]):
            tic = time.perf_counter()
            jax.block_until_ready(fns[label]())
            times[label].append(time.perf_counter() - tic)
    return {label: statistics.median(t) for label, t in times.items()}
