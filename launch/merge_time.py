"""The low-rank merge alone (``launch.step_time --merge``): per width, ``LowRankUpdate.merge_into``
of a stack of (d × 3d) MLP kernels — the order-free product of optim/order_free.py — against the
same merge with one plain fp32 dot, interleaved medians."""

import dataclasses
import statistics
import time


def time_merge(widths, layers, rank, repeats):
    """[(width, {"order-free": median ms, "plain dot": median ms})] for a (layers, d, 3d) stack."""
    import jax
    import jax.numpy as jnp
    from logra_jax.optim.low_rank import LowRankUpdate
    from logra_jax.projections import projection_keys

    merges = {"order-free": jax.jit(lambda k, u: u.merge_into(k), donate_argnums=0),
              "plain dot": jax.jit(lambda k, u: dataclasses.replace(u, exact=False).merge_into(k),
                                   donate_argnums=0)}
    results = []
    for width in widths:
        shape = (layers, width, 3 * width)
        update = LowRankUpdate(
            factor=jax.random.normal(jax.random.PRNGKey(1), (layers, 3 * width, rank)) * 1e-3,
            key=projection_keys(0, "layers/mlp/up_proj/kernel", 0, (layers,)),
            weight_scale=jnp.float32(1.0))
        kernels = {name: jax.random.normal(jax.random.PRNGKey(0), shape) for name in merges}
        times = {name: [] for name in merges}
        for i in range(repeats + 1):                      # the first round compiles
            for name in (list(merges) if i % 2 == 0 else list(merges)[::-1]):
                tic = time.perf_counter()
                kernels[name] = jax.block_until_ready(merges[name](kernels[name], update))
                if i:
                    times[name].append(1e3 * (time.perf_counter() - tic))
        results.append((width, {name: statistics.median(t) for name, t in times.items()}))
    return results


def print_merge(results, layers: int, rank: int, repeats: int) -> None:
    print(f"merge of {layers} layers (d × 3d), rank {rank}, fp32; median of {repeats} interleaved runs")
    print(f"{'width':>6} {'order-free ms':>14} {'plain dot ms':>13} {'ratio':>6}")
    for width, ms in results:
        print(f"{width:>6} {ms['order-free']:>14.1f} {ms['plain dot']:>13.1f} "
              f"{ms['order-free'] / ms['plain dot']:>6.2f}")
