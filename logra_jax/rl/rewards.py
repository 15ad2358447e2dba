"""Math answer grading: the outcome reward of the RL loop (docs/algorithm.md §7).

    reward(completion, gold) = 1  if normalize(extract(completion)) == normalize(gold)
                               0  otherwise

with ``extract_answer`` and ``normalize_answer`` of data/answers.py.
"""

from __future__ import annotations

from logra_jax.data.answers import after_last_marker, extract_answer, last_boxed, normalize_answer


def math_reward(completion: str, gold: str, *, failure_reward: float = 0.0) -> float:
    """1.0 if the completion's final answer equals ``gold`` after normalisation, else
    ``failure_reward`` (0.0; the KL variant of docs/algorithm.md §7 uses −0.01)."""
    want = normalize_answer(gold)
    if want is None:
        raise ValueError(f"gold answer {gold!r} is empty: nothing to grade against")
    got = normalize_answer(extract_answer(completion))
    return 1.0 if got == want else float(failure_reward)


def format_reward(completion: str) -> float:
    """1.0 if the completion states its final answer explicitly (a non-empty ``\\boxed{}`` or an
    "answer is …" sentence that contains a value), else 0.0. Independent of correctness."""
    boxed = last_boxed(completion or "")
    if boxed is not None and normalize_answer(boxed) is not None:
        return 1.0
    return 1.0 if normalize_answer(after_last_marker(completion or "")) is not None else 0.0
