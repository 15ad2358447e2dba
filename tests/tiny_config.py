"""configs/tiny.py with nested overrides, for the tests that run the loop."""

import jax
import ml_collections

from configs import tiny
from logra_jax.tree_paths import leaves_with_paths


def override(node: ml_collections.ConfigDict, values: dict) -> None:
    """Sets ``values`` (nested dicts merge into sections) on the config ``node``."""
    for key, value in values.items():
        if isinstance(value, dict):
            override(node[key], value)
        else:
            node[key] = value


def tiny_config(*overrides: dict) -> ml_collections.ConfigDict:
    """configs/tiny.py with each of ``overrides`` applied in turn."""
    config = tiny.get_config()
    for values in overrides:
        override(config, values)
    return config


# The optimizer variants the loop tests run: name → overrides of configs/tiny.py.
VARIANTS = {
    "logra-grpo": dict(optimizer=dict(name="logra", logra=dict(variant="learning_rate", kl_control=True))),
    "logra-kl": dict(optimizer=dict(name="logra", logra=dict(variant="kl", others="frozen")),
                     rl=dict(algorithm="reinforce")),
    "adamw": dict(optimizer=dict(name="adamw")),
}


def make_config(name, **extra):
    """configs/tiny.py with the variant's overrides, then ``extra``'s (nested dicts merge)."""
    return tiny_config(VARIANTS[name], extra)


def flat_params(params) -> dict:
    """{path: host array} of a params tree."""
    return dict(leaves_with_paths(jax.device_get(params)))
