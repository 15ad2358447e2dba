"""The matrix-product operations of a real config's update, LoGRA against AdamW, from shapes alone
(``launch.step_time --config C --count_ops``): what the two updates' arithmetic allows, every loop
iteration counted (logra_jax/perf/matmul_count.py)."""


def ratio(a: float, b: float) -> float:
    """a / b of two FLOP counts; NaN where ``b`` is 0 (a backend whose products the count does
    not recognise reports 0: no ratio, not a crash)."""
    return a / b if b else float("nan")


def count_ops(config) -> dict:
    """{optimizer: matmul_count.MatmulCount} of one update of ``config``, compiled from abstract
    arrays on one device (the config's mesh replaced by one device: FSDP splits only rows)."""
    import jax
    from logra_jax.perf import matmul_count
    from logra_jax.perf.plan import Plan
    from logra_jax.rl.build import build_mesh

    mesh = build_mesh({"fsdp": 1, "tensor": 1}, jax.devices()[:1], spare_devices=True)
    counts = {}
    for name in ("logra", "adamw"):
        config.optimizer.name = name
        compiled = Plan.on(config, mesh).lower_update().lowered.compile()
        counts[name] = matmul_count.of_compiled(compiled)
    return counts


def print_counts(config, counts: dict) -> None:
    """The config's update and each optimizer's GFLOP of matrix products, then their ratio."""
    from logra_jax.config import rows_per_step
    c = config
    print(f"{c.model.source}: one update of {rows_per_step(c)} "
          f"rows × {c.rl.max_prompt_length + c.rl.max_completion_length} tokens in micro-batches "
          f"of {c.rl.micro_batch_size}, rank {c.optimizer.logra.rank}, remat {c.model.remat}")
    for name, n in counts.items():
        unknown = f" ({n.unknown_loops} loops of unknown length counted once)" if n.unknown_loops else ""
        print(f"  {name:6} {n.flops / 1e9:16,.1f} GFLOP of matrix products{unknown}")
    print(f"  logra/adamw {ratio(counts['logra'].flops, counts['adamw'].flops):.3f}")
