"""The real jitted update's gradient (logra_jax/rl/update.py) against one computed without it.

`PolicyUpdate` splits the batch into micro-batches, differentiates each with respect to the
probes' zero factors (targets: the sketch G·Aᵀ) and the other weights (dense), and sums in a scan.
Here the optimizer is identity-like — it records the gradient it is handed and changes nothing —
so the gradient of the whole update can be read back and compared with the gradient of the
whole-batch loss written out in this file: jax.grad of the dense model, the targets' then
multiplied by A in float64.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from logra_jax.models import Decoder
from logra_jax.models.config import tiny
from logra_jax.optim import SketchSpec
from logra_jax.optim.transforms import clip_by_reconstructed_norm
from logra_jax.projections import projection
from logra_jax.rl.policy import Policy, Sequences
from logra_jax.rl.algorithms.grpo import GRPOLoss
from logra_jax.rl.update import PolicyUpdate, TrainBatch
from logra_jax.tree_paths import leaves_with_paths

ROWS, PROMPT, COMPLETION = 6, 4, 5
SPEC = SketchSpec(rank=4, seed=7)
# sequence-mean: every row weighs the same, so the whole-batch loss is the mean of the
# micro-batches' losses whatever the rows' lengths (with token-mean only equal token counts are).
LOSS = GRPOLoss(loss_agg_mode="sequence-mean")


class SeenState(NamedTuple):
    grads: dict


def record_gradient():
    """Keeps the gradient it is given in its state and returns a zero update."""
    def init_fn(params):
        return SeenState(grads=jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates, state, params=None, **extra):
        del state, extra
        return jax.tree.map(jnp.zeros_like, params), SeenState(grads=updates)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _batch():
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(1, 96, (ROWS, PROMPT)), jnp.int32)
    completion = jnp.asarray(rng.integers(1, 96, (ROWS, COMPLETION)), jnp.int32)
    lengths = np.array([5, 1, 3, 5, 2, 4])   # rows of different lengths, none empty
    mask = jnp.asarray(np.arange(COMPLETION)[None, :] < lengths[:, None])
    seqs = Sequences.from_sample(prompt, jnp.ones_like(prompt, bool), completion, mask)
    advantages = jnp.asarray(rng.standard_normal(ROWS), jnp.float32)
    zeros = jnp.zeros((ROWS, COMPLETION), jnp.float32)
    return TrainBatch(seqs=seqs, advantages=advantages, rollout_logp=zeros, ref_logp=zeros,
                      completed=jnp.ones((ROWS,), bool))


@pytest.fixture(scope="module")
def setup():
    model = Decoder(tiny(), rngs=nnx.Rngs(0))
    policy = Policy(model)
    params = Policy.params_of(model)
    batch = _batch()

    def whole_batch_loss(params):
        """GRPO at ratio 1 (old = current log-probs), β = 0: its gradient is −A·∇log π,
        averaged over each row's tokens, then over the rows."""
        logp, _ = policy.completion_logprobs(params, batch.seqs)
        m = batch.seqs.completion_mask.astype(jnp.float32)
        per_row = jnp.sum(-batch.advantages[:, None] * logp * m, axis=1) / jnp.sum(m, axis=1)
        return jnp.mean(per_row)

    dense = {p: np.asarray(g, np.float64)
             for p, g in leaves_with_paths(jax.jit(jax.grad(whole_batch_loss))(params))}
    targets = SPEC.find_targets(params)
    expected = {}
    for path, g in dense.items():
        if path not in targets:
            expected[path] = g
            continue
        info = targets[path]
        keys = np.asarray(SPEC.keys(info, 0)).reshape(-1, 2)   # k = 0: the first update's A
        grads = g.reshape((-1, info.in_dim, info.out_dim))
        expected[path] = np.stack([
            (np.asarray(projection(jnp.asarray(key), info.rank, info.in_dim, SPEC.distribution),
                        np.float64) @ gl).T for key, gl in zip(keys, grads)]).reshape(info.sketch_shape)
    return policy, params, batch, expected, targets


@pytest.mark.parametrize("micro_batch_size", [ROWS, ROWS // 2])
def test_the_updates_gradient_is_the_whole_batch_gradient(setup, micro_batch_size):
    """At one micro-batch and at two, the gradient handed to the optimizer is G·Aᵀ at every target
    and jax.grad at every other weight, of the loss over the whole batch."""
    policy, params, batch, expected, targets = setup
    tx = optax.chain(clip_by_reconstructed_norm(SPEC), record_gradient())   # the first holds k
    step = PolicyUpdate(policy, tx, LOSS, micro_batch_size=micro_batch_size, probe_size=2,
                        sketch=SPEC)
    params = jax.tree.map(jnp.copy, params)   # donated
    _, opt_state, metrics = step(params, tx.init(params), batch)
    seen = {p: np.asarray(g, np.float64) for p, g in leaves_with_paths(opt_state[1].grads)}
    assert set(seen) == set(expected) and set(targets) < set(seen)
    for path, want in expected.items():
        assert seen[path].shape == want.shape, path
        scale = np.max(np.abs(want))
        assert scale > 0, path   # every weight has a gradient here, so a dropped one shows
        # float32 sums in another order: measured ≤ 4e-7 of the leaf's largest entry (XLA:CPU).
        np.testing.assert_allclose(seen[path], want, atol=4e-6 * scale, rtol=0, err_msg=path)
    norm = np.sqrt(sum(np.sum(g ** 2) for g in expected.values()))
    np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-5)
