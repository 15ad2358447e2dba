"""The unit of training data: a question and its gold final answer, plus the source protocol."""

from __future__ import annotations

from typing import Protocol, Sequence, TypedDict


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


class SubsetSource:
    """The examples of ``source`` at ``indices``, in that order (e.g. the prompts that fit the
    prompt window); deterministic, so a resumed iterator sees the same subset."""

    def __init__(self, source: ExampleSource, indices: Sequence[int], why: str):
        self.source = source
        self.indices = [int(i) for i in indices]
        self.why = why

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Example:
        return self.source[self.indices[index]]

    def __repr__(self) -> str:
        return f"{self.source!r}, the {len(self)} {self.why}"
