"""Plots of training runs and memory reports, as PNGs.

    python -m launch.report --out runs/report \
        --run logra=runs/default --run adamw=runs/adamw \
        [--memory qwen2_5_7b=mem7b.json ...]

Writes into ``--out``:
  reward.png        reward per step of every run (and its running mean over --window steps)
  kl.png            predicted vs realized KL(π_old ‖ π_new) per step, for runs that log both
  changed.png       fraction of target entries each update changed (logra/changed_fraction), for
                    runs that log it: with bf16 weights, what rounding lets through
  memory.png        per-device bytes by kind (params, optimizer state, gradients, other
                    temporaries) for each optimizer of each `launch.memory --json` file

and prints the runs' reward table: mean reward over the first and the last quarter of the steps
and over all of them, per run and, for runs labelled "NAME seed S", per NAME across its seeds
(mean ± half the range: with two seeds, each seed's value is one end of it).
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
from absl import flags

from launch import cli
from logra_jax.extras import require
from logra_jax.metrics import read_jsonl
from logra_jax.perf.machines import GIB

_OUT = flags.DEFINE_string("out", None, "Folder for the PNGs.")
_RUNS = flags.DEFINE_multi_string("run", [], "label=workdir of a training run (metrics.jsonl).")
_MEMORY = flags.DEFINE_multi_string("memory", [], "label=file written by launch.memory --json.")
_WINDOW = flags.DEFINE_integer("window", 4, "Steps in the running mean of the reward.")



def pyplot():
    """matplotlib's pyplot, drawing to files only (no display); matplotlib comes with the rl extra."""
    require("matplotlib", "matplotlib", "launch.report").use("Agg")
    return require("matplotlib.pyplot", "matplotlib", "launch.report")


def load_run(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (is {workdir} a launch.train workdir?)")
    rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"{path} holds no steps")
    return rows


def running_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each step (fewer at the start)."""
    csum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def plot_rewards(runs: dict[str, list[dict]], window: int, path: pathlib.Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in runs.items():
        steps = np.array([r["step"] for r in rows])
        reward = np.array([r["reward"] for r in rows], float)
        line, = ax.plot(steps, reward, alpha=0.35, lw=1)
        ax.plot(steps, running_mean(reward, window), color=line.get_color(), lw=2,
                label=f"{label} ({window}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward (fraction correct)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def quarter_means(rewards: np.ndarray) -> tuple[float, float, float]:
    """(first 25 %, last 25 %, all) mean of a run's per-step rewards; a quarter is ≥ 1 step."""
    n = max(1, len(rewards) // 4)
    return float(np.mean(rewards[:n])), float(np.mean(rewards[-n:])), float(np.mean(rewards))


def seed_groups(labels) -> dict[str, list[str]]:
    """{NAME: [labels]} for labels "NAME seed S" (in order); other labels are their own group."""
    groups: dict[str, list[str]] = {}
    for label in labels:
        name, sep, seed = label.rpartition(" seed ")
        groups.setdefault(name if sep and seed.strip().isdigit() else label, []).append(label)
    return groups


def reward_table(runs: dict[str, list[dict]]) -> str:
    """The reward table printed by main (module docstring)."""
    per_run = {label: quarter_means(np.array([r["reward"] for r in rows], float))
               for label, rows in runs.items()}
    width = max(len(label) for label in runs) + 2
    lines = [f"{'reward':<{width}}{'steps':>6}{'first 25 %':>16}{'last 25 %':>16}{'all steps':>16}"]
    for label, means in per_run.items():
        lines.append(f"{label:<{width}}{len(runs[label]):>6}" + "".join(f"{m:>16.3f}" for m in means))
    groups = {name: members for name, members in seed_groups(runs).items() if len(members) > 1}
    if groups:
        lines.append(f"{'across seeds':<{width}}{'seeds':>6}   (mean ± half the range)")
        for name, members in groups.items():
            values = np.array([per_run[m] for m in members])           # [seeds, 3]
            mean, half = values.mean(0), (values.max(0) - values.min(0)) / 2
            lines.append(f"{name:<{width}}{len(members):>6}"
                         + "".join(f"{f'{m:.3f} ± {h:.3f}':>16}" for m, h in zip(mean, half)))
    return "\n".join(lines)


def _save_per_step_log_plot(fig, ax, ylabel: str, path: pathlib.Path) -> None:
    """Per-step axes on a symlog scale (values span decades, zero included), saved and closed."""
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def plot_kl(runs: dict[str, list[dict]], path: pathlib.Path) -> bool:
    """Predicted vs realized KL; False (no file) when no run logs both."""
    with_kl = {label: rows for label, rows in runs.items()
               if all("logra/predicted_kl" in r and "logra/realized_kl" in r for r in rows)}
    if not with_kl:
        return False
    fig, ax = pyplot().subplots(figsize=(7, 4))
    for label, rows in with_kl.items():
        steps = [r["step"] for r in rows]
        line, = ax.plot(steps, [r["logra/predicted_kl"] for r in rows], "o-", ms=3,
                        label=f"{label}: predicted (α²·candidate)")
        ax.plot(steps, [r["logra/realized_kl"] for r in rows], "s--", ms=3, color=line.get_color(),
                alpha=0.7, label=f"{label}: realized on the probe")
        if "logra/effective_budget" in rows[0]:
            ax.plot(steps, [r["logra/effective_budget"] for r in rows], ":", color="gray",
                    label=f"{label}: budget")
    _save_per_step_log_plot(fig, ax, "KL(π_old ‖ π_new) per token", path)
    return True


def plot_changed(runs: dict[str, list[dict]], path: pathlib.Path) -> bool:
    """Changed fraction of target entries per update, log scale; False when no run logs it."""
    logged = {label: rows for label, rows in runs.items()
              if all("logra/changed_fraction" in r for r in rows)}
    if not logged:
        return False
    fig, ax = pyplot().subplots(figsize=(7, 4))
    for label, rows in logged.items():
        ax.plot([r["step"] for r in rows], [r["logra/changed_fraction"] for r in rows], "o-", ms=3,
                label=label)
    _save_per_step_log_plot(fig, ax, "target entries changed by the update", path)
    return True


MEMORY_PARTS = (("params", "params"), ("opt_state", "optimizer state"),
                ("gradients", "gradients / sketches"), ("other", "other temporaries"))


def memory_bars(reports: dict[str, dict]) -> list[tuple[str, dict[str, float]]]:
    """(label, {part: GiB}) per optimizer of each report; parts add up to XLA's peak."""
    bars = []
    for label, report in reports.items():
        for step in report["steps"]:
            parts = {"params": step["params"], "opt_state": step["opt_state"],
                     "gradients": step["gradients"]}
            parts["other"] = step["peak"] - sum(parts.values())
            bars.append((f"{label}\n{step['optimizer']}", {k: v / GIB for k, v in parts.items()}))
    return bars


def plot_memory(reports: dict[str, dict], path: pathlib.Path) -> None:
    plt = pyplot()
    bars = memory_bars(reports)
    fig, ax = plt.subplots(figsize=(1.4 * len(bars) + 2, 4))
    bottom = np.zeros(len(bars))
    for key, name in MEMORY_PARTS:
        values = np.array([parts[key] for _, parts in bars])
        ax.bar(range(len(bars)), values, bottom=bottom, label=name)
        bottom += values
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel("GiB per training device (update peak)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv) -> None:
    del argv
    from launch import process
    process.setup(None)   # plots from files: no jax
    out = pathlib.Path(_OUT.value)
    try:
        run_dirs = cli.parse_labelled(_RUNS.value, "run")
        runs = {label: load_run(path) for label, path in run_dirs.items()}
        memory_files = cli.parse_labelled(_MEMORY.value, "memory")
        missing = [str(p) for p in memory_files.values() if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"memory report(s) not found: {', '.join(missing)}")
        reports = {label: json.loads(path.read_text()) for label, path in memory_files.items()}
        if not runs and not reports:
            raise ValueError("nothing to plot: give at least one --run or --memory")
        pyplot()   # before any file is written
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if runs:
        print(reward_table(runs))
        plot_rewards(runs, _WINDOW.value, out / "reward.png")
        written.append("reward.png")
        if plot_kl(runs, out / "kl.png"):
            written.append("kl.png")
        if plot_changed(runs, out / "changed.png"):
            written.append("changed.png")
    if reports:
        plot_memory(reports, out / "memory.png")
        written.append("memory.png")
    print(f"wrote {', '.join(written)} to {out}")


if __name__ == "__main__":
    cli.run(main, required=("out",))
