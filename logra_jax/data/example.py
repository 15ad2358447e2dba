"""The unit of training data: a question and its gold final answer, plus the source protocol."""

from __future__ import annotations

from typing import Protocol, TypedDict


class Example(TypedDict):
    """One prompt for the RL loop.

    ``answer`` is the gold FINAL answer already passed through
    ``logra_jax.rl.rewards.normalize_answer`` (e.g. "1200", not "1,200" or a worked solution).
    """

    question: str
    answer: str


class ExampleSource(Protocol):
    """Random access to Examples: what ``PromptIterator`` draws from."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Example: ...
