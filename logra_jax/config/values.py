"""Every value of a run's config checked before anything is built: one rule per key
(`value_rules`: configs/base.py's own keys, `VALUE_RULES`, and the keys of every registered
algorithm and optimizer, choices.py; also the schema of which keys exist), the rules that span
keys (`validate`, with the chosen entries' own), and the options the chosen algorithm ignores
(`ignored_options`).

Needs nothing but the config: no jax, no files, so a bad value is refused in a moment, before the
workdir is touched. A value no run can use is one sentence naming the key as the user types it
(``rl.micro_batch_size``).
"""

from __future__ import annotations

import difflib

import ml_collections

from logra_jax.config import choices
from logra_jax.config.derived import rows_per_step
from logra_jax.config.keys import flatten, get
from logra_jax.config.rules import (AXIS_SIZE, BOOL, DATA_SOURCES, DECODE_WEIGHTS, FINITE,
                                    FRACTION, IMPORTANCE_CORRECTIONS, LOSS_AGG_MODES, MODEL_DTYPES,
                                    NAME, NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, ROLLOUT_ENGINES,
                                    SYNC_DTYPES, SYNC_MODES, TEXT, Rule, _integer, _number, one_of)


# Every key of configs/base.py that holds a value and belongs to no registered entry (those are
# the entries' own, choices.py): with them, the schema a config file's keys are checked against
# (`unknown_keys`; tests/test_bad_input.py checks that it is configs/base.py's keys, no more, no
# fewer). Rules that span keys (batch splits, sync modes; GRPO's group of ≥ 2) are `validate`'s.
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
    "rl.num_generations": POSITIVE_INT,
    "rl.temperature": POSITIVE, "rl.top_p": FRACTION, "rl.top_k": NONNEGATIVE_INT,
    "rl.max_prompt_length": POSITIVE_INT, "rl.max_completion_length": POSITIVE_INT,
    "rl.loss_agg_mode": one_of(*LOSS_AGG_MODES), "rl.micro_batch_size": POSITIVE_INT,
    "rl.format_reward_weight": FINITE, "rl.decode_weights": one_of(*DECODE_WEIGHTS),
    "rl.rollout_micro_batch": NONNEGATIVE_INT,
    "rl.rollout_engine": one_of(*ROLLOUT_ENGINES), "rl.rollout_slots": NONNEGATIVE_INT,
    # Rollouts for step k sampled by the weights of max_lag updates earlier (0: on-policy), and
    # how their ratio to the trained policy is corrected (GRPO's cap; REINFORCE's is rl.is_cap).
    "rl.max_lag": NONNEGATIVE_INT, "rl.importance_correction": one_of(*IMPORTANCE_CORRECTIONS),
    "rl.importance_cap": Rule("a number ≥ 1 (a cap on π_θ / π_behaviour)",
                              lambda v: _number(v) and v >= 1),
    "optimizer.warmup_steps": NONNEGATIVE_INT,
    "optimizer.probe_size": POSITIVE_INT, "optimizer.max_consecutive_skips": POSITIVE_INT,
    "optimizer.max_weight_norm_growth": Rule("a number > 1 (a multiple of the initial weight norm)",
                                             lambda v: _number(v) and v > 1),
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

REGISTRIES = (choices.ALGORITHMS, choices.OPTIMIZERS)


def value_rules() -> dict[str, Rule]:
    """{dotted key: Rule} of every key a config may set: `VALUE_RULES` and, for each registry,
    its choice key and its registered entries' own keys (as registered now)."""
    rules = dict(VALUE_RULES)
    for registry in REGISTRIES:
        rules.update(registry.value_rules())
    return rules


def known_keys() -> list[str]:
    """The dotted keys a config may set (`value_rules`')."""
    return list(value_rules())


def _is_known(key: str, rules: dict[str, Rule]) -> bool:
    return key in rules or key.startswith(CHECKED_ELSEWHERE)


def _sections(rules: dict[str, Rule]) -> set[str]:
    """Every section of the schema ("optimizer", "optimizer.logra", ...)."""
    return {key.rsplit(".", i)[0] for key in rules for i in range(1, key.count(".") + 1)}


def unknown_keys(config: ml_collections.ConfigDict) -> list[str]:
    """The keys ``config`` sets that configs/base.py does not define (a typo such as
    ``rl.num_generation``, which would otherwise train silently with the default), each named at
    its first unknown part: a misspelt section (``optimzer.logra.rank``) is ``optimzer``."""
    rules = value_rules()
    sections = _sections(rules)
    found = []
    for key in flatten(config.to_dict()):
        if _is_known(key, rules):
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
    rules = value_rules()
    section, _, name = key.rpartition(".")
    names = {k.rpartition(".")[2]: k for k in list(rules) + sorted(_sections(rules))
             if k.rpartition(".")[0] == section and not k.startswith(CHECKED_ELSEWHERE)}
    close = [names[n] for n in difflib.get_close_matches(name, list(names), n=most, cutoff=0.5)]
    elsewhere = [k for k in rules if k.startswith(f"{section}.") and k.endswith(f".{name}")]
    return list(dict.fromkeys(elsewhere + close))[:most]


def describe_unknown(key: str) -> str:
    """"rl.num_generation is not a key of configs/base.py (nearest: rl.num_generations)"."""
    near = nearest_keys(key)
    section = key.rpartition(".")[0]
    if near:
        hint = f"nearest: {', '.join(near)}"
    else:
        rules = value_rules()
        siblings = sorted(k.rpartition(".")[2] for k in list(rules) + sorted(_sections(rules))
                          if k.rpartition(".")[0] == section)
        hint = f"{section or 'the top level'} holds {', '.join(dict.fromkeys(siblings))}"
    return f"{key} is not a key of configs/base.py ({hint})"


def check_values(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first key configs/base.py does not define, or the first whose
    value no run can use (`value_rules`)."""
    unknown = unknown_keys(config)
    if unknown:
        raise ValueError(f"unknown config key: {describe_unknown(unknown[0])}")
    flat = flatten(config.to_dict())
    for key, rule in value_rules().items():
        if key in flat and not rule.accepts(flat[key]):
            raise ValueError(f"{key} must be {rule.demand}, got {flat[key]!r}")


def ignored_options(config: ml_collections.ConfigDict,
                    defaults: ml_collections.ConfigDict) -> list[str]:
    """The keys of the registered algorithms ``config`` does not run (their own keys: only each
    one reads them) that differ from ``defaults`` (configs/base.py's): values the run would
    silently ignore. A key the config or the defaults lack (an algorithm registered from outside
    brings its own) is compared as absent."""
    registry, chosen = choices.ALGORITHMS, config.rl.algorithm
    if chosen not in registry.names():
        return []   # check_values refuses it
    own = set(registry.keys_of(chosen))
    ignored = [key for name in registry.names() if name != chosen
               for key in registry.keys_of(name) if key not in own]
    return [key for key in ignored if _get_or_none(config, key) != _get_or_none(defaults, key)]


def _get_or_none(config: ml_collections.ConfigDict, key: str):
    try:
        return get(config, key)
    except (KeyError, AttributeError):
        return None


def validate(config: ml_collections.ConfigDict) -> None:
    """Every value alone (`check_values`: one rule per key), then the rules that span keys, the
    chosen algorithm's and optimizer's own among them (their records' ``check``); a value a
    builder can only check with the model (targets, ranks) is checked where it is used."""
    check_values(config)
    rl = config.rl
    algorithm = choices.ALGORITHMS.choice(rl.algorithm)
    optimizer = choices.OPTIMIZERS.choice(config.optimizer.name)
    algorithm.check(config)
    if config.sync.rollout_devices and config.sync.mode == "off":
        raise ValueError("sync.rollout_devices > 0 puts the sampler on its own devices, so it needs "
                         "a sync.mode (full | factors | sparse) to receive the weights")
    if config.sync.mode == "factors" and not getattr(optimizer, "low_rank_factors", False):
        raise ValueError("sync.mode='factors' sends an optimizer's low-rank factors (LoGRA's); "
                         f"optimizer.name={config.optimizer.name!r} has none (use full or sparse)")
    optimizer.check(config)
    rows = rows_per_step(config)
    if rows % rl.micro_batch_size:
        raise ValueError(f"data.prompts_per_step × rl.num_generations = {rows} rows is not a "
                         f"multiple of rl.micro_batch_size={rl.micro_batch_size}")
    if rl.rollout_micro_batch and rows % rl.rollout_micro_batch:
        raise ValueError(f"data.prompts_per_step × rl.num_generations = {rows} rows is not a "
                         f"multiple of rl.rollout_micro_batch={rl.rollout_micro_batch}")
    if rl.rollout_engine == "slots" and rl.rollout_micro_batch:
        raise ValueError("rl.rollout_micro_batch splits the static engine's batch into passes; "
                         "the slot engine's memory is rl.rollout_slots: set one of them")
    if rl.rollout_engine == "slots" and rl.rollout_slots % rl.num_generations:
        raise ValueError(f"rl.rollout_slots={rl.rollout_slots} must be a multiple of "
                         f"rl.num_generations={rl.num_generations}: a group's rows enter together")
