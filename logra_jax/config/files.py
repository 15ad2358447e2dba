"""Loading a run's config from a file, and checking every key it sets against configs/base.py.

A config file is a Python file whose ``get_config()`` returns an ml_collections ConfigDict
(``configs/*.py``; ``file.py:arg`` passes ``arg`` to it), or a run's own ``config.json`` (what a
workdir records: repeating a run from it). Whatever goes wrong — a missing file, a syntax error,
an exception in ``get_config``, a key configs/base.py does not define (``c.rl.num_generation = 4``
would otherwise train with the default) — is a `ConfigFileError` naming the file, its line where
there is one, and what to do.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import pathlib
import re
import sys
import traceback
from typing import Callable, Iterator, Sequence

import ml_collections

from logra_jax.config import values
from logra_jax.config.keys import flatten


class ConfigFileError(ValueError):
    """A config file that cannot give a config: the message names the file (and its line, where
    Python gives one) and what went wrong; the original exception, if any, is its ``__cause__``."""


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


def _split_argument(path: str | pathlib.Path) -> tuple[pathlib.Path, str | None]:
    """(file, argument) of ``file.py:arg`` (ml_collections' way to pass ``get_config`` an
    argument); a file whose own name holds a colon is taken whole."""
    text = str(path)
    if pathlib.Path(text).exists() or ":" not in text:
        return pathlib.Path(text), None
    file, _, argument = text.partition(":")
    return pathlib.Path(file), argument


def load_config_file(path: str | pathlib.Path, *,
                     defaults: Callable[[], ml_collections.ConfigDict] | None = None
                     ) -> ml_collections.ConfigDict:
    """The config ``path`` gives, every key it sets checked against the schema (`check_keys`).

    ``path``: a Python file (``get_config()``; ``file.py:arg`` calls ``get_config(arg)``), or a
    ``.json`` file holding a config as `fingerprint.as_json` writes it (a run's config.json), whose
    values replace those of ``defaults()`` (configs/base.py's ``get_config``: it gives each key its
    type). Any failure is a `ConfigFileError` naming the file."""
    file, argument = _split_argument(path)
    if file.is_dir():
        raise ConfigFileError(f"config file {str(file)!r} is a folder; pass a configs/*.py file")
    if not file.is_file():
        raise ConfigFileError(f"config file {str(file)!r} does not exist")
    if file.suffix == ".json":
        if argument is not None:
            raise ConfigFileError(f"config file {str(file)!r} is JSON; ':{argument}' passes an "
                                  f"argument to a Python file's get_config()")
        return _from_json(file, defaults)
    config = _from_python(file, argument)
    check_keys(config, file)
    return config


# The package of the shared config modules (configs/base.py's presets and helpers) that config
# files import.
CONFIGS_PACKAGE = "configs"


@contextlib.contextmanager
def _own_configs_package() -> Iterator[None]:
    """While a config file runs, ``import configs...`` gives it fresh copies of those modules, and
    this process's own are put back after: a file that changes a module-level object of
    configs/base.py (``base.REFERENCE_BATCH[0]["prompts_per_step"] = 4``, a preset of
    ``LOGRA_VARIANTS``) changes its own config only, not every config loaded after it in the same
    process (``launch.sync_bench --configs a.py,b.py``) nor the library's view of the base."""
    def ours(name):
        return name == CONFIGS_PACKAGE or name.startswith(CONFIGS_PACKAGE + ".")
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if ours(name)}
    try:
        yield
    finally:
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


def _from_python(path: pathlib.Path, argument: str | None) -> ml_collections.ConfigDict:
    with _own_configs_package():
        return _run_python(path, argument)


def _run_python(path: pathlib.Path, argument: str | None) -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
    if spec is None:
        raise ConfigFileError(f"config file {str(path)!r} is not a Python file (a configs/*.py "
                              f"file, or a run's config.json)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a config file is arbitrary Python: any error is the file's
        what = e.msg if isinstance(e, SyntaxError) else str(e)
        raise ConfigFileError(f"config file {_where(path, e)}: {type(e).__name__}: {what}") from e
    if not callable(getattr(module, "get_config", None)):
        raise ConfigFileError(f"config file {str(path)!r} has no get_config() function")
    try:
        config = module.get_config() if argument is None else module.get_config(argument)
    except Exception as e:  # noqa: BLE001
        raise ConfigFileError(f"config file {_where(path, e)}: get_config("
                              f"{'' if argument is None else repr(argument)}) raised "
                              f"{type(e).__name__}: {e}") from e
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigFileError(f"config file {str(path)!r}: get_config() returned "
                              f"{type(config).__name__} {config!r:.60}, not an "
                              f"ml_collections.ConfigDict")
    return config


def _from_json(path: pathlib.Path, defaults) -> ml_collections.ConfigDict:
    """configs/base.py's config with every value of the JSON file set over it."""
    if defaults is None:
        raise ConfigFileError(f"config file {str(path)!r} is JSON, which holds values without "
                              f"their types; load it with configs/base.py's get_config as defaults")
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"config file {path} is not JSON ({e})") from None
    if not isinstance(recorded, dict):
        raise ConfigFileError(f"config file {path} holds a JSON {type(recorded).__name__}, not the "
                              f"object of a run's config")
    config = defaults()
    for section in values.CHECKED_ELSEWHERE:   # free-form sections are replaced whole
        *parents, last = section.rstrip(".").split(".")
        node = config
        for part in parents:
            node = node[part]
        node[last] = ml_collections.ConfigDict(_nested(recorded, section.rstrip(".")) or {})
    known = values.value_rules()
    for key, value in flatten(recorded).items():
        if key.startswith(values.CHECKED_ELSEWHERE):
            continue
        if key not in known:
            raise ConfigFileError(f"config file {path}: {values.describe_unknown(key)}")
        *parents, last = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        try:
            node[last] = value
        except (TypeError, ValueError) as e:
            raise ConfigFileError(f"config file {path}: {key}={value!r} does not fit configs/base.py's "
                                  f"{key} ({e})") from None
    return config


def _nested(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(part)
    return tree


def _line_setting(path: pathlib.Path, key: str) -> int | None:
    """The first line of ``path`` that sets the last part of ``key`` (``c.rl.num_generation = 4``,
    ``["num_generation"]``, ``num_generation=4`` in a dict or an update): where to look."""
    name = re.escape(key.rpartition(".")[2])
    pattern = re.compile(rf"(\.{name}\b|\[\s*['\"]{name}['\"]\s*\]|\b{name}\s*=(?!=))")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    return next((i for i, line in enumerate(lines, 1) if pattern.search(line.split("#")[0])), None)


def check_keys(config: ml_collections.ConfigDict, path: str | pathlib.Path) -> None:
    """Raises `ConfigFileError` for the first key ``config`` (loaded from ``path``) sets that
    configs/base.py does not define, naming the file, the line that sets it and the nearest keys."""
    unknown = values.unknown_keys(config)
    if unknown:
        path = pathlib.Path(path)
        line = _line_setting(path, unknown[0])
        where = f"{path}:{line}" if line else str(path)
        raise ConfigFileError(f"config file {where}: {values.describe_unknown(unknown[0])}")


def check_overrides(config: ml_collections.ConfigDict, keys: Sequence[str]) -> None:
    """Raises ValueError for the first command-line override key (``--config.a.b``) that the config
    does not define, naming its siblings, or the section one level down that holds it."""
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


# What a command-line value must be, by the type of the key it sets.
EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def override_value_error(config: ml_collections.ConfigDict, dotted: str, value: str) -> str:
    """The message for ``--config.<dotted>=<value>`` that cannot become the key's type."""
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node[part]
    what = EXPECTED.get(node.get_type(last), f"a {node.get_type(last).__name__}")
    return f"--config.{dotted}={value}: expected {what} (its default is {node[last]!r})"
