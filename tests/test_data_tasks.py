"""reasoning-gym task sources: reproducible, knobs respected, answers checked independently."""

import ast
import operator
import re

import pytest

from logra_jax.data import make_task_source
from logra_jax.data.tasks import TASKS, task_knobs
from logra_jax.data.answers import normalize_answer

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.USub: operator.neg}


def evaluate(expression: str) -> int:
    """Evaluate an integer +/− expression without eval()."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp):
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"unexpected syntax in {expression!r}")
    return walk(ast.parse(expression, mode="eval"))


def test_single_digit_chain_sums_are_right_and_respect_knobs():
    source = make_task_source("chain_sum", size=200, seed=3, min_terms=2, max_terms=2,
                              min_digits=1, max_digits=1)
    assert len(source) == 200
    for i in range(len(source)):
        example = source[i]
        expression = re.search(r":\s*(.*?)\s*=\s*$", example["question"]).group(1)
        operands = re.findall(r"\d+", expression)
        assert len(operands) == 2 and all(len(x) == 1 for x in operands), expression
        assert example["answer"] == str(evaluate(expression))


def test_pure_sums_from_basic_arithmetic():
    source = make_task_source("basic_arithmetic", size=50, seed=0, min_terms=2, max_terms=3,
                              max_digits=1, operators=["+"], allow_parentheses=False,
                              allow_negation=False)
    for i in range(len(source)):
        example = source[i]
        expression = re.fullmatch(r"Calculate (.*)\.", example["question"]).group(1)
        assert set(re.sub(r"[\d\s]", "", expression)) <= {"+"}, expression
        assert example["answer"] == str(evaluate(expression))


@pytest.mark.parametrize("name", TASKS)
def test_fixed_seed_reproduces_and_other_seed_differs(name):
    first = make_task_source(name, size=20, seed=7)
    again = make_task_source(name, size=20, seed=7)
    other = make_task_source(name, size=20, seed=8)
    items = [first[i] for i in range(20)]
    assert items == [again[i] for i in range(20)]
    assert items != [other[i] for i in range(20)]
    for example in items:
        assert example["question"].strip()
        assert example["answer"] == normalize_answer(example["answer"])  # already normalised
        assert re.fullmatch(r"-?\d+(\.\d+)?", example["answer"]), example


def test_knobs_are_listed_with_defaults():
    knobs = task_knobs("chain_sum")
    assert {"min_terms", "max_terms", "min_digits", "max_digits", "allow_negation"} <= set(knobs)
    assert "seed" not in knobs and "size" not in knobs


@pytest.mark.parametrize("name, kwargs, match", [
    ("chess", dict(size=5, seed=0), "unknown task 'chess'"),
    ("chain_sum", dict(size=5, seed=0, max_term=3), r"no knob\(s\) \['max_term'\]"),
    ("chain_sum", dict(size=5, seed=0, min_terms=4, max_terms=2), "invalid knobs"),
    ("chain_sum", dict(size=0, seed=0), "size"),
    ("chain_sum", dict(size=5, seed=None), "seed"),
])
def test_bad_task_configuration_is_reported(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_task_source(name, **kwargs)


def test_index_out_of_range():
    source = make_task_source("chain_sum", size=3, seed=0)
    with pytest.raises(IndexError):
        source[3]
