"""decode_weights="auto": the sampler measures both decode programs where it runs and keeps the
faster (logra_jax/rl/decode_mode.py); where nothing runs it picks without measuring, and says so."""

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models import Decoder
from logra_jax.models.config import tiny
from logra_jax.rl import decode_mode
from logra_jax.rl.policy import Policy
from logra_jax.rl.sampler import Sampler, pad_prompts

PROMPT_LEN, STEPS, PAD = 8, 6, 0


def test_the_estimate_weighs_the_split_against_the_steps_it_saves():
    """A per-layer call pays a fixed split and saves on every step: for short completions the
    stacked call is faster, for long ones the per-layer call; `pick` follows the estimate."""
    fixed = {"stacked": 0.010, "per_layer": 0.030}
    per_step = {"stacked": 0.004, "per_layer": 0.002}
    calls = []

    def time_call(mode, limit):   # a call drawing `limit` tokens: the fixed part, then decode steps
        calls.append((mode, limit))
        return fixed[mode] + (limit - 1) * per_step[mode]

    for tokens in (3, 100):
        seconds = decode_mode.estimate(time_call, tokens)
        for mode in decode_mode.MODES:
            assert seconds[mode] == pytest.approx(fixed[mode] + (tokens - 1) * per_step[mode])
        faster = min(decode_mode.MODES, key=lambda m: fixed[m] + (tokens - 1) * per_step[m])
        assert decode_mode.pick(seconds) == faster
    assert {decode_mode.pick(decode_mode.estimate(time_call, t)) for t in (3, 100)} == set(
        decode_mode.MODES)
    # Each mode, each round: a call stopped after its first token and one DECODE_STEPS longer.
    calls.clear()
    decode_mode.estimate(time_call, 100)
    assert sorted(calls) == sorted([(mode, limit) for mode in decode_mode.MODES
                                    for limit in (1, 1 + decode_mode.DECODE_STEPS)]
                                   * decode_mode.ROUNDS)
    assert decode_mode.estimate(time_call, 1) == fixed   # one token: no decode step to weigh


# A decode step of the mode named here sleeps: the measurement must see it and pick the other.
SLOW = {"mode": None, "seconds": 0.05}


def _slowed(mode: str, hidden):
    def sleep(x):
        if SLOW["mode"] == mode:
            time.sleep(SLOW["seconds"])
        return np.zeros_like(x)
    # Of the step's own hidden state (nothing XLA could hoist out of the decode loop), and a result
    # the step uses (the call cannot finish before the sleep does).
    return hidden + jax.pure_callback(sleep, jax.ShapeDtypeStruct((), hidden.dtype),
                                      hidden[0, 0, 0])


class SlowablePolicy:
    """The tiny model whose decode steps pass through `_slowed`: a per-layer step is one called
    with ``layers``, a stacked step one without ``layers`` that is not the prefill."""

    def __init__(self, inner):
        self.inner = inner

    def bind(self, params):
        model = self.inner.bind(params)
        original = type(model).__call__

        class Slowable(type(model)):
            def __call__(self, *args, layers=None, prefill=False, **kwargs):
                hidden, cache = original(self, *args, layers=layers, prefill=prefill, **kwargs)
                if not prefill:
                    hidden = _slowed("stacked" if layers is None else "per_layer", hidden)
                return hidden, cache

        model.__class__ = Slowable
        return model

    def probes(self, params, probes=None):
        return self.inner.probes(params, probes)


@pytest.fixture(scope="module")
def model():
    decoder = Decoder(tiny(), rngs=nnx.Rngs(0))
    tokens, mask = pad_prompts([[5, 6, 7], [9, 10, 11, 12]], PROMPT_LEN, PAD)
    return Policy(decoder), Policy.params_of(decoder), tokens, mask


@pytest.mark.parametrize("slow", ["per_layer", "stacked"])
def test_auto_measures_both_programs_and_keeps_the_faster(model, slow, caplog):
    """Whichever decode program is made slower, auto picks the other, once per input signature,
    logs one line with both timings, and draws exactly what the chosen mode draws alone."""
    policy, params, tokens, mask = model
    sampler = Sampler(SlowablePolicy(policy), max_prompt_length=PROMPT_LEN,
                      max_completion_length=STEPS, eos_ids=[95], pad_id=PAD, decode_weights="auto")
    SLOW["mode"] = slow
    try:
        with caplog.at_level(logging.INFO):
            out = sampler.generate(params, tokens, mask, jax.random.PRNGKey(0))
            again = sampler.generate(params, tokens, mask, jax.random.PRNGKey(1))
    finally:
        SLOW["mode"] = None
    ((mode, seconds),) = sampler.measured.values()       # measured once, on the first call
    fast = "stacked" if slow == "per_layer" else "per_layer"
    assert mode == fast, seconds
    assert seconds[slow] > seconds[fast] + (STEPS - 1) * SLOW["seconds"] / 2, seconds
    lines = [r.getMessage() for r in caplog.records if "decode_weights=auto" in r.getMessage()]
    assert len(lines) == 1 and f"auto: {fast} for 2 rows" in lines[0], lines
    assert all(f"{m} {seconds[m] * 1e3:.1f} ms" in lines[0] for m in decode_mode.MODES), lines
    # The measurement ran the call's own program, which the call then reused: the draws are the
    # fixed mode's, bit for bit.
    reference = sampler._generate(params, jnp.asarray(tokens), jnp.asarray(mask),
                                  jax.random.PRNGKey(1), jnp.float32(1.0), jnp.int32(STEPS),
                                  top_k=0, top_p=1.0, greedy=False, mesh=None,
                                  per_layer=fast == "per_layer")
    for field in ("tokens", "logprobs", "mask"):
        np.testing.assert_array_equal(getattr(again, field), getattr(reference, field))
    assert out.tokens.shape == (2, STEPS)


def test_a_plan_compiled_without_running_picks_stacked_and_says_so(model, caplog):
    """`_generate.lower` (launch.memory's path, for a TPU slice or a GPU planned from a CPU host)
    must not measure: auto lowers the stacked program, and logs that it did not measure."""
    policy, params, tokens, _ = model
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    args = (abstract, jax.ShapeDtypeStruct(tokens.shape, jnp.int32),
            jax.ShapeDtypeStruct(tokens.shape, jnp.bool_), jax.ShapeDtypeStruct((2,), jnp.uint32),
            jax.ShapeDtypeStruct((), jnp.float32))

    def lowered(mode):
        sampler = Sampler(policy, max_prompt_length=PROMPT_LEN, max_completion_length=STEPS,
                          eos_ids=[95], pad_id=PAD, decode_weights=mode)
        text = sampler._generate.lower(*args, top_k=0, top_p=1.0, greedy=False).as_text()
        assert not sampler.measured
        return text

    with caplog.at_level(logging.INFO):
        auto = lowered("auto")
    assert [r.getMessage() for r in caplog.records if "not measured" in r.getMessage()] == [
        "decode_weights=auto: stacked on cpu, not measured (lowered without running: a "
        "compile-only plan; a run measures both and may pick per_layer, which holds a second "
        "copy of the layer weights while sampling)"]
    assert auto == lowered("stacked") != lowered("per_layer")
