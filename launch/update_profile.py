"""Where one update's wall time goes, LoGRA against AdamW (``launch.step_time --profile``).

Per width, one update of each optimizer (after two warm-up calls) runs under ``jax.profiler`` and
logra_jax/perf/profiling.py splits its wall time into categories (the model's matmuls and other
operations, LoGRA's sketch products, A's generation, the merge, the optimizer).
"""

from launch.update_bench import random_update, width_configs


def profile_widths(widths, layers, rows, prompt_length, completion_length, rank, dtype,
                   micro_steps=1, vocab=8192):
    """[(width, {optimizer: profiling.Profile})]: one profiled update each, after two warm-ups
    (the first calls after a compile run slower: fresh buffers)."""
    import jax
    from logra_jax.perf import profiling

    mesh, setups = width_configs(widths, layers, rows, prompt_length, completion_length, rank,
                                 dtype, micro_steps, vocab)
    results = []
    for width, config, model_config in setups:
        profiles = {}
        for name in ("logra", "adamw"):
            config.optimizer.name = name
            update, params, opt_state, batch = random_update(config, model_config, mesh)
            compiled = update.jitted(params, opt_state).lower(params, opt_state, batch).compile()
            for _ in range(2):
                params, opt_state, _ = jax.block_until_ready(compiled(params, opt_state, batch))
            profiles[name], _ = profiling.profile_call(compiled, (params, opt_state, batch))
            del update, params, opt_state, batch, compiled
        results.append((width, profiles))
    return results


def print_profiles(results):
    from logra_jax.perf import profiling
    order = ([profiling.MATMULS, profiling.OTHER] + [name for _, name in profiling.SCOPES]
             + [profiling.IDLE])
    for width, profiles in results:
        print(f"width {width}: wall ms of one update, split by logra_jax/perf/profiling.py")
        print(f"{'':38} {'logra ms':>9} {'adamw ms':>9} {'logra − adamw':>14}")
        for name in order:
            ms = {k: p.categories.get(name, 0.0) for k, p in profiles.items()}
            if any(ms.values()):
                print(f"{name:38} {ms['logra']:>9.1f} {ms['adamw']:>9.1f} "
                      f"{ms['logra'] - ms['adamw']:>+14.1f}")
        total = {k: sum(p.categories.values()) for k, p in profiles.items()}
        print(f"{'total (traced)':38} {total['logra']:>9.1f} {total['adamw']:>9.1f} "
              f"{total['logra'] - total['adamw']:>+14.1f}   ratio {total['logra'] / total['adamw']:.3f}")
