"""configs/tiny.py with nested overrides, for the tests that run the loop."""

import ml_collections

from configs import tiny


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
