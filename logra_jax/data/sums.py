"""Two-number sums generated here, with no dependency: prompts for runs that measure the loop
(speed, memory) on a machine without reasoning-gym or tensorflow-datasets (``data.source="sums"``).

Item i is a pure function of (seed, i): ``random.Random(seed * 1_000_003 + i)`` draws two integers
in [0, 10**digits), so a source needs no storage and reproduces across runs and hosts.
"""

from __future__ import annotations

import random

from logra_jax.data.example import Example


class SumsSource:
    """Random access to ``size`` seeded questions "What is a + b?" with their sums as answers."""

    def __init__(self, size: int, seed: int, digits: int = 2):
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"size must be a positive int, got {size!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.size, self.seed, self.digits = size, seed, digits

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < self.size:
            raise IndexError(f"sums: index {index} out of range [0, {self.size})")
        draw = random.Random(self.seed * 1_000_003 + index)
        a, b = (draw.randrange(10**self.digits) for _ in range(2))
        return Example(question=f"What is {a} + {b}?", answer=str(a + b))

    def __repr__(self) -> str:
        return f"SumsSource(size={self.size}, seed={self.seed}, digits={self.digits})"
