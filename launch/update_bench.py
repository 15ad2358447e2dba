"""The policy update the step-time benchmarks run, built as the trainer builds it.

`bench_config` is configs/base.py with a width-d random decoder (head_dim 64, GQA 2:1, MLP 3d,
per-layer remat); `random_update` assembles that config's run from shapes (rl/assembly.py) with a
given vocabulary, draws its weights straight into their shards and a random batch: the trainer's
own jitted update (`PolicyUpdate`), its optimizer and loss, on arrays ready to run.
"""


def bench_config(width: int, layers: int, rows: int, prompt_length: int, completion_length: int,
                 rank: int, dtype: str, micro_steps: int = 1):
    """configs/base.py with a ``width``-wide random decoder and ``micro_steps`` micro-batches of
    ``rows`` per update."""
    from configs import base
    c = base.get_config()
    c.model.source = "tiny"
    c.model.dtype = dtype
    c.model.remat = True
    c.model.tiny.update(hidden_size=width, num_layers=layers, num_heads=width // 64,
                        num_kv_heads=max(1, width // 128), head_dim=64, intermediate_size=3 * width,
                        max_position_embeddings=prompt_length + completion_length)
    c.data.prompts_per_step = rows * micro_steps // 2
    c.rl.num_generations = 2
    c.rl.micro_batch_size = rows
    c.rl.max_prompt_length = prompt_length
    c.rl.max_completion_length = completion_length
    c.optimizer.logra.rank = rank
    return c


def random_update(config, model_config, mesh, seed: int = 0):
    """(PolicyUpdate, params, opt_state, batch) of ``config``'s run with ``model_config``'s shapes
    on ``mesh``: random weights, the optimizer's initial state and a random batch of a step."""
    import jax
    import jax.numpy as jnp
    from logra_jax import sharding as sharding_lib
    from logra_jax.rl.assembly import Recipe
    from logra_jax.rl.policy import Sequences
    from logra_jax.rl.update import TrainBatch

    run = Recipe.of(config).abstract(mesh, model_config=model_config)
    params, opt_state = run.random_state(seed)
    rows, rl = run.recipe.rows, config.rl
    p, c = rl.max_prompt_length, rl.max_completion_length
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), 3)
    tokens = jax.random.randint(keys[0], (rows, p + c), 0, model_config.vocab_size, jnp.int32)
    seqs = Sequences(tokens=tokens, segment_mask=jnp.ones((rows, p + c), bool),
                     positions=jnp.broadcast_to(jnp.arange(p + c, dtype=jnp.int32), (rows, p + c)),
                     completion_mask=jnp.ones((rows, c), bool), prompt_length=p)
    batch = TrainBatch(seqs=seqs, advantages=jax.random.normal(keys[1], (rows,)),
                       rollout_logp=-jax.random.uniform(keys[2], (rows, c)),
                       ref_logp=jnp.zeros((rows, c)), completed=jnp.ones((rows,), bool))
    batch = jax.device_put(batch, sharding_lib.batch_sharding(mesh, rows))
    return run.update, params, opt_state, batch


def width_configs(widths, layers, rows, prompt_length, completion_length, rank, dtype,
                  micro_steps=1, vocab=8192):
    """(mesh over this process's devices, [(width, config, model config)]) of the benchmark."""
    import jax
    from logra_jax import model_shapes
    from logra_jax.rl.build import build_mesh

    mesh = build_mesh({"fsdp": -1, "tensor": 1}, jax.devices(), spare_devices=True)
    setups = []
    for width in widths:
        config = bench_config(width, layers, rows, prompt_length, completion_length, rank, dtype,
                              micro_steps)
        setups.append((width, config,
                       model_shapes.model_config_from(config.model).replace(vocab_size=vocab)))
    return mesh, setups
