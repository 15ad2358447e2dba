"""A run's config: loading it from a file (`files`), the rule each value must follow (`rules`),
checking its values (`values`), the algorithms and optimizers it can name (`choices`: their
registries), the facts derived from it once (`derived`), and what a checkpoint records of it
(`fingerprint`). None of it imports jax: every check here runs before anything is built or
written, in a moment.

The names below are the ones the rest of the package and the commands use.
"""

from logra_jax.config.choices import ALGORITHMS, OPTIMIZERS, Choice, OptimizerChoice, Registry
from logra_jax.config.derived import placed_sync_mode, replays_merge, rows_per_step
from logra_jax.config.files import (ConfigFileError, check_keys, check_overrides,
                                    load_config_file, override_value_error)
from logra_jax.config.fingerprint import (DECODE_KEY, RESUMABLE_CHANGES, as_json,
                                          describe_changes, fingerprint, recorded_decode_mode,
                                          resumable, state_changes)
from logra_jax.config.keys import flatten, get
from logra_jax.config.rules import (ADVANTAGE_BASELINES, DATA_SOURCES, DECODE_WEIGHTS,
                                    DISTRIBUTIONS, FINITE, GALORE_PROJECTORS,
                                    IMPORTANCE_CORRECTIONS, KL_ESTIMATORS, LOSS_AGG_MODES,
                                    MODEL_DTYPES, NONNEGATIVE, POSITIVE, POSITIVE_INT,
                                    ROLLOUT_ENGINES, ROUNDINGS, SYNC_DTYPES, SYNC_MODES, Rule,
                                    one_of)
from logra_jax.config.values import (CHECKED_ELSEWHERE, VALUE_RULES, check_values,
                                     describe_unknown, ignored_options, known_keys, nearest_keys,
                                     unknown_keys, validate, value_rules)
