"""logra_jax.nnx_sketch on a transformer this repository did not write (tests/nnx_flax_lm.py: flax's
nnx.MultiHeadAttention, nnx.Linear and nnx.Einsum, a stack made by nnx.vmap and run by nnx.scan).

(a) the sketches are G·Aᵀ of the dense gradient, micro-batches add up, the rest is the dense
gradient; (b) no target-shaped gradient in the jaxpr (with nnx.remat too); (d) the compiled
backward's memory at width 1024 is below the dense one's; the predicted-KL functions against the
densely merged model; an eager call leaves the model as it was; a registered layer of one's own;
our Decoder through this path; the errors; and a whole LoGRA step on a sharded mesh (8 simulated
CPU devices). (c), a few LoGRA steps that lower a loss, is docs/optax_api.md's example
(tests/test_nnx_docs.py).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from logra_jax import nnx_sketch
from logra_jax.optim import (LowRankUpdate, RowAdamState, apply_updates, exact_kl, logra,
                             projection, update_index)
from logra_jax.optim.row_adam import as_sketch
from logra_jax.tree_paths import leaves_with_paths, map_with_paths
from emitters import FUSION_EMITTERS
from nnx_flax_lm import TARGETS, FlaxLM, next_token_loss

# Width 1024, where the dense gradient's memory matters (test d); one pair of compiled gradients
# serves every test. No activation of a (2, 33)-token batch has a kernel's shape (test b).
SIZES = dict(vocab=64, d=1024, f=2048, heads=8, num_layers=2)
SKETCH = dict(targets=TARGETS, rank=16, seed=3)
EXPECTED_TARGETS = {  # path: (kind, stack, in, out)
    "layers/attn/query/kernel": ("LinearGeneral", (2,), 1024, 1024),
    "layers/attn/key/kernel": ("LinearGeneral", (2,), 1024, 1024),
    "layers/attn/value/kernel": ("LinearGeneral", (2,), 1024, 1024),
    "layers/attn/out/kernel": ("LinearGeneral", (2,), 1024, 1024),
    "layers/mlp/up/kernel": ("Linear", (2,), 1024, 2048),
    "layers/mlp/down/kernel": ("Linear", (2,), 2048, 1024),
    "top/q/kernel": ("Einsum", (), 1024, 1024),
    "top/kv/kernel": ("Einsum", (), 1024, 2048),
    "top/o/kernel": ("Einsum", (), 1024, 1024),
}


def _functions(model, sketch):
    """(params dict, sketch grads, dense grads): both over a plain params dict, as under jax.jit."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grad_fn = sketch.value_and_grad(next_token_loss)

    def sketch_grads(params, tokens, k):
        loss, grads = grad_fn(nnx.merge(graphdef, params, rest), k, tokens)
        return loss, nnx.to_pure_dict(grads)

    def dense_grads(params, tokens):
        def loss(params):
            return next_token_loss(nnx.merge(graphdef, params, rest), tokens)
        return jax.value_and_grad(loss)(params)
    return nnx.to_pure_dict(params), sketch_grads, dense_grads


@pytest.fixture(scope="module")
def lm():
    model = FlaxLM(**SIZES, rngs=nnx.Rngs(0))
    sketch = nnx_sketch.prepare(model, **SKETCH)
    params, sketch_grads, dense_grads = _functions(model, sketch)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 2, 33), 0, SIZES["vocab"])
    return dict(model=model, sketch=sketch, params=params, tokens=tokens,
                sketch_grads=sketch_grads, dense_grads=dense_grads,
                # XLA:CPU's default emitters: a non-target's gradient that rounding alone makes
                # non-zero (a key bias's) is compared between these two programs (tests/emitters.py).
                compiled_sketch=jax.jit(sketch_grads, compiler_options=FUSION_EMITTERS).lower(
                    params, tokens[0], 0).compile(),
                compiled_dense=jax.jit(dense_grads, compiler_options=FUSION_EMITTERS).lower(
                    params, tokens[0]).compile())


def test_prepare_finds_every_kind_and_a_layout_where_it_is_needed(lm):
    sketch = lm["sketch"]
    found = {p: (t.kind, t.info.stack_shape, t.info.in_dim, t.info.out_dim)
             for p, t in sketch.targets.items()}
    assert found == EXPECTED_TARGETS
    # LinearGeneral and Einsum kernels need a layout; Linear's is the optimizer's default view.
    layouts = dict(sketch.spec.layouts)
    assert set(layouts) == {p for p, v in EXPECTED_TARGETS.items() if v[0] != "Linear"}
    assert layouts["layers/attn/out/kernel"].inputs == (1, 2)      # (L, heads, head_dim, d)
    assert layouts["top/kv/kernel"].outputs == (0, 1, 3)           # (C, K, D, H): in = D


class _Tiny(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(3, 5, rngs=rngs)
        self.down = nnx.Linear(5, 2, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.down(self.dropout(jax.nn.relu(self.up(x))))


def test_an_eager_call_restores_the_model_and_keeps_its_rng_stream():
    """Eagerly the probes are attached to the model object itself: afterwards (also after an error
    in the loss) it is the same graph, the same values, and its dropout stream has advanced."""
    model = _Tiny(nnx.Rngs(0))
    sketch = nnx_sketch.prepare(model, targets=r"(up|down)/kernel$", rank=2)
    x = jnp.ones((4, 3))
    def params_of(model):
        return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    graph, params = nnx.graphdef(model), params_of(model)
    count = int(model.dropout.rngs.count[...])
    loss, grads = sketch.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2))(model, 0, x)
    assert nnx.graphdef(model) == graph and type(model.up) is nnx.Linear
    jax.tree.map(np.testing.assert_array_equal, params, params_of(model))
    assert int(model.dropout.rngs.count[...]) == count + 1
    assert grads["up"]["kernel"][...].shape == (5, 2) and grads["up"]["bias"][...].shape == (5,)

    def failing(m, x):
        m(x)
        raise RuntimeError("in the loss")
    with pytest.raises(RuntimeError, match="in the loss"):
        sketch.value_and_grad(failing)(model, 0, x)
    assert nnx.graphdef(model) == graph and not hasattr(model.up, "logra_factor")

    def direct(m, x):   # reads up's kernel itself: the probe never sees that product
        return jnp.sum(m.down(x @ m.up.kernel[...]))
    with pytest.raises(ValueError, match=r"\['up/kernel'\] were never called through their layer"):
        sketch.value_and_grad(direct)(model, 0, x)


def _expected_sketch(info, dense_kernel_grad, keys):
    """S = G·Aᵀ per layer in float64, G from the dense kernel gradient in the matrix view."""
    g = np.asarray(info.to_matrix(jnp.asarray(dense_kernel_grad)), np.float64)
    g = g.reshape((-1,) + g.shape[-2:])
    keys = np.asarray(keys).reshape(-1, 2)
    out = [g_l.T @ np.asarray(projection(jnp.asarray(k), info.rank, info.in_dim), np.float64).T
           for g_l, k in zip(g, keys)]
    return np.stack(out).reshape(info.sketch_shape)


def test_sketches_are_G_At_and_micro_batches_add_up(lm):
    sketch, params = lm["sketch"], lm["params"]
    total = dense = None
    for tokens in lm["tokens"]:        # two micro-batches: sketches add up like gradients
        loss, g = lm["compiled_sketch"](params, tokens, 3)
        dense_loss, d = lm["compiled_dense"](params, tokens)
        np.testing.assert_allclose(loss, dense_loss, rtol=1e-6)
        total = g if total is None else jax.tree.map(jnp.add, total, g)
        dense = d if dense is None else jax.tree.map(jnp.add, dense, d)
    sketches = dict(leaves_with_paths(total))
    dense_leaves = dict(leaves_with_paths(dense))
    assert set(sketches) == set(dense_leaves)              # the params' paths, nothing else
    keys = sketch.keys(3)
    for path, target in sketch.targets.items():
        expected = _expected_sketch(target.info, dense_leaves[path], keys[path])
        assert sketches[path].shape == target.info.sketch_shape
        np.testing.assert_allclose(sketches[path], expected, rtol=1e-4,
                                   atol=1e-4 * np.abs(expected).max(), err_msg=path)
    for path, g in sketches.items():
        if path not in sketch.targets:                     # embeddings, norms, biases, head
            np.testing.assert_allclose(g, dense_leaves[path], rtol=1e-4,
                                       atol=1e-5 * np.abs(dense_leaves[path]).max(), err_msg=path)


def _eqn_output_shapes(jaxpr) -> set:
    """Shapes of every value a primitive computes, inside scans, remat and pjit too.

    The outputs of those wrappers themselves are left out: they only pass on what their bodies
    computed, or forward their inputs (flax's nnx.remat inside nnx.scan hands each block's state
    out of the checkpoint, and the scan stacks it: a copy of the kernels, not a gradient — with
    or without LoGRA, for a gradient of the embedding alone too).
    """
    shapes = set()
    for eqn in jaxpr.eqns:
        subs = [sub for param in eqn.params.values()
                for sub in (param if isinstance(param, (tuple, list)) else (param,))
                if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr))]
        if not subs:
            shapes.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for sub in subs:
            shapes |= _eqn_output_shapes(getattr(sub, "jaxpr", sub))
    return shapes


@pytest.mark.parametrize("remat", [False, True])
def test_no_target_shaped_gradient_in_the_jaxpr(lm, remat):
    sketch, params, tokens = lm["sketch"], lm["params"], lm["tokens"][0]
    kernels = dict(leaves_with_paths(params))
    dense_shapes = set()
    for path, target in sketch.targets.items():
        shape, info = kernels[path].shape, target.info
        n = len(info.stack_shape)
        for s in (shape, shape[n:], (info.in_dim, info.out_dim), (info.out_dim, info.in_dim)):
            dense_shapes |= {tuple(s), tuple(reversed(s)), info.stack_shape + tuple(s)}
    sketch_grads, dense_grads = lm["sketch_grads"], lm["dense_grads"]
    if remat:   # the same model with nnx.remat around each scanned block
        abstract = nnx.eval_shape(lambda: FlaxLM(**SIZES, remat=True, rngs=nnx.Rngs(0)))
        _, sketch_grads, dense_grads = _functions(abstract, sketch)
    sketch_jaxpr = jax.make_jaxpr(sketch_grads)(params, tokens, 0)
    dense_jaxpr = jax.make_jaxpr(dense_grads)(params, tokens)
    assert dense_shapes & _eqn_output_shapes(dense_jaxpr.jaxpr)    # the check can see them
    assert not dense_shapes & _eqn_output_shapes(sketch_jaxpr.jaxpr)


def test_backward_memory_is_below_the_dense_one_at_width_1024(lm):
    def total(compiled):
        m = compiled.memory_analysis()
        return m.temp_size_in_bytes + m.output_size_in_bytes

    sketch_bytes, dense_bytes = total(lm["compiled_sketch"]), total(lm["compiled_dense"])
    kernels = dict(leaves_with_paths(lm["params"]))
    target_bytes = sum(kernels[p].nbytes for p in lm["sketch"].targets)
    print(f"backward temp+output: sketch {sketch_bytes / 2**20:.1f} MiB, dense "
          f"{dense_bytes / 2**20:.1f} MiB, target kernels {target_bytes / 2**20:.1f} MiB")
    # The dense backward writes a gradient as large as every target kernel; the sketched one
    # saves most of it (68.9 against 133.7 MiB: XLA:CPU's per-layer kernel copies for ∂L/∂x,
    # which both need, are scheduled a little differently).
    assert dense_bytes >= target_bytes
    assert sketch_bytes < dense_bytes - 0.75 * target_bytes


def test_predicted_and_candidate_kl_of_a_foreign_model(lm):
    """predict_kl is the JVP's quadratic KL, candidate_kl the exact KL at W + U·A: compared with
    the KL of the model whose kernels were merged densely."""
    model, params = lm["model"], lm["params"]
    sketch = nnx_sketch.prepare(model, targets=r"(query|out|up|kv)/kernel$", rank=16, seed=3)
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    tokens = lm["tokens"][0][:, :17]
    mask = jnp.ones(tokens.shape, jnp.float32)
    keys = sketch.keys(5)
    factors = {p: 2e-3 * jax.random.normal(jax.random.PRNGKey(i), t.info.sketch_shape)
               for i, (p, t) in enumerate(sketch.targets.items())}

    @jax.jit
    def kls(params, scale):
        m = nnx.merge(graphdef, params, rest)
        control = sketch.kl_control(m, 5, lambda m, t: m(t), tokens, response_mask=mask,
                                    others_frozen=True)
        updates = map_with_paths(
            lambda p, x: LowRankUpdate(factors[p] * scale, keys[p], jnp.float32(1.0), exact=False,
                                       layout=sketch.targets[p].layout)
            if p in factors else jnp.zeros_like(x), params)
        merged = nnx.merge(graphdef, apply_updates(params, updates), rest)
        return (control["predict_kl"](updates), control["candidate_kl"](updates),
                exact_kl(m(tokens), merged(tokens), mask))

    for scale in (1.0, 0.1):
        predicted, candidate, realized = kls(params, scale)
        assert realized > 0
        np.testing.assert_allclose(candidate, realized, rtol=1e-3)
        # second order: the prediction's error shrinks with the step
        np.testing.assert_allclose(predicted, realized, rtol=0.3 if scale == 1.0 else 0.03)


class _OwnLinear(nnx.Linear):
    def __call__(self, x):
        return super().__call__(x) * 2.0


class _Odd(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(5, 4, rngs=rngs)
        self.mine = _OwnLinear(4, 4, rngs=rngs)
        self.mlp = nnx.Linear(4, 4, rngs=rngs)
        self.batched = nnx.LinearGeneral(4, 3, batch_axis={0: 2}, rngs=rngs)
        self.late = nnx.Einsum("bd,de->be", (4, 3), rngs=rngs)
        self.late.einsum_str = None          # the equation then comes with each call
        self.diag = nnx.Einsum("bnd,nde->bne", (2, 4, 3), rngs=rngs)


class _WEinsum(nnx.Module):
    """A library's own einsum layer (as Tunix's Gemma and Qwen have): its kernel is ``w``."""

    def __init__(self, einsum_str, shape, rngs):
        self.einsum_str = einsum_str
        self.w = nnx.Param(jax.random.normal(rngs.params(), shape) / 4)

    def __call__(self, x):
        return jnp.einsum(self.einsum_str, x, self.w[...])


class _Gemma(nnx.Module):
    def __init__(self, rngs):
        self.q_einsum = _WEinsum("BTD,NDH->BTNH", (2, 6, 3), rngs)
        self.attn_vec_einsum = _WEinsum("BTNH,NHD->BTD", (2, 3, 6), rngs)

    def __call__(self, x):
        return self.attn_vec_einsum(jnp.tanh(self.q_einsum(x)))


def test_a_registered_layer_of_ones_own_is_sketched():
    model = _Gemma(nnx.Rngs(0))
    targets = r"(q|attn_vec)_einsum/w$"
    with pytest.raises(ValueError, match=r"'w' of a .*_WEinsum.*nnx_sketch\.register"):
        nnx_sketch.prepare(model, targets=targets)
    nnx_sketch.register(_WEinsum, kernel="w", equation=lambda layer: layer.einsum_str)
    sketch = nnx_sketch.prepare(model, targets=targets, rank=2, seed=1)
    assert dict(sketch.spec.layouts)["q_einsum/w"].inputs == (1,)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 6))

    def loss(model):
        return jnp.sum(jnp.sin(model(x)))

    @jax.jit
    def both(params):
        model = nnx.merge(graphdef, params, rest)
        _, grads = sketch.value_and_grad(loss)(model, 4)
        return nnx.to_pure_dict(grads), nnx.to_pure_dict(nnx.grad(loss)(model))
    sketches, dense = (dict(leaves_with_paths(g)) for g in both(params))
    keys = sketch.keys(4)
    kernels = dict(leaves_with_paths(params))
    for path, target in sketch.targets.items():
        expected = _expected_sketch(target.info, dense[path], keys[path])
        np.testing.assert_allclose(sketches[path], expected, rtol=1e-5, atol=1e-6, err_msg=path)
        # the optimizer reads the kernel the same way: its drop-in sketch of the dense gradient,
        # and its merge (layer-wise, and through optax.apply_updates' kernel + update)
        np.testing.assert_allclose(as_sketch(dense[path], target.info, sketch.spec, 4), expected,
                                   rtol=1e-5, atol=1e-6, err_msg=path)
        update = LowRankUpdate(jnp.ones(target.info.sketch_shape), keys[path], jnp.float32(1.0),
                               exact=False, layout=target.layout)
        merged = update.merge_into(kernels[path])
        np.testing.assert_allclose(kernels[path] + update, merged, rtol=1e-6, err_msg=path)
        delta = target.layout.from_matrix(update.delta_kernel(target.info.in_dim),
                                          kernels[path].shape)
        np.testing.assert_allclose(merged - kernels[path], delta, atol=1e-5, err_msg=path)


@pytest.mark.parametrize("targets, message", [
    (r"embed/embedding", r"'embed/embedding'.*Embed at 'embed'.*only the kernel"),
    (r"mlp/bias", r"'mlp/bias'.*the 'bias' of a flax.nnx.nn.linear.Linear"),
    (r"mine/kernel", r"'mine/kernel'.*_OwnLinear.*own __call__"),
    (r"batched/kernel", r"batch_axis"),
    (r"late/kernel", r"equation at call time"),
    (r"diag/kernel", r"batch, diagonal or summed index"),
    (r"nothing_here", r"matched no parameter"),
])
def test_a_target_of_another_kind_is_an_error_naming_it(targets, message):
    model = nnx.eval_shape(lambda: _Odd(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=message):
        nnx_sketch.prepare(model, targets=targets)


def test_our_decoder_through_this_path_gets_the_gradients_of_its_own_probes():
    """docs/optax_api.md: our Decoder could use nnx_sketch (its Linear is a supported kind) and
    would get, bit for bit, the gradients its explicit SketchProbes give."""
    from logra_jax.models import Decoder
    from logra_jax.models.config import tiny
    from logra_jax.optim import (make_probes, merge_targets, probe_factors, split_targets,
                                 with_factors)

    model = Decoder(tiny(), rngs=nnx.Rngs(0))
    sketch = nnx_sketch.prepare(model, rank=4, seed=5)   # the default (q|k|v|o|gate|up|down)_proj
    assert len(sketch.targets) == 7 and not sketch.spec.layouts
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, tiny().vocab_size)

    def loss(model, tokens, probes=None):
        logits = model(tokens[:, :-1], probes=probes).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    @functools.partial(jax.jit, compiler_options=FUSION_EMITTERS)   # tests/emitters.py
    def both(params, tokens):
        _, ours = sketch.value_and_grad(loss)(nnx.merge(graphdef, params, rest), 2, tokens)
        probes = make_probes(params, 2, sketch.spec)
        kernels, others = split_targets(params, sketch.spec)

        def native(others, factors):
            return loss(nnx.merge(graphdef, merge_targets(others, kernels), rest), tokens,
                        with_factors(probes, factors))
        other_grads, sketches = jax.grad(native, argnums=(0, 1))(others, probe_factors(probes))
        return nnx.to_pure_dict(ours), merge_targets(other_grads, sketches)

    ours, native = both(params, tokens)
    jax.tree.map(np.testing.assert_array_equal, ours, native)


# ---------------------------------------------------------------- on a sharded mesh

# A target of each layout that needs one (a Linear's is tests/optim's): LinearGeneral with two out
# axes (query) and two in axes (out), an Einsum whose in axis sits between out axes (top/kv:
# C, K, D, H).
SHARDED_TARGETS = r"(attn/(query|out)|top/kv)/kernel$"


def _kernel_spec(target, shape):
    """In over fsdp (its first axis that divides), the first out axis over tensor."""
    spec = [None] * len(shape)
    spec[next(a for a in target.layout.inputs if shape[a] % 4 == 0)] = "fsdp"
    spec[target.layout.outputs[0]] = "tensor"
    return P(*spec)


@pytest.fixture(scope="module")
def sharded(lm):
    """One LoGRA step (sketched gradients, update, layer-wise merge) of the width-1024 model with
    its kernels sharded over a (fsdp 4, tensor 2) mesh, the other params replicated."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    graphdef, _, rest = nnx.split(lm["model"], nnx.Param, ...)
    targets = nnx_sketch.prepare(lm["model"], targets=SHARDED_TARGETS).targets

    def place(path, x):
        spec = _kernel_spec(targets[path], x.shape) if path in targets else P()
        return jax.device_put(x, NamedSharding(mesh, spec))
    placed = map_with_paths(place, lm["params"])
    # Prepared on the sharded model, so B and the sketches are laid out like the kernels; the
    # same rank and seed as the fixture's sketch: the same A for these targets.
    sketch = nnx_sketch.prepare(nnx.merge(graphdef, placed, rest), targets=SHARDED_TARGETS,
                                rank=SKETCH["rank"], seed=SKETCH["seed"])
    # The targets only (others frozen, their gradient never computed): AdamW on a mesh is optax's.
    tx = logra(learning_rate=1e-2, others="frozen", exact_merge=False, **sketch.logra_kwargs())
    grad_fn = sketch.value_and_grad(next_token_loss, train_others=False)

    # The params come back laid out as they went in (and in place), as rl/update.py does it.
    layout = jax.tree.map(lambda x: x.sharding, placed)

    @functools.partial(jax.jit, donate_argnums=0, out_shardings=(layout, None, None, None))
    def step(params, opt_state, tokens):
        loss, grads = grad_fn(nnx.merge(graphdef, params, rest), update_index(opt_state), tokens)
        grads = nnx.to_pure_dict(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return apply_updates(params, updates), opt_state, loss, grads

    state = tx.init(placed)
    new_params, _, loss, grads = step(jax.tree.map(jnp.copy, placed), state, lm["tokens"][0])
    return dict(sketch=sketch, placed=placed, state=state, params=new_params, loss=loss,
                grads=grads)


def test_a_sharded_step_sketches_as_one_device_and_trains_the_targets(lm, sharded):
    ref_loss, ref_grads = lm["compiled_sketch"](lm["params"], lm["tokens"][0], 0)
    np.testing.assert_allclose(sharded["loss"], ref_loss, rtol=1e-5)
    ref_grads = dict(leaves_with_paths(ref_grads))
    grads = dict(leaves_with_paths(sharded["grads"]))
    for path in sharded["sketch"].targets:
        np.testing.assert_allclose(grads[path], ref_grads[path], rtol=1e-4,
                                   atol=1e-5 * np.abs(ref_grads[path]).max(), err_msg=path)
    others = [p for p in grads if p not in sharded["sketch"].targets]
    assert not any(np.any(grads[p]) for p in others)            # frozen: zeros, never computed
    before = dict(leaves_with_paths(sharded["placed"]))
    after = dict(leaves_with_paths(sharded["params"]))
    moved = [p for p, a in after.items() if not np.array_equal(a, before[p])]
    assert sorted(moved) == sorted(sharded["sketch"].targets)   # the targets, and only they
    for path in sharded["sketch"].targets:                      # still laid out as they were
        assert after[path].sharding.is_equivalent_to(before[path].sharding, after[path].ndim)
        assert np.all(np.isfinite(after[path]))


def test_probes_sketches_and_moments_are_laid_out_like_the_kernels(sharded):
    shardings = sharded["sketch"].shardings
    # (*stack, out, r): the kernel's stack and out entries, its fsdp (in) axis moved onto out.
    assert shardings["layers/attn/query/kernel"].spec == P(None, ("tensor", "fsdp"), None)
    assert shardings["layers/attn/out/kernel"].spec == P(None, ("tensor", "fsdp"), None)
    assert shardings["top/kv/kernel"].spec == P(("tensor", "fsdp"), None)
    grads = dict(leaves_with_paths(sharded["grads"]))
    for path, sharding in shardings.items():
        assert grads[path].sharding.is_equivalent_to(sharding, grads[path].ndim), path
    moments = [s for s in jax.tree.leaves(sharded["state"],
                                          is_leaf=lambda x: isinstance(x, RowAdamState))
               if isinstance(s, RowAdamState)][0].v
    specs = {p: v.sharding.spec for p, v in leaves_with_paths(moments)}
    assert specs["layers/attn/query/kernel"] == P(None, "tensor")    # (layers, heads·head_dim)
    assert specs["layers/attn/out/kernel"] == P(None, "tensor")      # (layers, d)
    assert specs["top/kv/kernel"] == P("tensor")                     # C·K·H: C over tensor


def test_default_targets_is_importable_from_the_module_the_docs_use():
    from logra_jax import optim
    from logra_jax.nnx_sketch import DEFAULT_TARGETS
    assert DEFAULT_TARGETS == optim.DEFAULT_TARGETS and "DEFAULT_TARGETS" in nnx_sketch.__all__


def _small_lm():
    return FlaxLM(vocab=16, d=32, f=64, heads=2, num_layers=2, rngs=nnx.Rngs(0))


def test_an_optimizer_built_with_other_sketch_arguments_is_an_error():
    """logra(**sketch.logra_kwargs()) with one argument changed would reconstruct every update
    with another A than the gradients were sketched with: the gradient call refuses it (given the
    nnx.Optimizer) and `check` names the argument; the same arguments pass."""
    model = _small_lm()
    sketch = nnx_sketch.prepare(model, **SKETCH)
    good = nnx.Optimizer(model, logra(learning_rate=1e-2, **sketch.logra_kwargs()), wrt=nnx.Param)
    keys = sketch.keys(good)                       # checked, then k of its state: 0
    assert all(np.array_equal(keys[p], k) for p, k in sketch.keys(0).items())
    for change, named in [(dict(seed=SKETCH["seed"] + 1), "seed=4 (the sketch's: 3)"),
                          (dict(rank=8), "rank=8 (the sketch's: 16)"),
                          (dict(layouts={}), "layouts=() (the sketch's: ((")]:
        bad = logra(learning_rate=1e-2, **{**sketch.logra_kwargs(), **change})
        with pytest.raises(ValueError, match=re.escape(named)):
            sketch.check(bad)
    with pytest.raises(ValueError, match="pass \\*\\*sketch.logra_kwargs\\(\\) unchanged"):
        good.tx = bad   # as if built with the other seed
        sketch.value_and_grad(next_token_loss)(model, good, jnp.zeros((2, 9), jnp.int32))
    with pytest.raises(ValueError, match="not made by logra_jax.optim.logra"):
        sketch.check(optax.adamw(1e-3))


def test_a_mesh_with_explicit_axes_is_refused_at_prepare():
    """jax.make_mesh's default axes are Explicit, on which the probes' layout cannot be set: left
    to the first gradient, it would fail deep inside (`with_sharding_constraint can only refer to
    Auto axes`); `prepare` refuses it in one line."""
    model = _small_lm()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), params)
    with pytest.raises(ValueError, match=re.escape(
            "is on a mesh with Explicit axes ['data'] (jax.make_mesh's default); nnx_sketch lays "
            "its probes out on Auto axes: make the mesh with jax.make_mesh(..., "
            "axis_types=(jax.sharding.AxisType.Auto,) * 1)")):
        nnx_sketch.prepare(nnx.merge(graphdef, params, rest), **SKETCH)


class _Narrow(nnx.Module):
    """Two layers narrower than the rank asked: in widths 8 and 32."""

    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.down = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def test_a_rank_not_below_a_targets_input_width_is_refused_naming_the_targets():
    """rank=64 on layers 8 and 32 wide: refused, naming each and its width, as launch.train
    refuses a rank not below its model's widths — not a rank quietly lowered to 8 and 32 (a
    sketch of rank ≥ in compresses nothing). A rank below both works."""
    model = nnx.eval_shape(lambda: _Narrow(nnx.Rngs(0)))
    with pytest.raises(ValueError) as caught:
        nnx_sketch.prepare(model, targets=r"(up|down)/kernel$", rank=64)
    assert str(caught.value) == (
        "rank 64 is not below the input width of 2 targets: 'down/kernel' (32), 'up/kernel' (8); "
        "a sketch of rank r ≥ in compresses nothing, so no target's rank is lowered for it: lower "
        "rank below 8 (or exclude those targets)")
    with pytest.raises(ValueError, match=r"^rank 8 is not below the input width of 1 target: "
                                         r"'up/kernel' \(8\);"):
        nnx_sketch.prepare(model, targets=r"(up|down)/kernel$", rank=8)
    sketch = nnx_sketch.prepare(model, targets=r"(up|down)/kernel$", rank=7)
    assert sketch.logra_kwargs()["rank"] == 7
