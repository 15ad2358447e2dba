"""How an algorithm or optimizer registered from outside the package joins the config's schema.

logra_jax/config/values.py holds the one schema of a run's config: `config.VALUE_RULES`, a rule
per key, whose keys are also the keys a config may set (a config file or ``--config.*`` setting
any other is refused by name). It sits below the library, spells the built-in choices out
(``rl.algorithm``, ``optimizer.name``) and cannot ask the registries. Registering a new entry
therefore widens that table here: its name becomes a valid choice and its own keys exist, with
their rules, so a bad value of theirs is refused as early as a built-in key's. `admit` returns
the undo."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

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
