"""launch.report: reward / KL / memory PNGs from run workdirs and launch.memory JSON files."""

import json
import subprocess
import sys

import numpy as np
import pytest

from launch import report
from logra_jax.metrics import MetricsWriter


def test_running_mean_matches_a_direct_window():
    values = np.array([0.0, 1.0, 0.5, 0.25, 1.0, 0.0])
    expected = [np.mean(values[max(0, i - 2):i + 1]) for i in range(len(values))]
    np.testing.assert_allclose(report.running_mean(values, 3), expected)


def test_reward_table_takes_quarters_and_groups_seeds():
    rows = lambda values: [{"reward": v} for v in values]   # noqa: E731
    runs = {"LoGRA seed 0": rows([0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.2, 0.6]),
            "LoGRA seed 1": rows([0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.4, 0.4]),
            "AdamW": rows([0.5, 0.5, 0.5])}
    assert report.quarter_means(np.array([0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.2, 0.6])) == \
        pytest.approx((0.1, 0.4, 0.475))
    assert report.quarter_means(np.array([0.5, 0.25])) == pytest.approx((0.5, 0.25, 0.375))
    assert report.seed_groups(runs) == {"LoGRA": ["LoGRA seed 0", "LoGRA seed 1"],
                                        "AdamW": ["AdamW"]}
    table = report.reward_table(runs).splitlines()
    assert table[1].split()[-4:] == ["8", "0.100", "0.400", "0.475"]
    # seed 1: first 0.2, last 0.4, all 0.25 → across seeds (0.15 ± 0.05, 0.40 ± 0, 0.3625 ± 0.1125)
    name, seeds, *cells = table[-1].replace("±", " ").split()
    assert (name, seeds) == ("LoGRA", "2")
    assert [float(c) for c in cells] == pytest.approx([0.15, 0.05, 0.4, 0.0, 0.3625, 0.1125],
                                                      abs=6e-4)


def _memory_report(path):
    gib = 2 ** 30
    steps = [dict(optimizer="logra", params=7 * gib, opt_state=2 * gib, gradients=1 * gib, peak=16 * gib),
             dict(optimizer="adamw", params=7 * gib, opt_state=14 * gib, gradients=7 * gib, peak=35 * gib)]
    path.write_text(json.dumps({"steps": steps}))
    return steps


def test_memory_bars_add_up_to_the_peak(tmp_path):
    steps = _memory_report(tmp_path / "m.json")
    bars = report.memory_bars({"7b": json.loads((tmp_path / "m.json").read_text())})
    assert [label for label, _ in bars] == ["7b\nlogra", "7b\nadamw"]
    for (_, parts), step in zip(bars, steps):
        assert sum(parts.values()) == pytest.approx(step["peak"] / 2 ** 30)
        assert parts["other"] == pytest.approx((step["peak"] - step["params"] - step["opt_state"]
                                                - step["gradients"]) / 2 ** 30)


def _run(*args):
    return subprocess.run([sys.executable, "-m", "launch.report", *args], capture_output=True,
                          text=True)


def test_cli_writes_the_pngs_and_rejects_bad_input(tmp_path):
    for label, with_kl in (("logra", True), ("adamw", False)):
        writer = MetricsWriter(tmp_path / label, total_steps=3, tensorboard=False, progress=False)
        for step in (1, 2, 3):
            row = {"reward": step / 4}
            if with_kl:
                row.update({"logra/predicted_kl": 0.01, "logra/realized_kl": 0.011 * step,
                            "logra/effective_budget": 0.01, "logra/changed_fraction": 0.02})
            writer.write(step, row)
        writer.close()
    _memory_report(tmp_path / "m.json")
    out = tmp_path / "report"
    done = _run(f"--out={out}", f"--run=logra={tmp_path / 'logra'}",
                f"--run=adamw={tmp_path / 'adamw'}", f"--memory=7b={tmp_path / 'm.json'}")
    assert done.returncode == 0, done.stderr
    for name in ("reward.png", "kl.png", "changed.png", "memory.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    bad = _run(f"--out={out}", "--run=nolabel")
    assert bad.returncode != 0 and "expects label=path" in bad.stderr
    missing = _run(f"--out={out}", f"--memory=x={tmp_path / 'none.json'}")
    assert missing.returncode != 0 and "none.json" in missing.stderr
