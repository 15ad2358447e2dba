"""Every value of a run's config checked before anything is built: one rule per key of
configs/base.py (`VALUE_RULES`, also the schema of which keys exist), the rules that span keys
(`validate`), and the options the chosen algorithm ignores (`ignored_options`).

Needs nothing but the config: no jax, no files, so a bad value is refused in a moment, before the
workdir is touched. A value no run can use is one sentence naming the key as the user types it
(``rl.micro_batch_size``).
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Callable

import ml_collections

from logra_jax.config.keys import flatten, get

# ---------------------------------------------------------------------------------------------
# One rule per key: a predicate and what it demands, phrased to follow "<key> must be ...".

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
# (this module sits below the library and imports none of it).
ALGORITHMS = ("grpo", "reinforce")
KL_ESTIMATORS = ("k1", "k2", "k3")                          # rl.losses.KL_ESTIMATORS
LOSS_AGG_MODES = ("token-mean", "sequence-mean")            # rl.losses.LOSS_AGG_MODES
ADVANTAGE_BASELINES = ("mean", "leave_one_out")             # rl.losses.ADVANTAGE_BASELINES
DECODE_WEIGHTS = ("auto", "per_layer", "stacked")           # rl.sampler.Sampler.DECODE_WEIGHTS
OPTIMIZERS = ("logra", "adamw", "adafactor", "galore", "lora")   # rl.optimizers.names()
SYNC_MODES = ("off", "full", "factors", "sparse")           # "off" + rl.sync.MODES
SYNC_DTYPES = ("bfloat16", "float32")
MODEL_DTYPES = ("float32", "bfloat16")                      # models.config.DTYPES
DISTRIBUTIONS = ("rademacher", "gaussian", "rademacher_threefry")   # projections.DISTRIBUTIONS
ROUNDINGS = ("nearest", "stochastic")                       # optim.rounding.ROUNDINGS
GALORE_PROJECTORS = ("svd", "randomized")                   # optim.galore.PROJECTORS
DATA_SOURCES = ("task", "gsm8k", "sums")

_ADAM = {"b1": DECAY, "b2": DECAY, "eps": POSITIVE, "weight_decay": NONNEGATIVE,
         "max_grad_norm": NONNEGATIVE_OR_INF}   # max_grad_norm 0 or inf: no clipping

# Every key of configs/base.py that holds a value, and only those (tests/test_bad_input.py checks
# both): the schema a config file's keys are checked against (`unknown_keys`). Rules that span keys
# (a group of ≥ 2 for GRPO, batch splits) are `validate`'s.
VALUE_RULES: dict[str, Rule] = {
    # Seeds ≥ 0: numpy's generators (the data order) refuse negative ones.
    "seed": NONNEGATIVE_INT, "max_steps": POSITIVE_INT,
    "model.source": NAME, "model.dtype": one_of(*MODEL_DTYPES),
    "model.param_dtype": one_of(*MODEL_DTYPES), "model.remat": BOOL, "model.init_seed": NONNEGATIVE_INT,
    **{f"model.tiny.{k}": POSITIVE_INT for k in ("hidden_size", "num_layers", "num_heads",
                                                  "num_kv_heads", "head_dim", "intermediate_size",
                                                  "max_position_embeddings")},
    "model.tiny.rope_theta": POSITIVE, "model.tiny.rms_norm_eps": POSITIVE,
    "model.tiny.qkv_bias": BOOL, "model.tiny.tie_embeddings": BOOL,
    "mesh.fsdp": AXIS_SIZE, "mesh.tensor": AXIS_SIZE,
    "data.source": one_of(*DATA_SOURCES), "data.task": NAME, "data.task_seed": NONNEGATIVE_INT,
    "data.size": POSITIVE_INT, "data.gsm8k_dir": TEXT, "data.gsm8k_cache_dir": TEXT,
    "data.split": NAME, "data.system_prompt": TEXT, "data.instruction": TEXT,
    "data.prompts_per_step": POSITIVE_INT, "data.shuffle": BOOL, "data.skip_long_prompts": BOOL,
    "rl.algorithm": one_of(*ALGORITHMS), "rl.num_generations": POSITIVE_INT,
    "rl.temperature": POSITIVE, "rl.top_p": FRACTION, "rl.top_k": NONNEGATIVE_INT,
    "rl.max_prompt_length": POSITIVE_INT, "rl.max_completion_length": POSITIVE_INT,
    "rl.beta": NONNEGATIVE, "rl.kl_estimator": one_of(*KL_ESTIMATORS),
    "rl.epsilon": POSITIVE, "rl.epsilon_high": NONNEGATIVE,
    "rl.loss_agg_mode": one_of(*LOSS_AGG_MODES), "rl.scale_rewards": BOOL,
    "rl.advantage_baseline": one_of(*ADVANTAGE_BASELINES), "rl.micro_batch_size": POSITIVE_INT,
    "rl.failure_reward": FINITE, "rl.baseline_momentum": DECAY, "rl.is_cap": POSITIVE_OR_INF,
    "rl.format_reward_weight": FINITE, "rl.decode_weights": one_of(*DECODE_WEIGHTS),
    "rl.rollout_micro_batch": NONNEGATIVE_INT,
    "optimizer.name": one_of(*OPTIMIZERS), "optimizer.warmup_steps": NONNEGATIVE_INT,
    "optimizer.probe_size": POSITIVE_INT, "optimizer.max_consecutive_skips": POSITIVE_INT,
    "optimizer.max_weight_norm_growth": Rule("a number > 1 (a multiple of the initial weight norm)",
                                             lambda v: _number(v) and v > 1),
    "optimizer.logra.variant": Rule("one of 'learning_rate', 'kl' ('grpo' is now 'learning_rate': "
                                    "the variant is named by its step, rl.algorithm by its objective)",
                                    lambda v: v in ("learning_rate", "kl")),
    "optimizer.logra.learning_rate": NONNEGATIVE, "optimizer.logra.weight_decay": NONNEGATIVE,
    "optimizer.logra.max_grad_norm": optional(NONNEGATIVE_OR_INF),
    "optimizer.logra.targets": REGEX, "optimizer.logra.rank": POSITIVE_INT,
    "optimizer.logra.b2": DECAY, "optimizer.logra.eps": POSITIVE, "optimizer.logra.seed": NONNEGATIVE_INT,
    "optimizer.logra.refresh": BOOL, "optimizer.logra.distribution": one_of(*DISTRIBUTIONS),
    "optimizer.logra.others": optional(one_of("adamw", "frozen")),
    "optimizer.logra.others_learning_rate": NONNEGATIVE,
    "optimizer.logra.others_weight_decay": NONNEGATIVE,
    "optimizer.logra.others_warmup_steps": NONNEGATIVE_INT,
    "optimizer.logra.kl_control": optional(BOOL),
    "optimizer.logra.kl_budget": POSITIVE, "optimizer.logra.kl_budget_final": POSITIVE,
    "optimizer.logra.kl_budget_horizon": POSITIVE_INT, "optimizer.logra.alpha_max": POSITIVE,
    "optimizer.logra.mismatch_weight": Rule("in [0, 1]", lambda v: _number(v) and 0 <= v <= 1),
    "optimizer.logra.kl_safeguard": POSITIVE_OR_INF,
    "optimizer.logra.kl_correction": NONNEGATIVE_OR_INF,   # inf and 0: the reference's controller
    "optimizer.logra.update_ratio": POSITIVE,
    "optimizer.logra.factor_dtype": optional(one_of("float32", "bfloat16")),
    "optimizer.logra.merge_rounding": one_of(*ROUNDINGS),
    "optimizer.logra.exact_merge": optional(BOOL),
    **{f"optimizer.adamw.{k}": r for k, r in dict(_ADAM, learning_rate=NONNEGATIVE).items()},
    "optimizer.adafactor.learning_rate": NONNEGATIVE, "optimizer.adafactor.decay_rate": FRACTION,
    "optimizer.adafactor.min_dim_size_to_factor": POSITIVE_INT,
    "optimizer.adafactor.clipping_threshold": optional(POSITIVE_OR_INF),
    "optimizer.adafactor.multiply_by_parameter_scale": BOOL,
    "optimizer.adafactor.momentum": optional(DECAY),
    "optimizer.adafactor.weight_decay_rate": optional(NONNEGATIVE),
    "optimizer.adafactor.max_grad_norm": NONNEGATIVE_OR_INF,
    **{f"optimizer.lora.{k}": r for k, r in dict(_ADAM, learning_rate=NONNEGATIVE, rank=POSITIVE_INT,
                                                alpha=POSITIVE, targets=REGEX,
                                                init_seed=NONNEGATIVE_INT).items()},
    **{f"optimizer.galore.{k}": r for k, r in dict(_ADAM, learning_rate=NONNEGATIVE, rank=POSITIVE_INT,
                                                  update_proj_gap=POSITIVE_INT, scale=POSITIVE,
                                                  targets=REGEX, projector=one_of(*GALORE_PROJECTORS)
                                                  ).items()},
    "sync.mode": one_of(*SYNC_MODES), "sync.rollout_devices": NONNEGATIVE_INT,
    "sync.rollout_mesh.fsdp": AXIS_SIZE, "sync.rollout_mesh.tensor": AXIS_SIZE,
    "sync.master_copy": BOOL, "sync.dtype": one_of(*SYNC_DTYPES),
    "checkpoint.every": POSITIVE_INT, "checkpoint.keep": POSITIVE_INT,
    "log.tensorboard": BOOL, "log.progress": BOOL, "log.sample_every": NONNEGATIVE_INT,
    # Each key's type here; what the section means as a whole (an address needs a process count
    # and an id below it) is logra_jax.distributed.validate's.
    "distributed.coordinator_address": TEXT, "distributed.num_processes": NONNEGATIVE_INT,
    "distributed.process_id": Rule("an integer ≥ -1 (-1: unset)", lambda v: _integer(v) and v >= -1),
    "distributed.initialization_timeout": POSITIVE, "distributed.heartbeat_timeout": POSITIVE,
}
# Sections of free-form keyword arguments, checked by what reads them (a reasoning-gym task's own
# arguments): any key may be set there.
# model.tiny holds keyword arguments of models.ModelConfig (any of its fields: q/k norms, the
# MLP's activation, ...), which the model's config refuses by name; the usual ones have rules above.
CHECKED_ELSEWHERE = ("data.task_kwargs.", "model.tiny.")

# Options only one algorithm reads (rl/update.py, rl/losses.py, rl/build.py): set to anything but
# configs/base.py's default under the other algorithm, they change nothing, and `ignored_options`
# names them (launch.train warns once). Their values are still checked above under either.
ALGORITHM_OPTIONS = {
    "grpo": ("rl.epsilon", "rl.epsilon_high", "rl.beta", "rl.kl_estimator", "rl.scale_rewards",
             "rl.advantage_baseline"),
    "reinforce": ("rl.failure_reward", "rl.baseline_momentum", "rl.is_cap"),
}


def known_keys() -> list[str]:
    """The dotted keys configs/base.py defines (`VALUE_RULES`'), in its order."""
    return list(VALUE_RULES)


def _is_known(key: str) -> bool:
    return key in VALUE_RULES or key.startswith(CHECKED_ELSEWHERE)


def _sections() -> set[str]:
    """Every section of the schema ("optimizer", "optimizer.logra", ...)."""
    return {key.rsplit(".", i)[0] for key in VALUE_RULES for i in range(1, key.count(".") + 1)}


def unknown_keys(config: ml_collections.ConfigDict) -> list[str]:
    """The keys ``config`` sets that configs/base.py does not define (a typo such as
    ``rl.num_generation``, which would otherwise train silently with the default), each named at
    its first unknown part: a misspelt section (``optimzer.logra.rank``) is ``optimzer``."""
    sections = _sections()
    found = []
    for key in flatten(config.to_dict()):
        if _is_known(key):
            continue
        parts = key.split(".")
        root = next((".".join(parts[:i]) for i in range(1, len(parts) + 1)
                     if ".".join(parts[:i]) not in sections), key)
        if root not in found:
            found.append(root)
    return found


def nearest_keys(key: str, most: int = 3) -> list[str]:
    """The real keys (or sections) closest to the unknown ``key``: keys of that name one section
    further down (``optimizer.rank`` → ``optimizer.logra.rank``), then its siblings whose names
    are nearest (``rl.num_generation`` → ``rl.num_generations``)."""
    section, _, name = key.rpartition(".")
    names = {k.rpartition(".")[2]: k for k in list(VALUE_RULES) + sorted(_sections())
             if k.rpartition(".")[0] == section and not k.startswith(CHECKED_ELSEWHERE)}
    close = [names[n] for n in difflib.get_close_matches(name, list(names), n=most, cutoff=0.5)]
    elsewhere = [k for k in VALUE_RULES if k.startswith(f"{section}.") and k.endswith(f".{name}")]
    return list(dict.fromkeys(elsewhere + close))[:most]


def describe_unknown(key: str) -> str:
    """"rl.num_generation is not a key of configs/base.py (nearest: rl.num_generations)"."""
    near = nearest_keys(key)
    section = key.rpartition(".")[0]
    if near:
        hint = f"nearest: {', '.join(near)}"
    else:
        siblings = sorted(k.rpartition(".")[2] for k in list(VALUE_RULES) + sorted(_sections())
                          if k.rpartition(".")[0] == section)
        hint = f"{section or 'the top level'} holds {', '.join(dict.fromkeys(siblings))}"
    return f"{key} is not a key of configs/base.py ({hint})"


def check_values(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first key configs/base.py does not define, or the first whose
    value no run can use (`VALUE_RULES`)."""
    unknown = unknown_keys(config)
    if unknown:
        raise ValueError(f"unknown config key: {describe_unknown(unknown[0])}")
    flat = flatten(config.to_dict())
    for key, rule in VALUE_RULES.items():
        if key in flat and not rule.accepts(flat[key]):
            raise ValueError(f"{key} must be {rule.demand}, got {flat[key]!r}")


def ignored_options(config: ml_collections.ConfigDict,
                    defaults: ml_collections.ConfigDict) -> list[str]:
    """The options of the algorithm ``config`` does not run that differ from ``defaults``
    (configs/base.py's): values the run would silently ignore. Nothing for an unknown algorithm
    (`check_values` refuses it)."""
    if config.rl.algorithm not in ALGORITHM_OPTIONS:
        return []
    ignored = [key for algorithm, keys in ALGORITHM_OPTIONS.items()
               if algorithm != config.rl.algorithm for key in keys]
    return [key for key in ignored if get(config, key) != get(defaults, key)]


def placed_sync_mode(mode: str, colocated: bool) -> str:
    """The sync a placement runs: colocated, ``factors`` and ``sparse`` become ``full`` (a local
    cast: nothing crosses a wire, and the encodings would only cost memory on the trainer's devices)."""
    return "full" if colocated and mode in ("factors", "sparse") else mode


def replays_merge(config: ml_collections.ConfigDict) -> bool:
    """Whether a rollout engine re-applies LoGRA's merges from the factors (a factors sync to
    devices of its own): only then must the trainer's U·A be order-free (the same bits there)."""
    return placed_sync_mode(config.sync.mode, not config.sync.rollout_devices) == "factors"


def validate(config: ml_collections.ConfigDict) -> None:
    """Every value alone (`check_values`: one rule per key), then the rules that span keys; a value
    a builder can only check with the model (targets, ranks) is checked where it is used."""
    check_values(config)
    rl = config.rl
    if rl.algorithm == "grpo" and rl.num_generations < 2:
        raise ValueError(f"rl.num_generations={rl.num_generations}: GRPO compares completions within "
                         "a group, so it needs at least 2 per prompt")
    if config.sync.rollout_devices and config.sync.mode == "off":
        raise ValueError("sync.rollout_devices > 0 puts the sampler on its own devices, so it needs "
                         "a sync.mode (full | factors | sparse) to receive the weights")
    if config.sync.mode == "factors" and config.optimizer.name != "logra":
        raise ValueError("sync.mode='factors' sends LoGRA's low-rank factors; optimizer.name="
                         f"{config.optimizer.name!r} has none (use full or sparse)")
    if replays_merge(config) and config.optimizer.logra.exact_merge is False:
        raise ValueError("sync.mode='factors' on rollout devices replays the trainer's merges, "
                         "which needs optimizer.logra.exact_merge=True (or None: automatic)")
    rows = config.data.prompts_per_step * rl.num_generations
    if rows % rl.micro_batch_size:
        raise ValueError(f"data.prompts_per_step × rl.num_generations = {rows} rows is not a "
                         f"multiple of rl.micro_batch_size={rl.micro_batch_size}")
    if rl.rollout_micro_batch and rows % rl.rollout_micro_batch:
        raise ValueError(f"data.prompts_per_step × rl.num_generations = {rows} rows is not a "
                         f"multiple of rl.rollout_micro_batch={rl.rollout_micro_batch}")
