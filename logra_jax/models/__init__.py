"""The policy model: a Llama-family NNX decoder, its KV cache, loaders, tokenizer and log-prob helper."""

from logra_jax.models.config import ModelConfig
from logra_jax.models.kv_cache import KVCache
from logra_jax.models.llama import Decoder
from logra_jax.models.logprobs import token_logprobs
from logra_jax.models.pretrained import from_pretrained, model_from_weights
from logra_jax.models.tokenizer import Tokenizer

__all__ = ["ModelConfig", "Decoder", "KVCache", "from_pretrained", "model_from_weights", "Tokenizer",
           "token_logprobs"]
