"""The policy as pure functions of a params dict, so jitted code takes weights as arguments.

The trainer, the reference model and the sampler all hold plain nested dicts of arrays (what the
optimizer sees); `Policy.bind` rebuilds the NNX module around them inside a traced function.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from logra_jax.models.logprobs import token_logprobs
from logra_jax.optim.lora import LORA_KEY, adapter_probes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sequences:
    """Prompt + completion rows as the model sees them.

    tokens/segment_mask/positions are [b, P + C]; ``completion_mask`` [b, C] marks generated tokens
    (through EOS). ``prompt_length`` P is static: completions start at the same column in every row
    because prompts are left-aligned.
    """

    tokens: jax.Array
    segment_mask: jax.Array
    positions: jax.Array
    completion_mask: jax.Array
    prompt_length: int = dataclasses.field(metadata=dict(static=True))

    @property
    def completions(self) -> jax.Array:
        return self.tokens[:, self.prompt_length:]

    @classmethod
    def from_sample(cls, prompt_tokens, prompt_mask, completion_tokens, completion_mask):
        """Joins left-aligned prompts and their completions; positions count real tokens only."""
        tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
        mask = jnp.concatenate([prompt_mask, completion_mask], axis=1)
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
        return cls(tokens=tokens.astype(jnp.int32), segment_mask=mask, positions=positions,
                   completion_mask=completion_mask, prompt_length=prompt_tokens.shape[1])


class Policy:
    """Binds params dicts to one model graph.

    Args:
      model: a built `Decoder`; only its graph and parameter shapes are kept (no arrays), so
        holding a Policy does not pin the initial weights in memory.
      lora_scale: s = α/r of LoRA adapters held in ``params["lora"]`` (optim/lora.py); every call
        then runs the base model with its adapters as probes. None: params hold no adapters.
    """

    def __init__(self, model: nnx.Module, lora_scale: float | None = None):
        self.lora_scale = lora_scale
        self.graphdef, state = nnx.split(model)
        extra = [jax.tree_util.keystr(p) for p, v in nnx.to_flat_state(state)
                 if not isinstance(v, nnx.Param)]
        if extra:
            raise ValueError(f"the policy model holds non-parameter state {extra}; "
                             "a Policy expects parameters only")
        self._skeleton = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)

    @staticmethod
    def params_of(model: nnx.Module) -> dict:
        """The model's parameters as a nested dict of arrays (the optimizer's view)."""
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def bind(self, params: dict) -> nnx.Module:
        """The base model holding ``params`` (LoRA adapters, if any, are not part of it: `probes`)."""
        state = jax.tree.map(lambda x: x, self._skeleton)
        nnx.replace_by_pure_dict(state, {k: v for k, v in params.items() if k != LORA_KEY})
        return nnx.merge(self.graphdef, state)

    def probes(self, params: dict, probes=None):
        """``probes`` plus the LoRA adapters of ``params`` (None when there are neither)."""
        if LORA_KEY not in params:
            return probes
        if self.lora_scale is None:
            raise ValueError("params hold LoRA adapters but this Policy has no lora_scale")
        return dict(probes or {}, **adapter_probes(params[LORA_KEY], self.lora_scale))

    def hidden(self, params: dict, seqs: Sequences, probes=None) -> jax.Array:
        """Final-normed hidden states at the positions that predict each completion token."""
        model = self.bind(params)
        hidden = model(seqs.tokens, positions=seqs.positions, segment_mask=seqs.segment_mask,
                       probes=self.probes(params, probes), return_hidden=True)
        return hidden[:, seqs.prompt_length - 1:-1]

    def completion_logprobs(self, params: dict, seqs: Sequences, *, probes=None,
                            temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
        """log π(token | prefix) and the entropy of π, at temperature T, per completion token."""
        hidden = self.hidden(params, seqs, probes)
        head = self.bind(params).head_kernel()
        return token_logprobs(hidden, head, seqs.completions, temperature=temperature)

    def completion_logits(self, params: dict, seqs: Sequences, *, probes=None) -> jax.Array:
        """Full logits [b, C, V] at completion positions (small probe batches only)."""
        hidden = self.hidden(params, seqs, probes)
        head = self.bind(params).head_kernel()
        return jnp.einsum("btd,dv->btv", hidden.astype(jnp.float32), head.astype(jnp.float32))
