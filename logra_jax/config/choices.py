"""The RL algorithms and optimizers a run can name (``rl.algorithm``, ``optimizer.name``): one
`Registry` each, the only list of them, holding one jax-free record per entry (`Choice`).

A record is what the config's checks need of an entry: its name, its own keys with their rules
(an algorithm's under ``rl.``, an optimizer's in its section ``optimizer.<name>.``) and its rules
that span keys (`check`). `values.validate` reads the records, so a config is checked in a moment,
before jax is imported. The entry itself — an algorithm's loss and advantages, an optimizer's
optax transformation (logra_jax/rl/algorithms, logra_jax/rl/optimizers) — is a subclass of its
record, loaded only when a run asks for it (`Registry.get`): a built-in record names the module
that holds it (`implementation`); an entry registered from outside the package is its own record.

    record        keys                                            implementation
    grpo          rl.epsilon, epsilon_high, beta, kl_estimator,   rl/algorithms/grpo.py
                  scale_rewards, advantage_baseline
    reinforce     rl.failure_reward, baseline_momentum, is_cap    rl/algorithms/reinforce.py
    logra         optimizer.logra.*                               rl/optimizers/logra.py
    adamw, adafactor, galore   optimizer.<name>.*                 rl/optimizers/dense.py
    lora          optimizer.lora.*                                rl/optimizers/lora.py
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Iterable, Mapping

import ml_collections

from logra_jax.config.derived import replays_merge
from logra_jax.config.rules import (ADAM, ADVANTAGE_BASELINES, BOOL, DECAY, DISTRIBUTIONS, FINITE,
                                    FRACTION, GALORE_PROJECTORS, KL_ESTIMATORS, NONNEGATIVE,
                                    NONNEGATIVE_INT, NONNEGATIVE_OR_INF, POSITIVE, POSITIVE_INT,
                                    POSITIVE_OR_INF, REGEX, ROUNDINGS, Rule, _number, one_of,
                                    optional)


def _no_rule(config: ml_collections.ConfigDict) -> None:
    del config


@dataclasses.dataclass(frozen=True)
class Choice:
    """One entry of a registry as the config's checks see it.

    name: the value of the registry's key (``rl.algorithm=grpo``).
    rules: its own keys, by their name within its section, each with its `Rule`; they exist in
      the config's schema while the entry is registered, and only this entry reads them (an
      algorithm's set under another algorithm are named by `values.ignored_options`).
    check: its rules that span keys (the whole config), one ValueError each; run by
      `values.validate` when the entry is the one chosen.
    implementation: "module:attribute" of the entry a built-in record stands for, imported at
      first use (`Registry.get`); None for an entry that is its own record.
    """

    name: str
    rules: Mapping[str, Rule] = dataclasses.field(default_factory=dict)
    check: Callable[[ml_collections.ConfigDict], None] = _no_rule
    implementation: str | None = None

    def fields(self) -> dict:
        """Its fields by name, what an entry's class takes to implement this record; the entry is
        its own implementation (None)."""
        return dict({f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                    implementation=None)


@dataclasses.dataclass(frozen=True)
class OptimizerChoice(Choice):
    """An optimizer's record. low_rank_factors: its update is low-rank factors U·A that a
    ``sync.mode='factors'`` can send instead of the weights (LoGRA's)."""

    low_rank_factors: bool = False


class Registry:
    """The entries one config key chooses between (``rl.algorithm``, ``optimizer.name``), by name.

    ``what``: how an error names an entry ("an RL algorithm"); ``section``: an entry's name → the
    prefix of its own keys (``rl.``, ``optimizer.<name>.``).
    """

    def __init__(self, choice_key: str, what: str, section: Callable[[str], str],
                 records: Iterable[Choice]):
        self.choice_key, self.what, self._section = choice_key, what, section
        self._records: dict[str, Choice] = {r.name: r for r in records}
        self._built_in = frozenset(self._records)
        self._loaded: dict[str, Choice] = {}

    def names(self) -> tuple[str, ...]:
        return tuple(self._records)

    def choice(self, name: str) -> Choice:
        """The record ``name``; ValueError listing the known ones."""
        if name not in self._records:
            raise ValueError(f"{self.choice_key} must be one of "
                             f"{', '.join(map(repr, self._records))}, got {name!r}")
        return self._records[name]

    def get(self, name: str):
        """The entry ``name`` stands for (its loss, its transformation), imported at first use."""
        record = self.choice(name)
        if name not in self._loaded:
            if record.implementation is None:
                self._loaded[name] = record
            else:
                module, _, attribute = record.implementation.partition(":")
                entry = getattr(importlib.import_module(module), attribute)
                if entry.name != name:
                    raise ValueError(f"{record.implementation} is {self.what} named "
                                     f"{entry.name!r}, not {name!r}")
                self._loaded[name] = entry
        return self._loaded[name]

    def register(self, entry: Choice) -> Choice:
        """Adds ``entry``: ``<choice key>=<its name>`` then chooses it, and its own keys are checked
        by their rules with the rest of the config. ``entry`` is the entry itself (an `Algorithm`,
        an `OptimizerEntry`), or its record alone naming its ``implementation``: jax-free, that
        is what a command's wrapper registers before the command starts jax. A name already taken
        is an error (`unregister` it first)."""
        if entry.name in self._records:
            raise ValueError(f"{self.what} named {entry.name!r} is already registered")
        self._records[entry.name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Removes an entry `register` added (the built-in ones stay), and with it its keys."""
        if name in self._built_in or name not in self._records:
            raise ValueError(f"{name!r} was not registered from outside the package")
        del self._records[name]
        self._loaded.pop(name, None)

    def keys_of(self, name: str) -> list[str]:
        """The dotted keys entry ``name`` adds to the config."""
        return [f"{self._section(name)}{key}" for key in self._records[name].rules]

    def value_rules(self) -> dict[str, Rule]:
        """{dotted key: Rule}: the choice key's (one of the names) and every entry's own keys'."""
        rules = {self.choice_key: one_of(*self._records)}
        for name, record in self._records.items():
            rules.update({f"{self._section(name)}{key}": rule for key, rule in record.rules.items()})
        return rules


# ---------------------------------------------------------------------------------------------
# The built-in algorithms (logra_jax/rl/algorithms/)
# ---------------------------------------------------------------------------------------------
def _grpo_groups(config: ml_collections.ConfigDict) -> None:
    if config.rl.num_generations < 2:
        raise ValueError(f"rl.num_generations={config.rl.num_generations}: GRPO compares "
                         "completions within a group, so it needs at least 2 per prompt")


GRPO = Choice(
    "grpo", check=_grpo_groups, implementation="logra_jax.rl.algorithms.grpo:GRPO",
    rules={"epsilon": POSITIVE, "epsilon_high": NONNEGATIVE, "beta": NONNEGATIVE,
           "kl_estimator": one_of(*KL_ESTIMATORS), "scale_rewards": BOOL,
           "advantage_baseline": one_of(*ADVANTAGE_BASELINES)})
REINFORCE = Choice(
    "reinforce", implementation="logra_jax.rl.algorithms.reinforce:REINFORCE",
    rules={"failure_reward": FINITE, "baseline_momentum": DECAY, "is_cap": POSITIVE_OR_INF})

ALGORITHMS = Registry("rl.algorithm", "an RL algorithm", lambda name: "rl.", (GRPO, REINFORCE))


# ---------------------------------------------------------------------------------------------
# The built-in optimizers (logra_jax/rl/optimizers/)
# ---------------------------------------------------------------------------------------------
def _logra_merge_replayed(config: ml_collections.ConfigDict) -> None:
    if replays_merge(config) and config.optimizer.logra.exact_merge is False:
        raise ValueError("sync.mode='factors' on rollout devices replays the trainer's merges, "
                         "which needs optimizer.logra.exact_merge=True (or None: automatic)")


LOGRA = OptimizerChoice(
    "logra", low_rank_factors=True, check=_logra_merge_replayed,
    implementation="logra_jax.rl.optimizers.logra:LOGRA",
    rules={
        "variant": Rule("one of 'learning_rate', 'kl' ('grpo' is now 'learning_rate': the variant "
                        "is named by its step, rl.algorithm by its objective)",
                        lambda v: v in ("learning_rate", "kl")),
        "learning_rate": NONNEGATIVE, "weight_decay": NONNEGATIVE,
        "max_grad_norm": optional(NONNEGATIVE_OR_INF), "targets": REGEX, "rank": POSITIVE_INT,
        "b2": DECAY, "eps": POSITIVE, "seed": NONNEGATIVE_INT, "refresh": BOOL,
        "distribution": one_of(*DISTRIBUTIONS), "others": optional(one_of("adamw", "frozen")),
        "others_learning_rate": NONNEGATIVE, "others_weight_decay": NONNEGATIVE,
        "others_warmup_steps": NONNEGATIVE_INT, "kl_control": optional(BOOL),
        "kl_budget": POSITIVE, "kl_budget_final": POSITIVE, "kl_budget_horizon": POSITIVE_INT,
        "alpha_max": POSITIVE,
        "mismatch_weight": Rule("in [0, 1]", lambda v: _number(v) and 0 <= v <= 1),
        "kl_safeguard": POSITIVE_OR_INF,
        "kl_correction": NONNEGATIVE_OR_INF,   # inf and 0: the reference's controller
        "update_ratio": POSITIVE, "factor_dtype": optional(one_of("float32", "bfloat16")),
        "merge_rounding": one_of(*ROUNDINGS), "exact_merge": optional(BOOL)})
ADAMW = OptimizerChoice("adamw", implementation="logra_jax.rl.optimizers.dense:ADAMW",
                        rules=dict(ADAM, learning_rate=NONNEGATIVE))
ADAFACTOR = OptimizerChoice(
    "adafactor", implementation="logra_jax.rl.optimizers.dense:ADAFACTOR",
    rules={"learning_rate": NONNEGATIVE, "decay_rate": FRACTION,
           "min_dim_size_to_factor": POSITIVE_INT, "clipping_threshold": optional(POSITIVE_OR_INF),
           "multiply_by_parameter_scale": BOOL, "momentum": optional(DECAY),
           "weight_decay_rate": optional(NONNEGATIVE), "max_grad_norm": NONNEGATIVE_OR_INF})
GALORE = OptimizerChoice(
    "galore", implementation="logra_jax.rl.optimizers.dense:GALORE",
    rules=dict(ADAM, learning_rate=NONNEGATIVE, rank=POSITIVE_INT, update_proj_gap=POSITIVE_INT,
               scale=POSITIVE, targets=REGEX, projector=one_of(*GALORE_PROJECTORS)))
LORA = OptimizerChoice(
    "lora", implementation="logra_jax.rl.optimizers.lora:LORA",
    rules=dict(ADAM, learning_rate=NONNEGATIVE, rank=POSITIVE_INT, alpha=POSITIVE, targets=REGEX,
               init_seed=NONNEGATIVE_INT))

OPTIMIZERS = Registry("optimizer.name", "an optimizer", lambda name: f"optimizer.{name}.",
                      (LOGRA, ADAMW, ADAFACTOR, GALORE, LORA))
