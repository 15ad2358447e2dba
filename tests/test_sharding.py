"""Mesh creation and logical-axis rules (8 simulated CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from logra_jax.models.config import tiny
from logra_jax.models.llama import Decoder
from logra_jax.sharding import (get_logical_axes, logical_sharding, logical_to_spec, make_mesh,
                                param_shardings, set_logical_axes, shard_model)


@pytest.mark.parametrize("shape", [(8, 1), (4, 2), (2, 4)])
def test_make_mesh_shapes_and_auto_axes(shape):
    mesh = make_mesh({"fsdp": shape[0], "tensor": shape[1]})
    assert dict(mesh.shape) == {"fsdp": shape[0], "tensor": shape[1]}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert mesh.devices.size == len(jax.devices()) == 8


def test_make_mesh_accepts_pairs_and_device_subsets():
    mesh = make_mesh([("fsdp", 2), ("tensor", 2)], devices=jax.devices()[:4])
    assert dict(mesh.shape) == {"fsdp": 2, "tensor": 2}


def test_make_mesh_rejects_device_count_mismatch_naming_both_numbers():
    with pytest.raises(ValueError, match=r"multiply to 6.*there are 8 devices"):
        make_mesh({"fsdp": 3, "tensor": 2})
    with pytest.raises(ValueError, match="positive int"):
        make_mesh({"fsdp": 0, "tensor": 8})
    with pytest.raises(ValueError, match="unique"):
        make_mesh([("fsdp", 2), ("fsdp", 4)])


def test_logical_to_spec_rules_and_fallbacks():
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    assert logical_to_spec(("layers", "embed", "mlp"), mesh, shape=(3, 32, 64)) == P(None, "fsdp", "tensor")
    # not divisible by the mesh axis → that dimension is replicated
    assert logical_to_spec(("embed", "vocab"), mesh, shape=(30, 64)) == P(None, "tensor")
    # one mesh axis shards at most one dimension; unknown names and None are replicated
    assert logical_to_spec(("embed", "embed"), mesh, shape=(8, 8)) == P("fsdp", None)
    assert logical_to_spec(("whatever", None), mesh, shape=(8, 8)) == P(None, None)
    # custom rules, as a mapping
    assert logical_to_spec(("embed", "mlp"), mesh, {"mlp": "fsdp"}, shape=(8, 8)) == P(None, "fsdp")
    sharding = logical_sharding(("batch", "length"), mesh, shape=(8, 5))
    assert sharding.spec == P("fsdp", None) and sharding.mesh is mesh
    with pytest.raises(ValueError, match="2 dimensions"):
        logical_to_spec(("embed", "mlp"), mesh, shape=(8,))


@pytest.fixture(scope="module")
def model():
    # vocab 90 is divisible by 2 but not by 4: the (2, 4) mesh must replicate the vocabulary dimension.
    return Decoder(tiny(vocab_size=90), rngs=nnx.Rngs(0))


def _spec(shardings, *path):
    node = shardings
    for p in path:
        node = node[p]
    return node.spec


def test_param_shardings_follow_metadata(model):
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    shardings = param_shardings(model, mesh)
    assert _spec(shardings, "layers", "self_attn", "q_proj", "kernel") == P(None, "fsdp", "tensor")
    assert _spec(shardings, "layers", "self_attn", "o_proj", "kernel") == P(None, "tensor", "fsdp")
    assert _spec(shardings, "layers", "self_attn", "k_proj", "bias") == P(None, "tensor")
    assert _spec(shardings, "layers", "input_layernorm", "scale") == P(None, None)
    assert _spec(shardings, "embed_tokens", "embedding") == P("tensor", "fsdp")
    assert _spec(shardings, "lm_head", "kernel") == P("fsdp", "tensor")
    wide = param_shardings(model, make_mesh({"fsdp": 2, "tensor": 4}))
    assert _spec(wide, "embed_tokens", "embedding") == P(None, "fsdp")  # 90 % 4 != 0


def test_shard_model_places_arrays_and_keeps_values(model):
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    before = np.asarray(model.layers.mlp.up_proj.kernel[...])
    sharded = Decoder(tiny(vocab_size=90), rngs=nnx.Rngs(0))
    shard_model(sharded, mesh)
    kernel = sharded.layers.mlp.up_proj.kernel[...]
    assert kernel.sharding.spec == P(None, "fsdp", "tensor")
    assert len(kernel.addressable_shards) == 8
    assert kernel.addressable_shards[0].data.shape == (2, 16, 16)  # (L, 32/2, 64/4)
    np.testing.assert_array_equal(np.asarray(kernel), before)


def test_param_shardings_on_a_state_with_untagged_and_mismatched_variables():
    class Tagged(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((8, 4)))
            set_logical_axes(self.w, ("embed", "mlp"))
            self.free = nnx.Param(jnp.zeros((8,)))  # no logical axes: replicated

    module = Tagged()
    assert get_logical_axes(module.w) == ("embed", "mlp")
    mesh = make_mesh({"fsdp": 8, "tensor": 1})
    shardings = param_shardings(nnx.state(module), mesh)
    assert shardings["w"].spec == P("fsdp", "tensor") and shardings["free"].spec == P()
    with pytest.raises(ValueError, match="do not match"):
        set_logical_axes(module.free, ("embed", "mlp"))
    module.free.set_metadata(logical_axes=("embed", "mlp"))  # bypassing the check ...
    with pytest.raises(ValueError, match="parameter free: logical axes"):  # ... is caught, by path
        param_shardings(module, mesh)


def test_optimizer_state_inherits_parameter_shardings(model):
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    shardings = param_shardings(nnx.state(optimizer), mesh)
    mu = shardings["opt_state"][0]["mu"]
    assert mu["layers"]["self_attn"]["q_proj"]["kernel"].spec == P(None, "fsdp", "tensor")
    assert shardings["opt_state"][0]["count"].spec == P()

    class RowStat(nnx.Variable):
        pass

    # a derived variable that kept its parameter's axes but lost a dimension is replicated, not an error
    row = RowStat(jnp.zeros((2, 64)), logical_axes=("layers", "embed", "mlp"))
    assert param_shardings(nnx.State({"v": row}), mesh)["v"].spec == P()


def test_galore_state_is_sharded_like_its_kernel():
    """opt_state_shardings on GaLore's per-layer state: the projector and the low-rank moments
    keep the kernel's sharded in/out axis (replicated they would cost a full copy per device)."""
    from jax.sharding import NamedSharding
    from logra_jax.optim.baselines import galore_baseline
    from logra_jax.sharding import opt_state_shardings
    from logra_jax.tree_paths import leaves_with_paths

    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    kernel = jax.device_put(jnp.ones((2, 64, 16)), NamedSharding(mesh, P(None, "fsdp", "tensor")))
    params = {"layers": {"mlp": {"up_proj": {"kernel": kernel}}}}
    specs = {path: s.spec for path, s in leaves_with_paths(
        opt_state_shardings(galore_baseline(0.1, rank=4), params))}
    matrices = {path: spec for path, spec in specs.items() if len(spec) == 3}
    assert matrices and all(spec[:2] == (None, "fsdp") or spec[2:] == ("tensor",)
                            for spec in matrices.values()), specs


def test_activations_split_by_batch_under_a_mesh_context():
    """shard_batch: rows over fsdp when a mesh is in context and they divide; a no-op otherwise."""
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    model = shard_model(Decoder(tiny(), rngs=nnx.Rngs(0)), mesh)
    graphdef, state = nnx.split(model)

    def forward(state, tokens):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return nnx.merge(graphdef, state)(tokens)

    def constraints(rows):
        tokens = jnp.zeros((rows, 6), jnp.int32)
        text = jax.jit(forward).lower(state, tokens).as_text()
        return [line for line in text.splitlines() if "sharding_constraint" in line]

    split = constraints(4)
    assert split and all('[{"fsdp"}' in line for line in split)
    assert constraints(2) == []                      # 2 rows do not divide over 4 devices
    logits = jax.jit(forward)(state, jnp.zeros((4, 6), jnp.int32))
    assert logits.sharding.spec[0] == "fsdp"
    plain = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, jnp.zeros((4, 6), jnp.int32))
    assert "sharding_constraint" not in plain.as_text()   # no mesh in context: the layout is XLA's
