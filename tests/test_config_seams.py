"""What a config key says reaches the code that uses it: LoRA's scale α / r, GaLore's ``scale``
and GRPO's ``rl.kl_estimator``, each read through the run's own assembly (`assembly.Recipe`),
not the library function the key is meant for (each of those has its own tests). A key dropped
on the way — the library's default used instead — trains without complaint and only shows here.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models import Decoder
from logra_jax.optim.lora import LORA_KEY, init_adapters, merge_adapters
from logra_jax.rl import assembly, build, losses
from logra_jax.rl.policy import Policy, Sequences
from logra_jax.tree_paths import leaves_with_paths
from tiny_config import tiny_config

TARGETS = r"layers/(self_attn|mlp)/\w+_proj/kernel"


@pytest.fixture(scope="module")
def tiny_model():
    config = tiny_config()
    model = Decoder(build.build_model_config(config.model), rngs=nnx.Rngs(0))
    return model, Policy.params_of(model)


@functools.partial(jax.jit, static_argnums=0)
def _logits(policy, params, seqs):
    return policy.completion_logits(params, seqs)


def _plan(config):
    """The run's parts from shapes (`Recipe.abstract`): its policy, optimizer and update, as the
    trainer assembles them, without building or compiling anything."""
    recipe = assembly.Recipe.checked(config)
    mesh, rollout_mesh = recipe.meshes()
    return recipe, recipe.abstract(mesh, rollout_mesh)


def test_the_runs_lora_adapters_apply_alpha_over_rank(tiny_model):
    """optimizer.lora rank 4, alpha 24: the run's policy computes the model at W + (α / r)·Aᵀ·Bᵀ
    (s = 6), not at α (24) or 1. The adapters' B is drawn nonzero (as after training)."""
    model, params = tiny_model
    rank, alpha = 4, 24.0
    config = tiny_config(dict(optimizer=dict(name="lora", lora=dict(rank=rank, alpha=alpha,
                                                                     targets=TARGETS))))
    _, plan = _plan(config)
    adapters = init_adapters(params, TARGETS, rank=rank, seed=1)
    keys = iter(jax.random.split(jax.random.PRNGKey(3), len(adapters)))
    adapters = {k: {"a": v["a"], "b": 0.3 * jax.random.normal(next(keys), v["b"].shape)}
                for k, v in adapters.items()}
    with_adapters = dict(params, **{LORA_KEY: adapters})
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, model.config.vocab_size)
    seqs = Sequences(tokens=tokens, segment_mask=jnp.ones((2, 12), bool),
                     positions=jnp.broadcast_to(jnp.arange(12), (2, 12)),
                     completion_mask=jnp.ones((2, 6), bool), prompt_length=6)
    runs = _logits(plan.policy, with_adapters, seqs)
    plain = Policy(model)
    for scale in (alpha, 1.0):   # what a dropped division would apply: visibly other logits
        other = _logits(plain, merge_adapters(with_adapters, scale), seqs)
        assert float(jnp.abs(runs - other).max()) > 1e-2, scale
    # float32 logits of the same sums in another order (branch vs merged kernel): 2e-5.
    np.testing.assert_allclose(runs, _logits(plain, merge_adapters(with_adapters, alpha / rank), seqs),
                               atol=2e-5, rtol=0)


def test_the_runs_galore_applies_its_configured_scale(tiny_model):
    """optimizer.galore.scale = 0.5: the run's optimizer makes each projected (target) update half
    of what scale 1 makes from the same gradient — exactly, a power of two — and leaves the AdamW
    part (the rest) as it is."""
    _, params = tiny_model
    params = {"layers": params["layers"]}   # the targets and some of the rest: enough, and small
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.PRNGKey(p.size), p.shape, p.dtype),
                         params)

    def first_update(scale):
        config = tiny_config(dict(optimizer=dict(name="galore", galore=dict(
            scale=scale, rank=4, targets=TARGETS, projector="randomized"))))
        tx = assembly.Recipe.checked(config).optimizer.tx
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        return dict(leaves_with_paths(jax.device_get(updates)))

    one, half = first_update(1.0), first_update(0.5)
    targets = [p for p in one if "_proj/kernel" in p]
    assert targets and set(one) == set(half)
    for path in one:
        assert np.any(one[path] != 0), path
        want = 0.5 * one[path] if path in targets else one[path]
        np.testing.assert_array_equal(half[path], want, err_msg=path)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_runs_grpo_loss_uses_the_configured_kl_estimator(estimator):
    """rl.kl_estimator reaches the run's loss: with β = 0.1 and reference log-probs apart from the
    policy's, its loss and `kl` metric are `losses.grpo_loss`'s with that estimator — and the three
    estimators give three different values here, so a loss that kept the default (k3) fails."""
    config = tiny_config(dict(rl=dict(algorithm="grpo", beta=0.1, kl_estimator=estimator),
                              optimizer=dict(name="adamw")))
    _, plan = _plan(config)
    rng = np.random.default_rng(0)
    logp = jnp.asarray(-rng.uniform(0.1, 3.0, (4, 5)), jnp.float32)
    ref = jnp.asarray(-rng.uniform(0.1, 3.0, (4, 5)), jnp.float32)
    batch = types.SimpleNamespace(
        advantages=jnp.asarray(rng.standard_normal(4), jnp.float32), ref_logp=ref,
        seqs=types.SimpleNamespace(completion_mask=jnp.ones((4, 5), bool)))
    loss, metrics = plan.update.loss(logp, batch)
    each = {name: losses.grpo_loss(logp, logp, batch.advantages, batch.seqs.completion_mask,
                                   ref_logp=ref, beta=0.1, kl_estimator=name)
            for name in ("k1", "k2", "k3")}
    assert len({float(m["kl"]) for _, m in each.values()}) == 3
    want_loss, want_metrics = each[estimator]
    np.testing.assert_array_equal(loss, want_loss)
    np.testing.assert_array_equal(metrics["kl"], want_metrics["kl"])
