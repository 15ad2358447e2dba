"""decode_weights="auto": a rule of the platform and the device count (logra_jax/rl/decode_mode.py),
never a clock, so a run and its repeat on a loaded machine run the same program and draw the same
bits; a plan lowered without running takes the same rule."""

import logging

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
from slow_decode import SLOW, SlowablePolicy

PROMPT_LEN, STEPS, PAD = 8, 6, 0


def test_the_rule_follows_the_evidence():
    """XLA:CPU and one GPU: per_layer (a stacked step copies each layer's weights out of the
    stack there); a TPU and weights split over GPUs: stacked (no second copy of the weights)."""
    assert [decode_mode.rule("cpu", n) for n in (1, 8)] == ["per_layer"] * 2
    assert decode_mode.rule("gpu", 1) == "per_layer"
    assert [decode_mode.rule("gpu", 8), decode_mode.rule("tpu", 1), decode_mode.rule("tpu", 8)] == [
        "stacked"] * 3


@pytest.fixture(scope="module")
def model():
    decoder = Decoder(tiny(), rngs=nnx.Rngs(0))
    tokens, mask = pad_prompts([[5, 6, 7], [9, 10, 11, 12]], PROMPT_LEN, PAD)
    return Policy(decoder), Policy.params_of(decoder), tokens, mask


@pytest.mark.parametrize("slow", ["per_layer", "stacked"])
def test_auto_runs_the_rules_program_whichever_is_slowed(model, slow, caplog):
    """Whichever decode program is made slower (a loaded machine, as a clock would see it), auto
    runs the rule's, logs it once, and draws exactly what that mode draws alone. (A pick by timing
    took the other program when the rule's was slowed.)"""
    policy, params, tokens, mask = model
    sampler = Sampler(SlowablePolicy(policy), max_prompt_length=PROMPT_LEN,
                      max_completion_length=STEPS, eos_ids=[95], pad_id=PAD, decode_weights="auto")
    SLOW["mode"] = slow
    try:
        with caplog.at_level(logging.INFO):
            sampler.generate(params, tokens, mask, jax.random.PRNGKey(0))
            again = sampler.generate(params, tokens, mask, jax.random.PRNGKey(1))
    finally:
        SLOW["mode"] = None
    assert sampler.last_decode_mode == decode_mode.rule("cpu", 1) == "per_layer"
    lines = [r.getMessage() for r in caplog.records if "decode_weights=auto" in r.getMessage()]
    assert lines == [decode_mode.describe("per_layer", "cpu", 1)], lines
    fixed = Sampler(policy, max_prompt_length=PROMPT_LEN, max_completion_length=STEPS,
                    eos_ids=[95], pad_id=PAD, decode_weights="per_layer")
    reference = fixed.generate(params, tokens, mask, jax.random.PRNGKey(1))
    for field in ("tokens", "logprobs", "mask"):
        np.testing.assert_array_equal(getattr(again, field), getattr(reference, field))


def test_a_plan_compiled_without_running_takes_the_rule(model, caplog):
    """`program.lower` (launch.memory's path) lowers the program a run on that machine takes:
    on XLA:CPU the per-layer one."""
    policy, params, tokens, _ = model
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    args = (abstract, jax.ShapeDtypeStruct(tokens.shape, jnp.int32),
            jax.ShapeDtypeStruct(tokens.shape, jnp.bool_), jax.ShapeDtypeStruct((2,), jnp.uint32),
            jax.ShapeDtypeStruct((), jnp.float32))

    def lowered(mode):
        sampler = Sampler(policy, max_prompt_length=PROMPT_LEN, max_completion_length=STEPS,
                          eos_ids=[95], pad_id=PAD, decode_weights=mode)
        return sampler.program.lower(*args, top_k=0, top_p=1.0, greedy=False).as_text()

    with caplog.at_level(logging.INFO):
        auto = lowered("auto")
    assert [r.getMessage() for r in caplog.records if "decode_weights=auto" in r.getMessage()] == [
        decode_mode.describe("per_layer", "cpu", 1)]
    assert auto == lowered("per_layer") != lowered("stacked")
