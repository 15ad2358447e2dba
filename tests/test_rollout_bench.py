"""launch.rollout_bench: the static and slot engines on one schedule, side by side in one process."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "launch.rollout_bench", "--config", "configs/tiny.py",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_bench_prints_each_engine_against_the_static_one_with_the_same_tokens():
    run = _bench("--prompts", "2", "--samples", "2", "--prompt_length", "8",
                 "--completion_length", "24", "--schedule", "lognormal:4", "--slots", "4,2",
                 "--repeats", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    table = {}   # engine → [seconds, row-steps, efficiency, time/static]
    for parts in (line.split() for line in run.stdout.splitlines()):
        if parts and parts[0] == "static":
            table["static"] = parts[1:]
        elif parts and parts[0] == "slots" and parts[1].isdigit():
            table[f"slots {parts[1]}"] = parts[2:]
    assert set(table) == {"static", "slots 4", "slots 2"}, run.stdout
    assert float(table["static"][3]) == 1.0
    # The slot engines never execute more row-steps than the static batch on this schedule.
    assert all(int(row[1]) <= int(table["static"][1]) for row in table.values()), run.stdout
    assert "same tokens from every engine: yes" in run.stdout


def test_a_slot_count_that_splits_a_group_is_one_error_line():
    run = _bench("--samples", "4", "--slots", "6")
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1].startswith("error: --slots [6]"), run.stderr[-2000:]
