"""The command line of every ``launch.*`` command: absl parses it, and what it refuses is one line.

absl reports a bad flag as "FATAL Flags parsing error: ..." plus a help hint, and ml_collections'
config flag reports an unknown ``--config.a.b`` key as a bare ``AttributeError`` traceback and a
failing config file as a page of traceback. Here the parse (`run`'s ``flags_parser``) turns each
into one ``error: …`` line, exit status 1:

- `define_config` is ml_collections' config-file flag with the project's loader
  (logra_jax/config/files.py: ``file.py``, ``file.py:arg`` or a run's ``config.json``; every key
  the file sets must be one configs/base.py defines), the override keys checked against the
  loaded config (naming the siblings, or the section one level down that holds the key), and each
  override's value named with the type it needs;
- required flags are named (``--workdir is required``); a request for help is absl's.

Nothing here touches sys.argv itself: absl parses it, then `run` calls the command's ``main``,
which calls `launch.process.setup` before jax starts.
"""

from __future__ import annotations

import functools
import pathlib
import re
import sys
from typing import Callable, Sequence

from absl import app, flags
from ml_collections.config_flags import config_flags

from logra_jax import config as config_lib

FLAGS = flags.FLAGS


class CommandLineError(flags.Error):
    """A refused command line; the message is the line to print (after ``error: ``). A
    flags.Error that is not a ValueError, so absl passes it on instead of rewording it."""


class _ConfigFileParser(flags.ArgumentParser):
    """A config file's path → its config (`config_lib.load_config_file`), its overrides checked.

    Loaded once: ml_collections' flag asks its parser again for the config it defines the
    override flags on, and gets the same one."""

    def __init__(self, name: str, lock_config: bool):
        self.name, self._lock_config = name, lock_config
        self.flag: _ConfigFileFlag | None = None
        self._loaded: tuple[str, object] | None = None

    def parse(self, argument):
        if self._loaded is not None and self._loaded[0] == argument:
            return self._loaded[1]
        from configs import base   # the schema's defaults, for a run's config.json
        try:
            config = config_lib.load_config_file(argument, defaults=base.get_config)
        except config_lib.ConfigFileError as e:
            raise CommandLineError(str(e)) from e
        keys = self.flag._GetOverrides(self.flag._GetArgv()) if self.flag is not None else []
        try:
            config_lib.check_overrides(config, keys)
        except ValueError as e:
            raise CommandLineError(str(e)) from None
        if self._lock_config:
            config.lock()
        self._loaded = (argument, config)
        return config

    def flag_type(self):
        return "config object"


class _ConfigFileFlag(config_flags._ConfigFlag):   # noqa: SLF001  ml_collections' override flags
    """ml_collections' config flag, whose override flags name the key and the type a bad value
    needs (``--config.max_steps=abc: expected an integer (its default is 3)``)."""

    def _parse(self, argument):
        config = super()._parse(argument)
        for key in self._GetOverrides(self._GetArgv()):
            field = self.flag_values[f"{self.name}.{key}"]
            field.parser = _FieldParser(field.parser, config, key)
        return config


class _FieldParser(flags.ArgumentParser):
    """One override's parser, whose refusal names the key, the value and the type it needs."""

    def __init__(self, inner: flags.ArgumentParser, config, key: str):
        self._inner, self._config, self._key = inner, config, key

    def parse(self, argument):
        try:
            return self._inner.parse(argument)
        except (TypeError, ValueError):
            raise CommandLineError(config_lib.override_value_error(self._config, self._key,
                                                                   argument)) from None

    def flag_type(self):
        return self._inner.flag_type()

    def __getattr__(self, name):   # what absl asks of the parser it wraps (e.g. its syntax)
        return getattr(self._inner, name)


def define_config(name: str = "config", default: str | None = None, *, help_string: str,
                  lock_config: bool = True, flag_values: flags.FlagValues = FLAGS,
                  sys_argv: list[str] | None = None) -> flags.FlagHolder:
    """A ``--config`` flag (with ``--config.a.b=v`` overrides) whose every refusal is one line."""
    parser = _ConfigFileParser(name, lock_config)
    flag = _ConfigFileFlag(parser=parser, serializer=flags.ArgumentSerializer(), name=name,
                           default=default, help_string=help_string, flag_values=flag_values,
                           sys_argv=sys_argv)
    parser.flag = flag
    return flags.DEFINE_flag(flag, flag_values)


def _sentence(error: flags.Error) -> str:
    """absl's message as the line after ``error: ``."""
    text = " ".join(str(error).split())
    missing = re.fullmatch(r"Missing value for flag (--\S+)", text)
    if missing:
        return f"{missing.group(1)} needs a value ({missing.group(1)}=...)"
    return text


def parse(argv: Sequence[str], *, required: Sequence[str] = (),
          flag_values: flags.FlagValues = FLAGS) -> list[str]:
    """absl's parse of ``argv`` (the program name first); a refusal, or a flag of ``required``
    left unset, exits with one ``error:`` line. ``--verbose`` (where the command has it) shows
    the config file's own traceback instead."""
    try:
        remaining = flag_values(list(argv))
    except flags.Error as e:
        cause = e.__cause__
        if cause is not None and isinstance(cause, config_lib.ConfigFileError) and \
                cause.__cause__ is not None and _asks_verbose(argv):
            raise cause
        sys.exit(f"error: {_sentence(e)}")
    for name in required:
        if flag_values[name].value is None:
            sys.exit(f"error: --{name} is required")
    return remaining


def _asks_verbose(argv: Sequence[str]) -> bool:
    """Whether a command line absl could not parse asked for tracebacks (its flags are not all
    parsed, so ``--verbose`` is looked for among the arguments)."""
    return any(arg in ("--verbose", "--verbose=true", "--verbose=True") for arg in argv)


def run(main: Callable[[list[str]], object], *, required: Sequence[str] = ()) -> None:
    """``app.run(main)`` with `parse` as its flags parser."""
    app.run(main, flags_parser=functools.partial(parse, required=required))


def parse_labelled(values: Sequence[str], what: str) -> dict[str, pathlib.Path]:
    """'label=path' flag values (``--run logra=runs/a``); a missing '=' or path names the value."""
    out = {}
    for value in values:
        label, sep, path = value.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"--{what} expects label=path, got {value!r}")
        out[label] = pathlib.Path(path)
    return out


def parse_mesh(text: str) -> dict[str, int]:
    """A ``--mesh`` value, "fsdp=4,tensor=1" → {"fsdp": 4, "tensor": 1} (the planners' override of
    a config's mesh); a size that is not an integer names the value."""
    sizes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        try:
            sizes[name.strip()] = int(size)
        except ValueError:
            raise ValueError(f"--mesh {text!r}: expected name=size pairs such as fsdp=4,tensor=1") from None
    return sizes
