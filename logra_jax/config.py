"""Loading ml_collections config files and checking command-line overrides before absl sees them.

absl's config flags report an unknown ``--config.a.b=v`` key as a bare ``AttributeError: 'b'``
traceback; `check_overrides` turns that into one sentence naming the key and its siblings.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from typing import Sequence

import ml_collections

OVERRIDE_PREFIX = "--config."


def load_config_file(path: str | pathlib.Path) -> ml_collections.ConfigDict:
    """Imports ``path`` and calls its ``get_config()``; a missing file is a clear error."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {str(path)!r} has no get_config() function")
    return module.get_config()


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


# Keys a resumed run may change: they do not change what the saved state means. The process layout
# is one of them (each process of a run has its own process_id; the checkpoint holds global arrays),
# and so is how the sampler reads its weights (rl.decode_weights: the same model, another loop).
RESUMABLE_CHANGES = ("max_steps", "log.", "checkpoint.every", "checkpoint.keep", "distributed.",
                     "rl.decode_weights")


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


def state_changes(saved: dict, current: dict) -> list[str]:
    """Keys whose value differs between two configs' JSON, except `RESUMABLE_CHANGES`."""
    old, new = flatten(saved), flatten(current)
    changed = sorted(k for k in set(old) | set(new) if old.get(k, "<absent>") != new.get(k, "<absent>"))
    return [k for k in changed
            if not any(k == h or (h.endswith(".") and k.startswith(h)) for h in RESUMABLE_CHANGES)]


def config_path_from_argv(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def check_argv(argv: Sequence[str], required: Sequence[str] = ()) -> None:
    """Exits with one line on a missing config file or required flag, an unknown ``--config.*``
    key, or a value that is not of its key's type.

    Launch scripts call it before absl parses flags (absl would print a traceback or a two-line
    FATAL message instead). ``required``: flag names (without ``--``) that must be given.
    """
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
    except (FileNotFoundError, ValueError) as e:
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
