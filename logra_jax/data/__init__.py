"""Training data: GSM8K from local files (tfds), reasoning-gym task generators, chat prompts and a
checkpointable, deterministic batch iterator."""

from logra_jax.data.example import Example, ExampleSource, SubsetSource
from logra_jax.data.gsm8k import load_gsm8k
from logra_jax.data.iterator import PromptIterator
from logra_jax.data.prompts import DEFAULT_INSTRUCTION, format_prompt
from logra_jax.data.tasks import TASKS, make_task_source

__all__ = ["DEFAULT_INSTRUCTION", "Example", "ExampleSource", "PromptIterator", "TASKS",
           "SubsetSource", "format_prompt", "load_gsm8k", "make_task_source"]
