"""Batched generation with a preallocated KV cache, under one jit, with params as a traced argument.

Weights are an argument: `Sampler.generate(params, ...)` binds the params dict to the model graph
inside the jitted function (`Policy.bind`), so new weights of the same shapes and dtypes reuse the
compiled program.

Prompts are left-aligned internally: every row's last prompt token sits in the last prompt slot,
so one decode position serves the whole batch. RoPE positions count real tokens only
(position = number of real tokens before it), so left padding does not shift a row's positions.

Rows are split over the params' ``fsdp`` axis as in training: on an accelerator `generate` traces
under the params' mesh, so the model's `sharding.shard_batch` constraints hold. Without them the
TPU compiler kept the prefill's activations whole on every chip (weights stay split along
``embed``, so it may sum partial products instead of gathering weights): at Qwen2.5-7B's shape,
two MLP intermediates of all 128 rows × 512 prompt tokens × 18944, 2.3 GiB each per chip on any
number of chips.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from logra_jax.models import decode_kernels
from logra_jax.projections import check_counter_range
from logra_jax.rl import decode_mode
from logra_jax.rl.policy import Policy
from logra_jax.rl.sampler.draw import draw
from logra_jax.rl.sampler.output import SampleOutput
from logra_jax.rl.sampler.prompts import decode_completions, left_align, pad_prompts
from logra_jax.rl.sampler.slots import default_prompt_slots, generate_in_slots
from logra_jax.sharding import mesh_of

# Decode steps a GPU takes between two reads of "is a row still going?" (`Sampler`'s in_chunks):
# every read is a device-to-host copy that stalls the queue; 16 keeps the discarded passes after
# the last row's end under 16 of a call's C − 1 (2 % of a 768-token completion).
DECODE_CHUNK = 16
CHUNKED_PLATFORMS = ("cuda", "rocm")   # `jax.lax.platform_dependent`'s names for the GPUs


def _platform(leaves) -> str:
    """The platform of the first placed array (or ShapeDtypeStruct) of ``leaves``, else JAX's
    default backend: "cpu", "gpu", "tpu"."""
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            return next(iter(sharding.device_set)).platform
    return jax.default_backend()


class Sampler:
    """Generates completions for a model whose weights change between calls.

    Args:
      policy: the model graph (weights come with every call as a params dict).
      max_prompt_length, max_completion_length: static sizes of the prompt window and the cache.
      eos_ids: token ids that end a completion.
      pad_id: id written in padded slots.
      decode_weights: how the decode steps read the layer stack. "stacked": the layers scan over
        the stacked weights and cache, as in training. "per_layer": the prompt is prefilled that
        way, then the weights and the cache are split into one array per layer, once per call,
        and each decode step runs the layers one after the other on those arrays. Both update
        the KV cache in place, one slot per layer and token. XLA's CPU backend copies a scanned
        layer's weights out of the stack before every dot, and XLA:GPU's matmuls do too on one
        GPU, so a stacked decode step moves each weight more than once there (XLA:CPU: per_layer
        1.3× faster at batch 16 on SmolLM2, docs/results/sampler.md); the price of per_layer is
        a second copy of the layer weights while sampling, and a longer compile. "auto"
        (``rl.decode_weights``' default): `decode_mode.rule` of the platform and device count
        the call runs on (per_layer on XLA:CPU and on one GPU, stacked on a TPU and on weights
        split over several GPUs), logged once; never a clock, so a run and its repeat run the
        same program. A plan lowered for another machine takes the rule of that machine. The
        default here is "per_layer": a bare Sampler (tests, tools) compiles the one program its
        caller asked for.
      engine: "static" (this class's own loop: every row prefilled, a pass decoded until its
        longest row ends) or "slots" (`slots.generate_in_slots`: each group's prompt prefilled
        and held once, rows flowing through ``slots`` decode slots refilled as rows end, the
        attention bounded by the live length). ``group_size`` (rl.num_generations): adjacent
        rows sharing a prompt; ``slots``: decode slots (0: the whole batch); ``prompt_slots``:
        groups held at once (0: twice the groups the slots hold, at most the batch's groups).
      rows_per_pass: 0 (default) generates the whole batch in one pass. n > 0 generates it n rows at
        a time, one pass after the other inside the same program, so the KV cache and the decode's
        activations hold n rows (``rl.rollout_micro_batch``; what lets a 70B rollout batch of 128
        fit one v6e-8 host, docs/results/memory.md). Pass j takes rows j, j + k, j + 2k, … (k =
        batch / n passes): each device's own rows split among the passes, so splitting moves no
        data between devices when n is a multiple of the batch's shards. Each row draws the same
        noise as in one pass (`draw`: keyed by the row and the token's position), so the tokens are
        the one-pass tokens wherever the model computes a row's logits independently of the
        batch size (up to a near-tie of perturbed logits where a kernel sums in another order).
    """

    DECODE_WEIGHTS = ("auto", "per_layer", "stacked")
    ENGINES = ("static", "slots")

    def __init__(self, policy: Policy, *, max_prompt_length: int, max_completion_length: int,
                 eos_ids: Sequence[int], pad_id: int, decode_weights: str = "per_layer",
                 rows_per_pass: int = 0, engine: str = "static", group_size: int = 1,
                 slots: int = 0, prompt_slots: int = 0):
        if max_prompt_length <= 0 or max_completion_length <= 0:
            raise ValueError("max_prompt_length and max_completion_length must be positive, got "
                             f"{max_prompt_length} and {max_completion_length}")
        if not eos_ids:
            raise ValueError("eos_ids must name at least one end-of-sequence token")
        if decode_weights not in self.DECODE_WEIGHTS:
            raise ValueError(f"decode_weights must be one of {self.DECODE_WEIGHTS}, got "
                             f"{decode_weights!r}")
        if rows_per_pass < 0:
            raise ValueError(f"rows_per_pass must be 0 (one pass) or positive, got {rows_per_pass}")
        if engine not in self.ENGINES:
            raise ValueError(f"the rollout engine must be one of {self.ENGINES}, got {engine!r}")
        self.engine = engine
        self.group_size, self.slots, self.prompt_slots = int(group_size), int(slots), int(prompt_slots)
        self.decode_weights = decode_weights
        # True / False for a fixed mode; None for "auto", decided per input signature:
        self.per_layer_decode = None if decode_weights == "auto" else decode_weights == "per_layer"
        self.preset: str | None = None             # "auto" held to a resumed run's recorded mode
        self._logged: set[tuple[str, int]] = set()  # (platform, devices) whose rule was logged
        self.last_decode_mode: str | None = None   # the mode the latest call ran
        self.policy = policy
        self.max_prompt_length = max_prompt_length
        self.max_completion_length = max_completion_length
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.pad_id = int(pad_id)
        self.rows_per_pass = int(rows_per_pass)
        self._generate = jax.jit(self._generate_impl,
                                 static_argnames=("top_k", "top_p", "greedy", "mesh", "per_layer"))
        self.program = self._generate   # the jitted generate, for planners that lower it

    def generate(self, params, prompt_tokens, prompt_mask, rng, *, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
                 lengths=None) -> SampleOutput:
        """Samples one completion per row with the given weights (any values, fixed shapes).
        ``lengths`` (ints [b], optional): the most tokens each row may draw (a benchmark's
        completion-length schedule); a row that reaches its length ends unfinished."""
        if prompt_tokens.shape[1] != self.max_prompt_length:
            raise ValueError(f"prompt_tokens has length {prompt_tokens.shape[1]}, the sampler was built "
                             f"for max_prompt_length={self.max_prompt_length}; pad with pad_prompts()")
        if not greedy and not temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if self.rows_per_pass and prompt_tokens.shape[0] % self.rows_per_pass:
            raise ValueError(f"a batch of {prompt_tokens.shape[0]} rows does not split into passes "
                             f"of rows_per_pass={self.rows_per_pass}; make it a divisor")
        args = (params, jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask), rng,
                jnp.float32(temperature))
        static = dict(top_k=int(top_k), top_p=float(top_p), greedy=bool(greedy),
                      mesh=self.mesh_of(params, prompt_tokens))
        self.last_decode_mode = self._decode_mode(jax.tree.leaves(args), static["mesh"])
        per_layer = self.last_decode_mode == "per_layer"
        limit = jnp.int32(self.max_completion_length) if lengths is None else jnp.asarray(
            lengths, jnp.int32)
        return self._generate(*args, limit, per_layer=per_layer,
                              **static)

    def prefilled_rows(self, batch: int) -> int:
        """How many prompts a call of ``batch`` rows prefills: every row's (static), or one per
        group of ``group_size`` rows (slots)."""
        return batch // self.group_size if self.engine == "slots" else batch

    def preset_decode_mode(self, mode: str) -> None:
        """"auto" runs ``mode`` from now on: a resumed run keeps the program its workdir records
        (one written by an older version, whose pick was timed, or on another platform; the two
        programs round differently, so another program would change the run's numbers)."""
        if mode not in decode_mode.MODES:
            raise ValueError(f"decode mode must be one of {decode_mode.MODES}, got {mode!r}")
        self.preset = mode

    def _decode_mode(self, leaves, mesh=None) -> str:
        """"stacked" or "per_layer" for a call of ``leaves`` traced under ``mesh``: the fixed
        mode; for "auto" a preset one, else `decode_mode.rule` on the platform and devices the
        call traces for (``mesh``, else where ``leaves`` are placed), logged once per rule."""
        if self.per_layer_decode is not None:
            return "per_layer" if self.per_layer_decode else "stacked"
        if self.preset is not None:
            return self.preset
        platform = mesh.abstract_device.platform if mesh is not None else _platform(leaves)
        devices = mesh.size if mesh is not None else max(
            [len(x.sharding.device_set) for x in leaves if getattr(x, "sharding", None)] or [1])
        mode = decode_mode.rule(platform, devices)
        if (platform, devices) not in self._logged:
            self._logged.add((platform, devices))
            logging.info(decode_mode.describe(mode, platform, devices))
        return mode

    @staticmethod
    def mesh_of(params, prompt_tokens):
        """The abstract mesh `generate` traces under: the one the params and prompts lie on. None
        when they are on one device, or on XLA:CPU's devices: there XLA's own layout is the
        faster one (8 simulated devices sharing 2 cores, SmolLM2's shape, 16 rows: split rows
        took 1.13× its time), and the memory that splitting saves matters on an accelerator."""
        mesh = mesh_of((params, prompt_tokens))
        if mesh is None or mesh.devices.flat[0].platform == "cpu":
            return None
        return mesh.abstract_mesh

    def generate_text(self, params, tokenizer, prompts: Sequence[str], rng, **kwargs) -> list[str]:
        """Convenience: strings in, decoded completions out (EOS and padding dropped)."""
        tokens, mask = pad_prompts([tokenizer.encode(p) for p in prompts], self.max_prompt_length,
                                   self.pad_id)
        out = self.generate(params, tokens, mask, rng, **kwargs)
        return decode_completions(tokenizer, np.asarray(out.tokens), np.asarray(out.mask), self.eos_ids)

    def _generate_impl(self, params, prompt_tokens, prompt_mask, rng, temperature, limit=None, *,
                       top_k: int, top_p: float, greedy: bool, mesh=None,
                       per_layer: bool | None = None) -> SampleOutput:
        """The whole batch, traced with the params' ``mesh`` in context (``shard_batch``).

        ``limit``: draw at most this many tokens (an int32 scalar, or [b] one per row); None:
        max_completion_length.
        ``per_layer``: the decode mode; None (a program lowered without `generate`, a plan): the
        fixed mode, or for "auto" `decode_mode.rule` of the machine it is lowered for."""
        if per_layer is None:
            per_layer = self._decode_mode(jax.tree.leaves((params, prompt_tokens, prompt_mask)),
                                          mesh) == "per_layer"
        # One GPU decodes with q, k and v's kernels held as one (`llama.fuse_qkv_kernels`); split
        # over several devices they would be re-split for the concatenation.
        platform = mesh.abstract_device.platform if mesh is not None else _platform(
            jax.tree.leaves(params))
        fuse_qkv = per_layer and platform == "gpu" and (mesh is None or mesh.size == 1)
        kwargs = dict(top_k=top_k, top_p=top_p, greedy=greedy, limit=limit, per_layer=per_layer,
                      fuse_qkv=fuse_qkv)
        if mesh is None:
            return self._generate_batch(params, prompt_tokens, prompt_mask, rng, temperature,
                                        **kwargs)
        with jax.sharding.use_abstract_mesh(mesh):
            return self._generate_batch(params, prompt_tokens, prompt_mask, rng, temperature,
                                        **kwargs)

    def _generate_batch(self, params, prompt_tokens, prompt_mask, rng, temperature, *,
                        top_k: int, top_p: float, greedy: bool, limit, per_layer: bool,
                        fuse_qkv: bool) -> SampleOutput:
        """Every row, in one pass or ``rows_per_pass`` at a time."""
        batch = prompt_tokens.shape[0]
        check_counter_range((batch, self.policy.bind(params).config.vocab_size))
        columns = self.max_completion_length
        limits = jnp.broadcast_to(columns if limit is None else jnp.minimum(columns, limit),
                                  (batch,)).astype(jnp.int32)
        if self.engine == "slots":
            model = self.policy.bind(params)
            slots = self.slots or batch
            return generate_in_slots(
                model, self.policy.probes(params), prompt_tokens, prompt_mask, rng, temperature,
                group_size=self.group_size, slots=slots,
                prompt_slots=self.prompt_slots or default_prompt_slots(batch, slots, self.group_size),
                max_completion_length=self.max_completion_length, eos_ids=self.eos_ids,
                pad_id=self.pad_id, top_k=top_k, top_p=top_p, greedy=greedy, limits=limits,
                layers=model.unstacked_layers(fuse_qkv=fuse_qkv),
                kernels=fuse_qkv and decode_kernels.fits(model.config))
        rows = jnp.arange(batch, dtype=jnp.int32)
        per_pass = self.rows_per_pass or batch
        passes = batch // per_pass
        kwargs = dict(top_k=top_k, top_p=top_p, greedy=greedy, per_layer=per_layer,
                      fuse_qkv=fuse_qkv)
        if passes == 1:
            return self._generate_rows(params, prompt_tokens, prompt_mask, rows, limits, rng,
                                       temperature, **kwargs)

        def split(x):   # [batch, …] → [passes, per_pass, …]; pass j holds rows j, j + passes, …
            return jnp.swapaxes(x.reshape(per_pass, passes, *x.shape[1:]), 0, 1)

        def one_pass(_, part):
            tokens, mask, part_rows, part_limits = part
            return None, self._generate_rows(params, tokens, mask, part_rows, part_limits, rng,
                                             temperature, **kwargs)

        _, out = jax.lax.scan(one_pass, None, (split(prompt_tokens), split(prompt_mask), split(rows),
                                               split(limits)))
        return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(batch, *x.shape[2:]), out)

    def _generate_rows(self, params, prompt_tokens, prompt_mask, rows, limits, rng, temperature,
                       *, top_k: int, top_p: float, greedy: bool, per_layer: bool,
                       fuse_qkv: bool) -> SampleOutput:
        """One pass over ``rows`` of the batch: prefill, then decode until every row has ended;
        ``fuse_qkv``: per-layer decode weights on one GPU, with q, k and v's kernels as one and,
        for a model `decode_kernels.fits`, each layer's norms and attention as its kernels."""
        model = self.policy.bind(params)
        probes = self.policy.probes(params)   # LoRA adapters, if the params hold any
        batch, prompt_len = prompt_tokens.shape
        steps = self.max_completion_length
        prompt_tokens, prompt_mask = left_align(prompt_tokens, prompt_mask, self.pad_id)
        positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0).astype(jnp.int32)
        next_position = jnp.sum(prompt_mask, axis=1).astype(jnp.int32)           # [b]

        cache = model.init_cache(batch, prompt_len + steps)
        # Prefill: only the last position's logits are needed, so the head runs on that one
        # hidden state (full-vocabulary logits of every prompt position would be b × t × V).
        # Logits are [V, b], vocabulary first, here and in every decode step (vocab_major_logits).
        hidden, cache = model(prompt_tokens, positions=positions, segment_mask=prompt_mask,
                              cache=cache, return_hidden=True, probes=probes, prefill=True)
        last_logits = model.vocab_major_logits(hidden[:, -1])
        layers = None
        if per_layer:   # once per call: every decode step reads these arrays in place
            layers = model.unstacked_layers(fuse_qkv=fuse_qkv)
            cache = cache.unstacked()
        kernels = fuse_qkv and decode_kernels.fits(model.config)
        eos = jnp.asarray(self.eos_ids, jnp.int32)

        def choose(step, cache, logits_t, done, position, tokens, logprobs, mask,
                   active=None):
            """Draws token ``step`` of every row from ``logits_t`` and records it; with ``active``
            (a chunk's step, `in_chunks`) only where it is True, the step counter left as it was
            otherwise."""
            token, logprob = draw(logits_t, rng, jnp.broadcast_to(step, (batch,)), rows,
                                  temperature=temperature, greedy=greedy, top_k=top_k, top_p=top_p)
            if active is None:
                valid = ~done
                token = jnp.where(valid, token, self.pad_id)
                tokens = tokens.at[:, step].set(token)
                logprobs = logprobs.at[:, step].set(jnp.where(valid, logprob, 0.0))
                mask = mask.at[:, step].set(valid)
                done = done | jnp.isin(token, eos) | (step + 1 >= limits)
                return step, cache, done, position, tokens, logprobs, mask, token, valid
            valid = ~done & active
            token = jnp.where(valid, token, self.pad_id)
            column = jnp.where(active, step, steps)   # past the last column: dropped
            tokens = tokens.at[:, column].set(token, mode="drop")
            logprobs = logprobs.at[:, column].set(jnp.where(valid, logprob, 0.0), mode="drop")
            mask = mask.at[:, column].set(valid, mode="drop")
            done = done | (valid & (jnp.isin(token, eos) | (step + 1 >= limits)))
            step = jnp.where(active, step, step - 1)
            return step, cache, done, position, tokens, logprobs, mask, token, valid

        last = jnp.max(limits)

        def more(carry):
            """Whether another draw is due: a row is still going and a column is left."""
            step, _, done = carry[:3]
            return (step + 1 < last) & ~jnp.all(done)

        def decode(carry, chunked: bool = False):
            """The forward pass of the last drawn tokens, then the next draw from its logits."""
            step, cache, done, position, tokens, logprobs, mask, token, valid = carry
            active = more(carry) if chunked else None
            hidden, cache = model(token[:, None], positions=position[:, None],
                                  segment_mask=valid[:, None], cache=cache, probes=probes,
                                  layers=layers, return_hidden=True, kernels=kernels)
            return choose(step + 1, cache, model.vocab_major_logits(hidden[:, -1]), done,
                          position + 1, tokens, logprobs, mask, active)

        def counted(body, forward_passes):
            """(the carry after ``body`` ran while a draw is due, the forward passes it ran): the
            count is the loop's own, ``forward_passes`` per trip, kept on the device."""
            def loop(carry):
                return jax.lax.while_loop(lambda c: more(c[0]),
                                          lambda c: (body(c[0]), c[1] + forward_passes),
                                          (carry, jnp.int32(0)))
            return loop

        def per_token(carry):
            """A forward pass runs only for a draw that reads its logits: C tokens take the
            prefill and at most C − 1 decode passes, and none follows the draw that ends the
            last row."""
            return counted(decode, 1)(carry)

        def in_chunks(carry):
            """DECODE_CHUNK decode steps at a time, each recording its draw only while one is
            due (`more`): the loop's test, which a GPU reads on the host, comes once per chunk,
            and the chunk is a loop of a known trip count that XLA:GPU may replay as one CUDA
            graph. The draws are `per_token`'s (keyed by the same positions); up to
            DECODE_CHUNK − 1 forward passes after the last one are computed and discarded (their
            cache writes land past every slot a recorded draw read)."""
            def chunk(carry):
                return jax.lax.fori_loop(0, DECODE_CHUNK, lambda _, c: decode(c, chunked=True), carry)
            return counted(chunk, DECODE_CHUNK)(carry)

        first = choose(jnp.int32(0), cache, last_logits, jnp.zeros((batch,), bool), next_position,
                       jnp.full((batch, steps), self.pad_id, jnp.int32),
                       jnp.zeros((batch, steps), jnp.float32), jnp.zeros((batch, steps), bool))
        # A GPU checks the loop's condition on the host: per chunk there, per token elsewhere
        # (XLA:CPU runs the loop on the host anyway, a TPU evaluates the condition on the chip).
        (_, _, _, _, tokens, logprobs, mask, _, _), forward_passes = jax.lax.platform_dependent(
            first, default=per_token, **dict.fromkeys(CHUNKED_PLATFORMS, in_chunks))
        return SampleOutput(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=tokens,
                            logprobs=logprobs, mask=mask,
                            finished=jnp.any(mask & jnp.isin(tokens, eos), axis=1),
                            token_steps=jnp.full((batch,), forward_passes + 1, jnp.int32))
