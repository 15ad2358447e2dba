"""Training data: GSM8K from local files (tfds), reasoning-gym task generators, chat prompts and a
checkpointable, deterministic batch iterator.

The two sources pull in heavy libraries, each only for itself: ``load_gsm8k`` tensorflow_datasets,
``make_task_source`` reasoning_gym (the ``rl`` extra; it needs the C extension pycosat). So their
modules are loaded on first use, not here: the memory planner, the benchmarks and the export read
no data and need neither installed, a GSM8K run never imports reasoning_gym, a task run never
imports tensorflow_datasets (tests/test_install.py).
"""

import importlib

from logra_jax.data.example import Example, ExampleSource, SubsetSource
from logra_jax.data.iterator import PromptIterator
from logra_jax.data.prompts import DEFAULT_INSTRUCTION, format_prompt

# name → the submodule that defines it, imported when the name is first read (PEP 562).
_ON_FIRST_USE = {"load_gsm8k": "gsm8k", "TASKS": "tasks", "make_task_source": "tasks"}


def __getattr__(name: str):
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_ON_FIRST_USE[name]}"), name)


__all__ = ["DEFAULT_INSTRUCTION", "Example", "ExampleSource", "PromptIterator", "TASKS",
           "SubsetSource", "format_prompt", "load_gsm8k", "make_task_source"]
