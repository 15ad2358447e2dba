"""The math grader: extraction order, numeric normalisation, and all 1,319 real GSM8K test answers."""

import json

import numpy as np
import pytest

from logra_jax.data.answers import extract_answer, normalize_answer
from logra_jax.rl.rewards import format_reward, math_reward
from logra_jax.rl.rollout import Grader, RewardError


@pytest.fixture(scope="module")
def gsm8k_test(gsm8k_dir):
    """(worked solution, final answer text after '####') for every GSM8K test line."""
    items = []
    with open(gsm8k_dir / "test.jsonl", encoding="utf-8") as f:
        for line in f:
            solution = json.loads(line)["answer"]
            items.append((solution, solution.split("####")[-1].strip()))
    return items


def test_all_gsm8k_test_answers_grade_right_and_wrong(gsm8k_test):
    assert len(gsm8k_test) == 1319
    for solution, gold in gsm8k_test:
        value = int(gold.replace(",", ""))
        wrong = value + 1
        # The gold text itself, the reference worked solution, and the usual answer phrasings.
        for right in (gold, solution, f"So the answer is {gold}.", f"Thus \\boxed{{{gold}}}",
                      f"She pays ${value:,}.00 in total.", f"#### {value}"):
            assert math_reward(right, gold) == 1.0, (right, gold)
        for bad in (str(wrong), f"The answer is {wrong}.", f"\\boxed{{{wrong:,}}}",
                    f"{solution}\nActually, the answer is {wrong}."):
            assert math_reward(bad, gold) == 0.0, (bad, gold)


@pytest.mark.parametrize("text, expected", [
    # last \boxed{} wins over every other rule, nested braces included
    ("The answer is 3. Check: \\boxed{\\frac{1}{2}} hmm 7", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    # an unclosed box (cut-off completion) falls back to the previous complete one
    ("\\boxed{12} and \\boxed{13", "12"),
    # an empty box states nothing: the next rules apply
    ("\\boxed{} so the answer is 4. Then 9", "4"),
    # "answer is" / "answer:" / "####": the last marker, up to the end of its sentence
    ("The answer is 5. Wait, the final answer is $6.50. Then 99", "$6.50"),
    ("Answer: 42\nsome 17", "42"),
    ("work <<2*3=6>>6\n#### 6", "6"),
    # otherwise the last number, negative and thousands separators included
    ("First 3 apples, then 1,234 pears", "1,234"),
    ("It drops to \u22124", "-4"),
    ("10 - 4", "4"),
    ("no numbers here", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("1200", "1200"), ("1,200", "1200"), ("$1,200.00", "1200"), ("1200 dollars", "1200"),
    ("\\$1200", "1200"), ("\\text{1200 cm}", "1200"), ("50%", "50"), ("50\\%", "50"),
    ("0.75", "0.75"), ("3/4", "0.75"), ("\\frac{3}{4}", "0.75"), ("\\dfrac{3}{4}", "0.75"),
    (".5", "0.5"), ("-2.50", "-2.5"), ("\u22127", "-7"), ("1/3", "1/3"), ("2/6", "1/3"),
    ("x = 5", "5"), ("2 + 3 = 5", "5"), ("18 dollars a day for 7 days", "18"),
    ("007", "7"), ("12.000", "12"),
    ("Yes", "yes"), ("  Two   Apples. ", "two apples"), ("", None), ("   ", None), (None, None),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_math_reward_equivalent_forms_and_failure_value():
    assert math_reward("so \\boxed{\\frac{3}{4}}", "0.75") == 1.0
    assert math_reward("The answer is 0.750", "3/4") == 1.0
    assert math_reward("The answer is 1/3.", "2/6") == 1.0
    assert math_reward("The answer is 0.33", "1/3") == 0.0
    assert math_reward("I do not know", "5") == 0.0
    assert math_reward("I do not know", "5", failure_reward=-0.01) == -0.01
    assert math_reward("The answer is 5", "5", failure_reward=-0.01) == 1.0


def test_math_reward_rejects_empty_gold():
    with pytest.raises(ValueError, match="gold answer"):
        math_reward("The answer is 5", "  ")


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{5}", 1.0), ("The answer is 5.", 1.0), ("Final answer: 7", 1.0),
    ("It is 5", 0.0), ("\\boxed{}", 0.0), ("The answer is", 0.0), ("", 0.0),
])
def test_format_reward(text, expected):
    assert format_reward(text) == expected


class _Graded(Grader):
    """The built-in grader with one more reward function, ``extra`` (named "mine")."""

    def __init__(self, extra, **kwargs):
        super().__init__(task="data.task=chain_sum", **kwargs)
        object.__setattr__(self, "extra", extra)

    def functions(self):
        return super().functions() + [("mine", 0.5, self.extra)]


TEXTS, GOLDS = ["The answer is 5", "The answer is 4", "no idea"], ["5", "5", "5"]


def test_the_grader_sums_its_functions_weighted():
    graded = _Graded(lambda texts, golds: [2.0] * len(texts), format_reward_weight=0.25)
    np.testing.assert_array_equal(graded(TEXTS, GOLDS), [1.0 + 0.25 + 1.0, 0.25 + 1.0, 1.0])


def test_a_reward_function_that_raises_is_named_with_its_task():
    def broken(texts, golds):
        return [1.0 / (len(t) - len(t)) for t in texts]
    with pytest.raises(RewardError) as caught:
        _Graded(broken)(TEXTS, GOLDS)
    assert str(caught.value) == ("reward function mine on data.task=chain_sum raised "
                                 "ZeroDivisionError: float division by zero")
    assert isinstance(caught.value.__cause__, ZeroDivisionError)   # --verbose shows where
    with pytest.raises(RewardError, match=r"^reward function rewards.math_reward on the prompts "
                                          r"raised ValueError: gold answer '' is empty"):
        Grader()(["The answer is 5"], [""])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_reward_that_is_not_finite_is_refused_by_name(bad):
    with pytest.raises(RewardError) as caught:
        _Graded(lambda texts, golds: [0.0, bad, bad])(TEXTS, GOLDS)
    assert str(caught.value) == (f"reward function mine on data.task=chain_sum returned {bad} for "
                                 f"2 of 3 completions (the first, row 1: 'The answer is 4', "
                                 f"answer '5'); a reward must be a finite number")


@pytest.mark.parametrize("returned, shape", [([1.0, 0.0], (2,)), ([[1.0, 0.0, 1.0]], (1, 3)),
                                             (1.0, ())])
def test_rewards_of_the_wrong_shape_name_both_shapes(returned, shape):
    with pytest.raises(RewardError) as caught:
        _Graded(lambda texts, golds: returned)(TEXTS, GOLDS)
    assert str(caught.value) == (f"reward function mine on data.task=chain_sum returned rewards of "
                                 f"shape {shape} for 3 completions: it must return one number per "
                                 f"completion, shape (3,)")
