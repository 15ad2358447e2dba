"""What one value of a run's config must be: a `Rule` (a predicate and the words that complete
"<key> must be ..."), the common ones, and the choices the library defines (each checked against
the library's own constant in tests/test_bad_input.py: this package sits below the library and
imports none of it). The keys they apply to are values.py's and each registered entry's
(choices.py)."""

from __future__ import annotations

import math
import re
from typing import Callable


class Rule:
    """``accepts(value)``: whether a run can use the value; ``demand`` completes "<key> must be"."""

    def __init__(self, demand: str, accepts: Callable[[object], bool]):
        self.demand, self.accepts = demand, accepts


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


POSITIVE_INT = Rule("a positive integer", lambda v: _integer(v) and v > 0)
NONNEGATIVE_INT = Rule("an integer ≥ 0", lambda v: _integer(v) and v >= 0)
INTEGER = Rule("an integer", _integer)
POSITIVE = Rule("a finite number > 0", lambda v: _number(v) and math.isfinite(v) and v > 0)
NONNEGATIVE = Rule("a finite number ≥ 0", lambda v: _number(v) and math.isfinite(v) and v >= 0)
FINITE = Rule("a finite number", lambda v: _number(v) and math.isfinite(v))
# Thresholds where inf means "never" (no clipping, no correction): anything but NaN and negatives.
NONNEGATIVE_OR_INF = Rule("a number ≥ 0 (inf: off)", lambda v: _number(v) and v >= 0)
POSITIVE_OR_INF = Rule("a number > 0 (inf: off)", lambda v: _number(v) and v > 0)
DECAY = Rule("in [0, 1)", lambda v: _number(v) and 0 <= v < 1)
FRACTION = Rule("in (0, 1]", lambda v: _number(v) and 0 < v <= 1)
AXIS_SIZE = Rule("a positive integer or -1 (the devices left)", lambda v: _integer(v) and (v > 0 or v == -1))
BOOL = Rule("true or false", lambda v: isinstance(v, bool))
TEXT = Rule("a string", lambda v: isinstance(v, str))
NAME = Rule("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip()))


def _compiles(value) -> bool:
    try:
        re.compile(value)
    except (re.error, TypeError):
        return False
    return isinstance(value, str)


REGEX = Rule("a valid regular expression", _compiles)


def one_of(*choices) -> Rule:
    return Rule(f"one of {', '.join(map(repr, choices))}", lambda v: v in choices)


def optional(rule: Rule) -> Rule:
    """None (the library's default) or what ``rule`` accepts."""
    return Rule(f"None or {rule.demand}", lambda v: v is None or rule.accepts(v))


# Choices the library defines; tests/test_bad_input.py checks each against the library's constant
# (this module sits below the library and imports none of it). Which algorithms and optimizers
# exist is their registries' (choices.py), not a list here.
KL_ESTIMATORS = ("k1", "k2", "k3")                          # rl.losses.KL_ESTIMATORS
LOSS_AGG_MODES = ("token-mean", "sequence-mean")            # rl.losses.LOSS_AGG_MODES
ADVANTAGE_BASELINES = ("mean", "leave_one_out")             # rl.losses.ADVANTAGE_BASELINES
DECODE_WEIGHTS = ("auto", "per_layer", "stacked")           # rl.sampler.Sampler.DECODE_WEIGHTS
ROLLOUT_ENGINES = ("static", "slots")                       # rl.sampler.Sampler.ENGINES
IMPORTANCE_CORRECTIONS = ("tis", "mis")                     # rl.losses.IMPORTANCE_CORRECTIONS
SYNC_MODES = ("off", "full", "factors", "sparse")           # "off" + rl.sync.MODES
SYNC_DTYPES = ("bfloat16", "float32")
MODEL_DTYPES = ("float32", "bfloat16")                      # models.config.DTYPES
DISTRIBUTIONS = ("rademacher", "gaussian", "rademacher_threefry")   # projections.DISTRIBUTIONS
ROUNDINGS = ("nearest", "stochastic")                       # optim.rounding.ROUNDINGS
GALORE_PROJECTORS = ("svd", "randomized")                   # optim.galore.PROJECTORS
DATA_SOURCES = ("task", "gsm8k", "sums")

# Adam's keys, as the dense baselines, LoRA and GaLore read them.
ADAM = {"b1": DECAY, "b2": DECAY, "eps": POSITIVE, "weight_decay": NONNEGATIVE,
        "max_grad_norm": NONNEGATIVE_OR_INF}   # max_grad_norm 0 or inf: no clipping
