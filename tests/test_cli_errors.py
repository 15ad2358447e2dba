"""Errors found once the loop runs reach the user as one `error:` line and exit status 1."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_prompt_longer_than_its_window_is_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "launch.train", "--workdir", str(tmp_path), "--config",
         "configs/tiny.py", "--config.rl.max_prompt_length=8", "--config.log.progress=False",
         "--config.log.tensorboard=False"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "exceed max_prompt_length=8" in last, last
    assert "Traceback" not in done.stderr
