"""Bytes per policy sync, trainer → rollout engine, for each sync mode (docs/algorithm.md §8).

    python -m launch.sync_bench [--configs=configs/tiny.py,configs/default.py,configs/qwen2_5_7b_gsm8k.py]
                                [--sparse_fraction=0.01] [--measure_updates=3]
                                [--measure_config=configs/tiny.py] [--measure_variants=kl,grpo]
                                [--measure_param_dtypes=float32,bfloat16]

Part 1, analytic (from parameter shapes only, no weights): for every config and both LoGRA variants
the bytes one sync sends in each mode, and their ratio to the full bf16 weights. KL variant: bf16 U,
non-targets frozen; GRPO variant: fp32 U (``logra(variant="learning_rate")``'s default) or bf16 U
(``optimizer.logra.factor_dtype="bfloat16"``), non-targets trained by AdamW and therefore sent in full. ``sparse`` depends on how many bf16 entries change,
which only a run can tell: it is shown at ``--sparse_fraction`` of the trainable entries.

Part 2, measured (``--measure_updates`` > 0): ``--measure_config`` (default configs/tiny.py)
trained for that many real updates per variant and trainer weight dtype (fp32 master, or bf16
with stochastic-rounding merges) on 4 devices while 4 others roll out, every mode's message built from each update and
applied by its own receiver: bytes sent, the fraction of bf16 entries that changed, the log-prob
mismatch trainer ↔ sampler, the drift of a factors receiver without the master copy, and the time
of one sync (CPU-simulated devices: only the ratios carry over to real hardware).
"""

import os
import sys

from absl import flags

from launch import cli

from configs import base

# The default job is configs/default.py where it exists; configs/base.py has the same model and rank.
_DEFAULT_JOB = "configs/default.py" if os.path.exists("configs/default.py") else "configs/base.py"
_CONFIGS = flags.DEFINE_list(
    "configs", ["configs/tiny.py", _DEFAULT_JOB, "configs/qwen2_5_7b_gsm8k.py"],
    "Config files whose model shapes and sketch rank to tabulate.")
_SPARSE_FRACTION = flags.DEFINE_float(
    "sparse_fraction", 0.01, "Assumed fraction of trainable bf16 entries that change per sync, for "
    "the analytic sparse row (docs/algorithm.md §8: ~99 % of RL-step changes are below bf16 resolution).")
_MEASURE_UPDATES = flags.DEFINE_integer(
    "measure_updates", 3, "Real updates per variant for the measured table (0: analytic only).")
_MEASURE_VARIANTS = flags.DEFINE_list(
    "measure_variants", ["kl", "grpo"], "LoGRA variants of the measured table (kl, grpo).")
_MEASURE_DTYPES = flags.DEFINE_list(
    "measure_param_dtypes", ["float32", "bfloat16"], "Trainer weight dtypes of the measured table: "
    "float32 master weights, or bfloat16 weights merged with stochastic rounding.")
_MEASURE_CONFIG = flags.DEFINE_string(
    "measure_config", "configs/tiny.py", "Config of the measured run (its model, data, rank and "
    "learning rates; the variant is set per row).")

# name: (optimizer.logra overrides, rl overrides, bytes per U entry): configs/base.py's presets.
VARIANTS = {"kl": (*base.LOGRA_VARIANTS["kl"], 2), "grpo": (*base.LOGRA_VARIANTS["grpo"], 4)}
# Analytic only: the GRPO variant with optimizer.logra.factor_dtype="bfloat16" (U rounded before the merge).
ANALYTIC_VARIANTS = dict(VARIANTS, **{"grpo, bf16 U": (dict(base.LOGRA_VARIANTS["grpo"][0],
                                                            factor_dtype="bfloat16"),
                                                       base.LOGRA_VARIANTS["grpo"][1], 2)})
MODES = ("full", "factors", "sparse")


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def model_config(model_cfg):
    """The ModelConfig of a config's model, from shapes or GGUF metadata only (no weights read)."""
    from logra_jax import model_shapes
    from logra_jax.models import gguf_loader, pretrained
    if model_cfg.source == "tiny" or model_shapes.is_shape_source(model_cfg.source):
        return model_shapes.model_config_from(model_cfg)
    if model_cfg.source.lower() in pretrained.KNOWN_MODELS:
        import gguf
        return gguf_loader.config_from_gguf(gguf.GGUFReader(gguf_loader.smollm2_gguf_path()))
    raise ValueError(f"sync_bench: model.source={model_cfg.source!r} is neither 'tiny', a "
                     f"'shape:<name>' nor a known model; its shapes are not available offline")


def abstract_params(model_config):
    from flax import nnx
    from logra_jax.models import Decoder
    abstract = nnx.eval_shape(lambda: Decoder(model_config, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(abstract, nnx.Param))


def analytic_table(config_paths, sparse_fraction: float) -> list[str]:
    from logra_jax import config as config_lib
    from logra_jax.optim import SketchSpec
    from logra_jax.rl.sync_bytes import sync_bytes
    lines = [f"Analytic bytes per sync (sampler bf16; sparse at {sparse_fraction:.1%} of trainable "
             f"entries changed; ratios vs the full bf16 weights)", "",
             "| config | model | variant | rank | bf16 weights | full | factors | sparse | "
             "targets: U / W (≤ r/in) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path in config_paths:
        config = config_lib.load_config_file(path)
        mc = model_config(config.model)
        params = abstract_params(mc)
        spec = SketchSpec(targets=config.optimizer.logra.targets, rank=config.optimizer.logra.rank)
        model = f"{config.model.source} (L{mc.num_layers} d{mc.hidden_size})"
        for variant, (opt, _, u_bytes) in ANALYTIC_VARIANTS.items():
            b = sync_bytes(params, spec, train_others=opt["others"] != "frozen",
                           factor_itemsize=u_bytes,
                           sparse_fraction=sparse_fraction)
            cells = [f"{_gib(getattr(b, m))} ({b.ratio(m):.2%})" for m in MODES]
            share = b.target_factors / b.target_weights
            lines.append(f"| {path} | {model} | {variant} | {spec.rank} | {_gib(b.weights)} | "
                         + " | ".join(cells)
                         + f" | {share:.2%} (r/in ≤ {b.max_rank_ratio:.2%}, U {u_bytes} B) |")
    return lines


def measured_table(config_path: str, updates: int, variants=tuple(VARIANTS),
                   param_dtypes=("float32", "bfloat16")) -> list[str]:
    """A config's RL loop on 4 + 4 devices: every mode's message from the same real updates, for
    each variant and trainer weight dtype."""
    import collections
    import time

    import jax
    import numpy as np

    from logra_jax import config as config_lib
    from logra_jax import sharding as sharding_lib
    from logra_jax.rl import assembly, build, optimizers, sync
    from logra_jax.rl.policy import Policy
    from logra_jax.rl.rollout import collect_rollouts
    from logra_jax.rl.update import TrainBatch

    receivers = {"full": ("full", True), "sparse": ("sparse", True), "factors": ("factors", True),
                 "factors, no master": ("factors", False)}
    lines = [f"Measured: {config_path}, {updates} real updates per variant, trainer on 4 devices "
             f"(fsdp 4), sampler on 4 others (fsdp 2 × tensor 2); means over the updates", "",
             "| variant | weights | receiver | bytes/sync | vs full | changed bf16 entries | "
             "sparse encodings (leaves) | mismatch (mean abs log-prob) | "
             "trainable weights ≠ trainer's bf16 | sync time* |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    train_devices, rollout_devices = sync.split_devices(4)
    train_mesh = build.build_mesh({"fsdp": 4, "tensor": 1}, train_devices)
    rollout_mesh = build.build_mesh({"fsdp": 2, "tensor": 2}, rollout_devices)
    for variant, param_dtype in [(v, d) for v in variants for d in param_dtypes]:
        opt_over, rl_over, _ = VARIANTS[variant]
        config = config_lib.load_config_file(config_path)
        config.optimizer.logra.update(opt_over)
        config.rl.update(rl_over)
        config.model.param_dtype = param_dtype
        rl = config.rl
        build.validate(config)
        model, tokenizer = build.build_model(config.model, train_mesh)
        policy = Policy(model)
        params = Policy.params_of(model)
        optimizer = optimizers.build(config.optimizer)
        # The trainer's own update: the config's whole loss (epsilon, beta, temperature, ...).
        step = build.build_policy_update(config, policy, optimizer=optimizer, return_updates=True)
        opt_state = jax.jit(optimizer.tx.init,
                            out_shardings=sharding_lib.opt_state_shardings(optimizer.tx, params))(params)
        sampler = build.build_sampler(rl, policy, tokenizer)
        on_train = sharding_lib.batch_sharding(train_mesh, assembly.rows_per_step(config))
        on_rollout = sharding_lib.batch_sharding(rollout_mesh, assembly.rows_per_step(config))
        kw = dict(sketch=optimizer.sketch, train_others=optimizer.train_others)
        # One sender per receiver: factors and sparse messages are deltas numbered per sender.
        senders = {name: sync.SyncSender(mode, params, **kw) for name, (mode, _) in receivers.items()}
        engines = {name: sync.RolloutEngine(policy, params, sync.rollout_shardings(model, rollout_mesh),
                                            mode=mode, master_copy=master,
                                            temperature=rl.temperature, **kw)
                   for name, (mode, master) in receivers.items()}
        data = build.build_data(config.data, config.seed)
        spec, grader = build.build_rollout_spec(config), build.build_grader(rl)
        stats = {name: dict(bytes=[], full=[], mismatch=[], time=[], changed=[],
                            encodings=collections.Counter()) for name in receivers}
        for i in range(updates):
            ro = collect_rollouts(sampler, engines["factors"].params, tokenizer, data.next(), spec,
                                  jax.random.PRNGKey(i), on_rollout)
            rewards = grader(ro.texts, ro.golds)
            # Random advantages: a real update even when every reward is equal (a random tiny
            # policy earns none); what is measured is the sync, not learning.
            adv = np.asarray(jax.random.normal(jax.random.PRNGKey(i), rewards.shape))
            seqs, logp, completed = jax.device_put((ro.seqs, ro.rollout_logp, ro.completed), on_train)
            # The sampler's log-probs stand in for a reference (a KL penalty, if the config has one,
            # then starts near zero).
            batch = TrainBatch(seqs=seqs, advantages=jax.device_put(adv, on_train), rollout_logp=logp,
                               ref_logp=logp, completed=completed)
            params, opt_state, _, compact = step(params, opt_state, batch)
            probe = jax.tree.map(lambda x: x[:2], seqs)
            for name, (mode, _) in receivers.items():
                tic = time.perf_counter()
                message = senders[name].message(params, updates=compact.low_rank,
                                                update_index=int(compact.update_index))
                engines[name].receive(message)
                jax.block_until_ready(engines[name].params)
                stats[name]["time"].append(time.perf_counter() - tic)
                stats[name]["bytes"].append(message.nbytes)
                stats[name]["full"].append(senders[name].full_bytes)
                stats[name]["mismatch"].append(engines[name].mismatch(params, probe))
                if mode == "sparse":
                    stats[name]["changed"].append(sum(message.num_changed.values()))
                    stats[name]["encodings"].update(message.encodings.values())
        trainable_entries = senders["full"].full_bytes // 2
        for name in receivers:
            s = stats[name]
            drift = sync.weight_drift(engines[name].params, params, paths=engines[name].trainable)
            changed = (f"{np.mean(s['changed']) / trainable_entries:.2%}" if s["changed"] else "")
            # The first sync of each receiver compiles its programs: time the later ones.
            timed = s["time"][1:] or s["time"]
            encodings = ", ".join(f"{k} {n / updates:g}" for k, n in sorted(s["encodings"].items()))
            lines.append(f"| {variant} | {param_dtype} | {name} | {_gib(np.mean(s['bytes']))} | "
                         f"{np.mean(s['bytes']) / np.mean(s['full']):.2%} | {changed} | {encodings} | "
                         f"{np.mean(s['mismatch']):.3g} | {drift['frac_differing']:.2%} "
                         f"(max {drift['max_abs']:.2g}) | {np.mean(timed) * 1e3:.0f} ms |")
    lines += ["", "* mean over the syncs after the first; on CPU-simulated devices, and sparse includes "
              "compiling the patch programs of bucket sizes not seen before."]
    return lines


def main(argv):
    del argv
    from launch import process
    process.setup(8)   # 4 devices train, 4 roll out
    for path in _CONFIGS.value + [_MEASURE_CONFIG.value]:
        if not os.path.exists(path):
            sys.exit(f"error: config file {path!r} not found")
    if not 0.0 <= _SPARSE_FRACTION.value <= 1.0:
        sys.exit(f"error: --sparse_fraction must be in [0, 1], got {_SPARSE_FRACTION.value}")
    print("\n".join(analytic_table(_CONFIGS.value, _SPARSE_FRACTION.value)), flush=True)
    if _MEASURE_UPDATES.value > 0:
        print()
        unknown = set(_MEASURE_VARIANTS.value) - set(VARIANTS)
        if unknown:
            sys.exit(f"error: --measure_variants: unknown {sorted(unknown)}; choose from {sorted(VARIANTS)}")
        bad_dtypes = set(_MEASURE_DTYPES.value) - {"float32", "bfloat16"}
        if bad_dtypes:
            sys.exit(f"error: --measure_param_dtypes: {sorted(bad_dtypes)}; choose float32, bfloat16")
        print("\n".join(measured_table(_MEASURE_CONFIG.value, _MEASURE_UPDATES.value,
                                        _MEASURE_VARIANTS.value, _MEASURE_DTYPES.value)))


if __name__ == "__main__":
    cli.run(main)
