"""Loading ml_collections config files, checking command-line overrides before absl sees them, and
checking every value of a run's config before anything is built or written.

absl's config flags report an unknown ``--config.a.b=v`` key as a bare ``AttributeError: 'b'``
traceback; `check_overrides` turns that into one sentence naming the key and its siblings.
`check_values` holds one rule per key of configs/base.py (`VALUE_RULES`): a value no run can use is
one sentence naming the key as the user types it (``rl.micro_batch_size``), before the model is built.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import re
import sys
import traceback
from typing import Callable, Sequence

import ml_collections

OVERRIDE_PREFIX = "--config."


class ConfigFileError(ValueError):
    """A config file that cannot give a config: the message names the file (and its line, where
    Python gives one) and what went wrong; the original exception is its ``__cause__``."""


def _where(path: pathlib.Path, error: BaseException) -> str:
    """'path:line' of the innermost frame of ``error``'s traceback inside ``path`` (a SyntaxError:
    its own line), else 'path'."""
    if isinstance(error, SyntaxError) and error.lineno:
        return f"{path}:{error.lineno}"
    line = None
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        if pathlib.Path(frame.f_code.co_filename).resolve() == path.resolve():
            line = lineno
    return f"{path}:{line}" if line else str(path)


def load_config_file(path: str | pathlib.Path) -> ml_collections.ConfigDict:
    """Imports ``path`` and returns its ``get_config()``. Any failure — a missing file, a folder,
    a syntax error, an exception while importing it or in ``get_config``, a result that is not a
    ConfigDict — is a `ConfigFileError` naming the file (``file:line`` where there is one)."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise ConfigFileError(f"config file {str(path)!r} is a folder; pass a configs/*.py file")
    if not path.is_file():
        raise ConfigFileError(f"config file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a config file is arbitrary Python: any error is the file's
        what = e.msg if isinstance(e, SyntaxError) else str(e)
        raise ConfigFileError(f"config file {_where(path, e)}: {type(e).__name__}: {what}") from e
    if not callable(getattr(module, "get_config", None)):
        raise ConfigFileError(f"config file {str(path)!r} has no get_config() function")
    try:
        config = module.get_config()
    except Exception as e:  # noqa: BLE001
        raise ConfigFileError(f"config file {_where(path, e)}: get_config() raised "
                              f"{type(e).__name__}: {e}") from e
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigFileError(f"config file {str(path)!r}: get_config() returned "
                              f"{type(config).__name__} {config!r:.60}, not an "
                              f"ml_collections.ConfigDict")
    return config


def overrides(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """(dotted key, value) of every ``--config.key=value`` / ``--config.key value`` argument;
    value None when none follows."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith(OVERRIDE_PREFIX):
            key, sep, value = arg[len(OVERRIDE_PREFIX):].partition("=")
            if not sep:
                following = argv[i + 1] if i + 1 < len(argv) else None
                value = None if following is None or following.startswith("--") else following
            out.append((key, value))
    return out


def override_keys(argv: Sequence[str]) -> list[str]:
    """The dotted keys of every ``--config.key=value`` / ``--config.key value`` argument."""
    return [key for key, _ in overrides(argv)]


_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}


def check_override_value(config: ml_collections.ConfigDict, dotted: str, value: str | None) -> None:
    """Raises ValueError when ``value`` cannot become the key's type (int, float or bool fields;
    absl would report it as a two-line FATAL flags error)."""
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node[part]
    field_type = node.get_type(last)
    if value is None:
        raise ValueError(f"--config.{dotted} needs a value (--config.{dotted}=...)")
    parse = {int: (int, "an integer"), float: (float, "a number"),
             bool: (lambda v: _BOOLEANS[v.lower()], "true or false")}.get(field_type)
    if parse is None:
        return
    try:
        parse[0](value)
    except (ValueError, KeyError):
        raise ValueError(f"--config.{dotted}={value}: expected {parse[1]} (its default is "
                         f"{node[last]!r})") from None


def check_overrides(config: ml_collections.ConfigDict, keys: Sequence[str]) -> None:
    """Raises ValueError for the first override key that the config does not define."""
    for dotted in keys:
        node = config
        walked = []
        for part in dotted.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                where = ".".join(walked) or "the top level"
                known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
                # A key one section further down (optimizer.rank → optimizer.logra.rank).
                inside = [f"{where}.{k}.{part}" for k in known if walked
                          and isinstance(node[k], ml_collections.ConfigDict) and part in node[k]]
                raise ValueError(f"unknown config key {dotted!r}: {where} has no {part!r}"
                                 + (f" (known: {', '.join(known)})" if known else "")
                                 + (f"; did you mean {' or '.join(inside)}?" if inside else ""))
            node = node[part]
            walked.append(part)


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

# Every key of configs/base.py that holds a value (tests/test_bad_input.py checks that none is
# missing). The ``distributed`` section is checked as a whole by logra_jax.distributed.validate,
# and rules that span keys (a group of ≥ 2 for GRPO, batch splits) by rl.build.validate.
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
}
# Sections whose values another module checks as a whole, or that hold free-form keyword arguments.
CHECKED_ELSEWHERE = ("distributed.", "data.task_kwargs.")

# Options only one algorithm reads (rl/update.py, rl/losses.py, rl/build.py): set to anything but
# configs/base.py's default under the other algorithm, they change nothing, and `ignored_options`
# names them (launch.train warns once). Their values are still checked above under either.
ALGORITHM_OPTIONS = {
    "grpo": ("rl.epsilon", "rl.epsilon_high", "rl.beta", "rl.kl_estimator", "rl.scale_rewards",
             "rl.advantage_baseline"),
    "reinforce": ("rl.failure_reward", "rl.baseline_momentum", "rl.is_cap"),
}


def _get(config: ml_collections.ConfigDict, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def check_values(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first key whose value no run can use (`VALUE_RULES`).

    Needs nothing but the config: no jax, no files, so a bad value is refused in a moment."""
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
    return [key for key in ignored if _get(config, key) != _get(defaults, key)]


# Keys a resumed run may change: they do not change what the saved state means. The process layout
# is one of them (each process of a run has its own process_id; the checkpoint holds global arrays),
# and so is how the sampler reads its weights and how many rows it decodes at once
# (rl.decode_weights, rl.rollout_micro_batch: the same model and draws, another loop).
RESUMABLE_CHANGES = ("max_steps", "log.", "checkpoint.every", "checkpoint.keep", "distributed.",
                     "rl.decode_weights", "rl.rollout_micro_batch")


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a.b": value} for a nested dict (a ConfigDict's ``to_dict()``)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def as_json(config: ml_collections.ConfigDict) -> dict:
    """The config as plain JSON values (what a workdir's config.json holds)."""
    return json.loads(json.dumps(config.to_dict(), default=str))


def resumable(key: str) -> bool:
    """Whether a resume may change the dotted ``key`` (`RESUMABLE_CHANGES`)."""
    return any(key == h or (h.endswith(".") and key.startswith(h)) for h in RESUMABLE_CHANGES)


def state_changes(saved: dict, current: dict) -> list[str]:
    """Keys whose value differs between two configs' JSON (nested, or flat as `fingerprint`'s),
    except `RESUMABLE_CHANGES`."""
    old, new = flatten(saved), flatten(current)
    changed = sorted(k for k in set(old) | set(new) if old.get(k, "<absent>") != new.get(k, "<absent>"))
    return [k for k in changed if not resumable(k)]


def fingerprint(config: ml_collections.ConfigDict) -> dict[str, object]:
    """{dotted key: JSON value} of every key that changes what training computes (all but
    `RESUMABLE_CHANGES`): what a checkpoint records of the config that trained it, so that a resume
    can be checked against the checkpoint itself, not only against the workdir's config.json."""
    return {k: v for k, v in flatten(as_json(config)).items() if not resumable(k)}


def describe_changes(saved: dict, current: dict, keys: Sequence[str], most: int = 6) -> str:
    """"seed 0 → 1, optimizer.name 'logra' → 'adamw'" for ``keys`` (`state_changes`), at most
    ``most`` of them spelled out."""
    old, new = flatten(saved), flatten(current)
    def value(values, key):
        return repr(values[key]) if key in values else "(absent)"
    shown = [f"{k} {value(old, k)} → {value(new, k)}" for k in keys[:most]]
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return ", ".join(shown) + more


def config_path_from_argv(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


HELP_FLAGS = ("-h", "-?", "--help", "--helpshort", "--helpfull", "--helpxml")


def check_argv(argv: Sequence[str], required: Sequence[str] = ()) -> None:
    """Exits with one line on a missing config file or required flag, an unknown ``--config.*``
    key, or a value that is not of its key's type.

    Launch scripts call it before absl parses flags (absl would print a traceback or a two-line
    FATAL message instead). ``required``: flag names (without ``--``) that must be given. A
    request for help is left to absl, which prints it whatever else is missing.
    """
    if any(arg in HELP_FLAGS for arg in argv):
        return
    verbose = any(arg in ("--verbose", "--verbose=true", "--verbose=True") for arg in argv)
    for name in required:
        if not any(a == f"--{name}" or a.startswith(f"--{name}=") for a in argv):
            sys.exit(f"error: --{name} is required")
    path = config_path_from_argv(argv)
    if path is None:
        return  # no --config: nothing to check the overrides against
    try:
        config = load_config_file(path)
        check_overrides(config, override_keys(argv))
        for key, value in overrides(argv):
            check_override_value(config, key, value)
    except ValueError as e:
        if verbose and e.__cause__ is not None:
            raise   # the traceback of the config file's own error
        sys.exit(f"error: {e}")


def parse_labelled(values: Sequence[str], what: str) -> dict[str, pathlib.Path]:
    """'label=path' flag values (``--run logra=runs/a``); a missing '=' or path names the value."""
    out = {}
    for value in values:
        label, sep, path = value.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"--{what} expects label=path, got {value!r}")
        out[label] = pathlib.Path(path)
    return out
