"""The tables of named entries a run chooses from (`Registry`: its RL algorithms, its optimizers),
and how an entry registered from outside the package joins the config's schema.

logra_jax/config/values.py holds the one schema of a run's config: `config.VALUE_RULES`, a rule
per key, whose keys are also the keys a config may set (a config file or ``--config.*`` setting
any other is refused by name). It sits below the library, spells the built-in choices out
(``rl.algorithm``, ``optimizer.name``) and cannot ask the registries. Registering a new entry
therefore widens that table here: its name becomes a valid choice and its own keys exist, with
their rules, so a bad value of theirs is refused as early as a built-in key's. `admit` returns
the undo."""

from __future__ import annotations

from typing import Callable, Generic, Iterable, Mapping, TypeVar

from logra_jax import config as config_lib


def admit(choice_key: str, names: Iterable[str], rules: Mapping[str, config_lib.Rule], *,
          algorithm_options: tuple[str, tuple[str, ...]] | None = None) -> Callable[[], None]:
    """Makes ``names`` the valid values of ``choice_key`` and adds ``rules`` ({dotted key: Rule})
    to `config.VALUE_RULES`; ``algorithm_options`` (name, keys) enters an algorithm's own options
    in `config.ALGORITHM_OPTIONS` (the keys `launch.train` warns about under another algorithm).
    Returns a function that restores both tables as they were."""
    saved = {key: config_lib.VALUE_RULES.get(key) for key in [choice_key, *rules]}
    config_lib.VALUE_RULES[choice_key] = config_lib.one_of(*names)
    config_lib.VALUE_RULES.update(rules)
    if algorithm_options is not None:
        name, keys = algorithm_options
        saved_options = config_lib.ALGORITHM_OPTIONS.get(name)
        config_lib.ALGORITHM_OPTIONS[name] = tuple(keys)

    def undo() -> None:
        for key, rule in saved.items():
            if rule is None:
                config_lib.VALUE_RULES.pop(key, None)
            else:
                config_lib.VALUE_RULES[key] = rule
        if algorithm_options is not None:
            if saved_options is None:
                config_lib.ALGORITHM_OPTIONS.pop(algorithm_options[0], None)
            else:
                config_lib.ALGORITHM_OPTIONS[algorithm_options[0]] = saved_options
    return undo


Entry = TypeVar("Entry")


class Registry(Generic[Entry]):
    """The entries one config key chooses between (``rl.algorithm``, ``optimizer.name``), by name.

    ``table``: the built-in entries, each with a ``name``; ``what``: how an error names an entry
    ("an RL algorithm"); ``rules_of``: an entry → its {dotted key: Rule}; ``options_of``: an entry
    → its (name, keys) of `config.ALGORITHM_OPTIONS`, for a registry whose entries have options.
    """

    def __init__(self, choice_key: str, what: str, entries: Iterable[Entry], *,
                 rules_of: Callable[[Entry], Mapping[str, config_lib.Rule]],
                 options_of: Callable[[Entry], tuple[str, tuple[str, ...]]] | None = None):
        self.choice_key, self.what = choice_key, what
        self.table: dict[str, Entry] = {e.name: e for e in entries}
        self._rules_of, self._options_of = rules_of, options_of
        self._undo: dict[str, Callable[[], None]] = {}

    def names(self) -> tuple[str, ...]:
        return tuple(self.table)

    def get(self, name: str) -> Entry:
        """The entry ``name``; ValueError listing the known ones."""
        if name not in self.table:
            raise ValueError(f"{self.choice_key} must be one of {', '.join(map(repr, self.table))}, "
                             f"got {name!r}")
        return self.table[name]

    def register(self, entry: Entry) -> Entry:
        """Adds ``entry``: ``<choice key>=<its name>`` then chooses it, and its own keys are checked
        by their rules with the rest of the config. A name already taken is an error (`unregister`
        it first)."""
        if entry.name in self.table:
            raise ValueError(f"{self.what} named {entry.name!r} is already registered")
        self.table[entry.name] = entry
        self._undo[entry.name] = admit(
            self.choice_key, self.table, self._rules_of(entry),
            algorithm_options=self._options_of(entry) if self._options_of else None)
        return entry

    def unregister(self, name: str) -> None:
        """Removes an entry `register` added (the built-in ones stay), and its rules."""
        if name not in self._undo:
            raise ValueError(f"{name!r} was not registered from outside the package")
        del self.table[name]
        self._undo.pop(name)()
        if self._undo:   # others registered after it: their names stay valid
            admit(self.choice_key, self.table, {})
