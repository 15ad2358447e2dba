"""logra_jax: LoGRA (low-rank gradient sketches for LLM RL post-training) in JAX/Flax NNX."""

from logra_jax import versions

# Before any module imports flax: a flax too old for the installed jax fails deep inside flax with
# an AttributeError; this names the pair and the install that fixes it.
versions.check_installed()

__version__ = "0.1.0"
