"""launch.export: a trained run's checkpoint as a Hugging Face folder that transformers loads."""

import subprocess
import sys

import jax
import numpy as np
import pytest

from logra_jax.export import export_run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(trained_tiny_run, shipped_tiny_parts):
    return trained_tiny_run.workdir, trained_tiny_run, shipped_tiny_parts


def test_an_exported_run_gives_transformers_our_logits(trained, tmp_path):
    workdir, run, parts = trained
    out, step = export_run(workdir, tmp_path / "hf")
    assert step == 2 and {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                          "generation_config.json"} <= {p.name for p in out.iterdir()}
    reference = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = np.random.default_rng(0).integers(0, parts.tokenizer.vocab_size, (2, 12)).astype(np.int32)
    ours = np.asarray(jax.jit(lambda p, t: parts.policy.bind(p)(t))(run.params, tokens))
    initial = np.asarray(jax.jit(lambda p, t: parts.policy.bind(p)(t))(parts.initial_params, tokens))
    assert np.abs(ours - initial).max() > 1e-3     # the export holds the trained weights, not the start
    with torch.no_grad():
        theirs = reference(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)

    with pytest.raises(ValueError, match="no checkpoint of step 1; it has \\[2\\]"):
        export_run(workdir, tmp_path / "other", step=1)
    with pytest.raises(FileExistsError, match="not empty"):
        export_run(workdir, out)


def test_the_command_line(trained, tmp_path):
    workdir = trained[0]
    cmd = [sys.executable, "-m", "launch.export", "--workdir", str(workdir)]
    done = subprocess.run(cmd + ["--out", str(tmp_path / "hf"), "--dtype", "bfloat16"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"exported step 2 of {workdir}" in done.stdout
    assert '"BF16"' in (tmp_path / "hf" / "model.safetensors").read_bytes()[:4096].decode("latin-1")
    bad = subprocess.run(cmd + ["--out", str(tmp_path / "x"), "--step", "7"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith(
        "error: ") and "no checkpoint of step 7" in bad.stderr
    missing = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and missing.stderr.strip() == "error: --out is required"
