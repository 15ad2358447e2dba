"""The merge's product U·A has the same bits whatever order a backend sums in (order_free.py).

Each test changes only what a backend is free to change — the order of the r terms, the mesh,
whether a scale is a compile-time constant — and asks for identical bits. The plain fp32 dot is
shown beside it for contrast (how often it differs is machine-dependent, so it is printed, not
asserted).
"""

import dataclasses
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from logra_jax.optim.low_rank import LowRankUpdate
from logra_jax.optim.order_free import order_free_matmul, rounded
from logra_jax.projections import projection, projection_keys

M, R, N = 96, 64, 160
KINDS = {"rademacher": True, "gaussian": False}


def _operands(kind, seed=0):
    """x (M × R) ±1 or Gaussian; y (R × N) with columns spread over ±40 binades, one zero column,
    and a column whose entries span 30 binades (small ones must not be lost)."""
    kx, ky, ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = (jax.random.rademacher(kx, (M, R), dtype=jnp.float32) if KINDS[kind]
         else jax.random.normal(kx, (M, R)))
    column_scale = jnp.exp2(jnp.round(jax.random.uniform(ks, (1, N), minval=-40, maxval=40)))
    y = jax.random.normal(ky, (R, N)) * column_scale
    y = y.at[:, 0].set(0.0)
    y = y.at[:, 1].set(jnp.exp2(-jnp.arange(R, dtype=jnp.float32) * 30.0 / R))
    return np.asarray(x), np.asarray(y)


_order_free = {kind: jax.jit(lambda x, y, s=is_sign: order_free_matmul(x, y, x_is_sign=s))
               for kind, is_sign in KINDS.items()}
_plain = jax.jit(lambda x, y: jnp.matmul(x, y, precision="highest"))


@pytest.mark.parametrize("kind", list(KINDS))
def test_any_order_of_the_r_terms_gives_the_same_bits(kind):
    x, y = _operands(kind)
    reference, plain = np.asarray(_order_free[kind](x, y)), np.asarray(_plain(x, y))
    plain_differs = 0
    for seed in range(4):
        perm = np.random.default_rng(seed).permutation(R)   # the same sum, terms in another order
        np.testing.assert_array_equal(np.asarray(_order_free[kind](x[:, perm], y[perm])), reference)
        plain_differs += int(np.sum(np.asarray(_plain(x[:, perm], y[perm])) != plain))
    print(f"\n{kind}: plain fp32 dot, entries changed by reordering r: {plain_differs} of {4 * M * N}")


@pytest.mark.parametrize("kind", list(KINDS))
def test_as_accurate_as_a_plain_dot(kind):
    x, y = _operands(kind, seed=1)
    exact = x.astype(np.float64) @ y.astype(np.float64)
    scale = np.abs(x.astype(np.float64)) @ np.abs(y.astype(np.float64))   # the error's natural unit
    scale[scale == 0] = 1.0
    ours = np.abs(np.asarray(_order_free[kind](x, y), np.float64) - exact) / scale
    plain = np.abs(np.asarray(_plain(x, y), np.float64) - exact) / scale
    print(f"\n{kind}: max error / (|x|·|y|·2⁻²⁴): order-free {ours.max() * 2**24:.3f}, "
          f"plain {plain.max() * 2**24:.3f}")
    # Rademacher: the exact sum, rounded once (≤ ½ ulp of the result, so ≤ 2⁻²⁴ of the scale).
    # Gaussian: A's slices stop 24 bits below each row's largest entry; a few units, like a dot.
    assert ours.max() <= (2.0 ** -24 if kind == "rademacher" else 4 * 2.0 ** -24)
    assert ours.max() <= max(plain.max(), 2.0 ** -24)
    assert np.all(np.asarray(_order_free[kind](x, y))[:, 0] == 0.0)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_mesh_gives_the_same_bits(kind):
    """The per-device blocks, and so the backend's blocking of each dot, differ between meshes."""
    x, y = _operands(kind, seed=2)
    results = {}
    for shape in [(1, 1), (8, 1), (1, 8), (2, 4), (4, 2)]:
        mesh = jax.make_mesh(shape, ("rows", "cols"), devices=jax.devices()[:np.prod(shape)])
        xs = jax.device_put(x, NamedSharding(mesh, P("rows", None)))
        ys = jax.device_put(y, NamedSharding(mesh, P(None, "cols")))
        results[shape] = np.asarray(_order_free[kind](xs, ys))
    for shape, value in results.items():
        np.testing.assert_array_equal(value, results[(1, 1)], err_msg=str(shape))


def test_rounded_keeps_a_product_out_of_a_fused_multiply_add():
    a, b, c = (np.random.default_rng(i).standard_normal(4096).astype(np.float32) for i in range(3))
    separately = (a * b) + c                                  # numpy rounds a·b, then adds
    fused = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c))
    ours = np.asarray(jax.jit(lambda a, b, c: rounded(a * b) + c)(a, b, c))
    print(f"\nXLA contracted a·b + c in {int(np.sum(fused != separately))} of {a.size} entries")
    np.testing.assert_array_equal(ours, separately)
    assert np.isnan(np.asarray(rounded(jnp.asarray([np.inf, -np.inf, np.nan])))).all()


@pytest.mark.parametrize("weight_scale", [1.0, 0.999])
def test_merge_is_the_same_whether_the_scale_is_a_constant_or_an_input(weight_scale):
    """A trainer may know weight_scale at compile time (1 without weight decay) and fold it into
    its program; a receiver gets it as data. Both must merge the same bits."""
    kernel = jax.random.normal(jax.random.PRNGKey(0), (3, 48, 80))
    update = LowRankUpdate(factor=jax.random.normal(jax.random.PRNGKey(1), (3, 80, 16)) * 1e-3,
                           key=projection_keys(5, "layers/mlp/kernel", 2, (3,)),
                           weight_scale=jnp.float32(weight_scale))
    as_input = jax.jit(lambda k, u: u.merge_into(k))(kernel, update)
    as_constant = jax.jit(lambda k, f: dataclasses.replace(update, factor=f).merge_into(k))(
        kernel, update.factor)
    np.testing.assert_array_equal(np.asarray(as_constant), np.asarray(as_input))
    # ... and it is the merge W ← ws·W + U·A.
    a = np.stack([np.asarray(projection(k, 16, 48), np.float64) for k in update.key])
    expected = weight_scale * np.asarray(kernel, np.float64) + np.einsum(
        "lri,lor->lio", a, np.asarray(update.factor, np.float64))
    np.testing.assert_allclose(np.asarray(as_input), expected, rtol=1e-6, atol=1e-7)


def test_a_rank_without_exact_slices_is_refused():
    x = jnp.ones((4, 2 ** 16))
    with pytest.raises(ValueError, match="leaves no fp32 bits"):
        order_free_matmul(x, jnp.ones((2 ** 16, 3)), x_is_sign=False)
    with pytest.raises(ValueError, match=r"needs x \(m, r\) and y \(r, n\)"):
        order_free_matmul(jnp.ones((4, 3)), jnp.ones((2, 3)), x_is_sign=True)


def _primitive_counts(jaxpr, counts=None, platform="cpu"):
    """{primitive name: occurrences} over a jaxpr and every jaxpr nested in it (loop bodies), of
    the program lowered for ``platform``: of a ``platform_dependent`` choice, its branch only."""
    counts = {} if counts is None else counts
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
        subs = jax.extend.core.jaxprs_in_params(eqn.params)
        if eqn.params.get("branches_platforms"):
            chosen = [b for b, ps in zip(eqn.params["branches"], eqn.params["branches_platforms"])
                      if ps is not None and platform in ps]
            default = [b for b, ps in zip(eqn.params["branches"], eqn.params["branches_platforms"])
                       if ps is None]
            subs = [(chosen or default)[0].jaxpr]
        for sub in subs:
            _primitive_counts(sub, counts, platform)
    return counts


def test_a_merge_no_one_replays_is_one_plain_dot_of_the_same_product():
    """``exact=False`` (the trainer's merge when no rollout engine replays it, rl/build.py:
    replays_merge) multiplies U·A with one fp32 dot and no loop over slice pairs; its value is the
    same product to fp32 accuracy."""
    kernel = jax.random.normal(jax.random.PRNGKey(0), (3, 48, 80))
    exact = LowRankUpdate(factor=jax.random.normal(jax.random.PRNGKey(1), (3, 80, 16)) * 1e-3,
                          key=projection_keys(5, "layers/mlp/kernel", 2, (3,)),
                          weight_scale=jnp.float32(0.999))
    plain = dataclasses.replace(exact, exact=False)
    counts = {name: _primitive_counts(jax.make_jaxpr(lambda k, u: u.merge_into(k))(kernel, u).jaxpr)
              for name, u in (("exact", exact), ("plain", plain))}
    # On a CPU: the layer loop, then (exact only) the loop over slice pairs with its dot inside.
    assert counts["plain"]["scan"] == 1 and counts["plain"]["dot_general"] == 1, counts["plain"]
    assert counts["exact"]["scan"] == 2 and counts["exact"]["dot_general"] == 1, counts["exact"]
    a = np.stack([np.asarray(projection(k, 16, 48), np.float64) for k in exact.key])
    expected = 0.999 * np.asarray(kernel, np.float64) + np.einsum(
        "lri,lor->lio", a, np.asarray(exact.factor, np.float64))
    for update in (exact, plain):
        merged = np.asarray(jax.jit(lambda k, u: u.merge_into(k))(kernel, update))
        np.testing.assert_allclose(merged, expected, rtol=1e-6, atol=1e-7)
    # Its operands materialised as (in × r)·(r × out): the canonical product, which XLA:CPU runs
    # through YNNPACK (low_rank._delta_one); unitᵀ·(s·U)ᵀ over untransposed arrays is an Eigen dot.
    hlo = jax.jit(lambda k, u: u.merge_into(k)).lower(kernel, plain).compile().as_text()
    dims = re.findall(r" dot\(.*?lhs_contracting_dims=\{(\d)\}, rhs_contracting_dims=\{(\d)\}", hlo)
    assert dims == [("1", "0")], dims
