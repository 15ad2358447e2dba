"""logra_jax: LoGRA (low-rank gradient sketches for LLM RL post-training) in JAX/Flax NNX."""

__version__ = "0.1.0"
