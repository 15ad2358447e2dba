"""`make gpu-check` and what it needs: the driver end to end on CPU at toy sizes, the `does not fit`
verdict from XLA's own figure, the `random:` model source, the tokenizer from a GGUF's header alone,
the dependency-free `sums` prompts and the air-gapped bundle."""

import json
import os
import pathlib
import subprocess
import sys
import tarfile

import jax
import numpy as np
import pytest

from configs import base
from logra_jax import model_shapes
from logra_jax.models import gguf_loader
from logra_jax.rl import build
from process_env import without_device_count

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check_on_cpu(tmp_path_factory):
    """The whole driver (every part, toy sizes, ALLOW_CPU=1) with a 1 MiB budget per device, run
    once: (its finished process, its --out folder)."""
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    env = without_device_count(ALLOW_CPU="1")   # the parts set their own device counts
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    done = subprocess.run([sys.executable, "-m", "launch.gpu_check", "--out", str(out),
                           "--memory_budget_gib", "0.001"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    return done, out


def test_gpu_check_on_cpu_writes_its_tables_and_an_update_that_does_not_fit(gpu_check_on_cpu):
    """Both updates are refused by XLA:CPU's plan, each with XLA's own figure, and every other
    part leaves its figures in gpu_check.json and gpu_check.md."""
    done, out = gpu_check_on_cpu
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    page = (out / "gpu_check.md").read_text()

    assert result["versions"]["backend"] == "cpu"
    assert result["versions"]["mem_fraction"] == result["mem_fraction"] == "0.95"
    for opt in ("logra", "adamw"):
        m = result["memory"][opt]
        assert m["fits"] is False, m
        # XLA:CPU's plan of the compiled update is the figure, judged against the stated budget.
        assert m["needs_bytes"] == m["predicted_peak"] > m["limit_bytes"] == int(0.001 * 2**30)
        assert "first_update_seconds" not in m      # refused before it ran
        line = f"{opt}: does not fit: needs {m['needs_bytes'] / 2**30:.2f} GiB"
        assert line in (out / f"memory_{opt}.out").read_text()
        assert f"does not fit: needs {m['needs_bytes'] / 2**30:.2f} GiB" in page
    # The deviceless XLA:GPU plan: a figure where this checkout has the target, else why not.
    plan = result["plan_gpu"]
    assert ("absent" in plan and plan["absent"]) or set(plan["peak"]) | set(plan["refused"])
    assert [w["width"] for w in result["time"]["widths"]] == [128]
    assert {r["decode_weights"] for r in result["sampler"]["rows"]} == {"stacked", "per_layer"}
    kernels = result["kernels"]["rows"]   # through Pallas' interpreter here
    assert [r["rows"] for r in kernels] == [2] and all(r["ok"] for r in kernels)
    assert all(r["logits_rel_diff"] <= r["tolerance"] for r in kernels), kernels
    rollout = result["rollout"]   # the static engine and the slot engine, the same tokens
    assert [e["engine"] for e in rollout["engines"]] == ["static", "slots 2"]
    assert rollout["same_tokens"]
    assert all(e["kept_tokens"] == rollout["kept_tokens"] for e in rollout["engines"])
    assert all(e["seconds"] > 0 and e["row_steps"] >= e["kept_tokens"] for e in rollout["engines"])
    rl = result["rl"]
    assert rl["steps"] == 2 and rl["steady"]["step_seconds"] > 0
    assert rl["steady"]["generated_tokens_per_second_per_device"] > 0
    assert all(p["status"] == "ok" for name, p in result["parts"].items() if name != "plan_gpu")
    for heading in ("## Peak memory", "## Update time", "## Decode kernels against the layers",
                    "## Sampler", "## Rollout: the static engine against the slot engine",
                    "## Seconds per RL step", "## Commands"):
        assert heading in page
    assert "python -m launch.rl_step_time --config configs/tiny.py" in page


def test_sampler_bench_compares_decode_modes_side_by_side(gpu_check_on_cpu):
    """launch.sampler_bench on the tiny model, as the driver's sampler part runs it (one device,
    2 rows, per_layer then stacked): one row per decode mode, the second timed against the first
    (docs/results/sampler.md's figures come from the same command on SmolLM2)."""
    done, out = gpu_check_on_cpu
    assert done.returncode == 0, done.stderr[-3000:]
    printed = (out / "sampler.out").read_text()
    rows = [line.split() for line in printed.splitlines() if line.split()[:2] == ["1", "2"]]
    assert [row[2] for row in rows] == ["per_layer", "stacked"]
    # time/first is each mode's seconds over the first one's, so also its tokens/s (column 4)
    # over the first one's, inverted: equal to the printed digits' rounding (tokens/s to 0.05,
    # the ratio to 0.0005).
    assert float(rows[0][-1]) == 1.0
    first, second = float(rows[0][4]), float(rows[1][4])
    slack = 0.0005 + first / second * (0.05 / first + 0.05 / second)
    assert abs(float(rows[1][-1]) - first / second) <= slack, rows
    # One device: the decode step's products alone, and the best ratio they leave (≤ the limit).
    assert all(float(row[7]) > 0 and 0 < float(row[8]) for row in rows)
    # With both programs timed, the line saying which auto's rule runs here and which was faster.
    (advice,) = [line for line in printed.splitlines() if "auto's rule" in line]
    assert "on 1 cpu device(s): per_layer; faster here: " in advice, advice
    ratio = float(rows[1][-1])   # stacked's seconds over per_layer's, to 3 digits
    if ratio != 1.0:
        assert f"faster here: {'stacked' if ratio < 1 else 'per_layer'} " in advice, advice


def test_gpu_check_without_a_gpu_refuses_unless_allowed(tmp_path):
    env = dict(os.environ)
    env.pop("ALLOW_CPU", None)
    done = subprocess.run([sys.executable, "-m", "launch.gpu_check", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("error: jax sees no CUDA device")


def test_the_plan_target_is_the_gpu_node_the_device_kind_names():
    """The deviceless plan's target for the GPU the check runs on, from the machine table: each
    GPU node's own device name (as XLA's target config records what CUDA reported) picks that
    node; a GPU the table lacks picks none (the check then plans for h200-8)."""
    from logra_jax.perf import machines
    nodes = [m for m in machines.MACHINES.values() if m.kind == "gpu"]
    assert {m.name for m in nodes} == {"a100-80gb-8", "h100-8", "h200-8", "b200-8"}
    for node in nodes:
        assert machines.gpu_node_for(node.device_name) is node, node.device_name
    assert machines.gpu_node_for("NVIDIA L4") is None


def test_xla_needs_reads_the_figure_xla_states():
    """The H200's words for the 7B AdamW update (docs/results/gpu.md): the rematerialization
    pass's whole-program figure wins over one allocation's."""
    from logra_jax.perf.oom import xla_needs
    log = ("W external/xla/xla/hlo/transforms/simplifiers/hlo_rematerialization.cc:3005] Can't "
           "reduce memory use below 130.43GiB (140047619440 bytes) by rematerialization; only "
           "reduced to 167.29GiB (179625187264 bytes), down from 171.10GiB\n"
           "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
           "80.10GiB.")
    needs, line = xla_needs(log)
    assert needs == int(167.29 * 2**30) and "only reduced to 167.29GiB" in line
    needs, line = xla_needs(log.split("\n")[1])
    assert needs == int(80.10 * 2**30) and "trying to allocate" in line
    assert xla_needs("RESOURCE_EXHAUSTED: something else") is None


TOY_SHAPE = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                 head_dim=16, intermediate_size=48, rope_theta=1e4, rms_norm_eps=1e-6,
                 qkv_bias=True, tie_embeddings=False, max_position_embeddings=64)


def _random_params(source: str, seed: int, param_dtype: str = "float32") -> dict:
    cfg = base.get_config().model
    cfg.update(source=source, init_seed=seed, param_dtype=param_dtype)
    model, tokenizer = build.build_model(cfg, build.build_mesh({"fsdp": 1, "tensor": 1},
                                                               jax.devices()[:1]))
    assert tokenizer.vocab_size == gguf_loader.smollm2_tokenizer().vocab_size
    from logra_jax.rl.policy import Policy
    from logra_jax.tree_paths import leaves_with_paths
    return {k: np.asarray(v) for k, v in leaves_with_paths(Policy.params_of(model))}


def parameter_count(s: dict) -> int:
    """A shape's parameters from its published dims: the embedding, per layer q/k/v/o (+ q/k/v
    biases), gate/up/down and two norms, a final norm, and an untied head."""
    d, q, kv, f = (s["hidden_size"], s["num_heads"] * s["head_dim"],
                   s["num_kv_heads"] * s["head_dim"], s["intermediate_size"])
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d + (q + 2 * kv) * s["qkv_bias"]
    head = 0 if s["tie_embeddings"] else d * s["vocab_size"]
    return s["vocab_size"] * d + s["num_layers"] * per_layer + d + head


def test_random_source_is_seeded_with_the_named_shape(monkeypatch):
    monkeypatch.setitem(model_shapes.MODEL_SHAPES, "toy", TOY_SHAPE)
    a, again, other = (_random_params("random:toy", seed) for seed in (0, 0, 1))
    assert sum(x.size for x in a.values()) == parameter_count(TOY_SHAPE)
    assert a["lm_head/kernel"].shape == (32, 96)              # the shape's untied head
    assert a.keys() == again.keys() == other.keys()
    assert all(np.array_equal(a[k], again[k]) for k in a)
    kernels = [k for k in a if k.endswith("kernel")]
    assert all(not np.array_equal(a[k], other[k]) for k in kernels)


def test_smollm2_shape_is_the_shipped_models():
    """random:smollm2_135m (the sampler part's model) has SmolLM2-135M's dims, those of the shipped
    GGUF's own header, and so its 134.5 M parameters (counted on the abstract model: drawing 135 M
    random weights costs the suite a minute)."""
    from flax import nnx
    from logra_jax.models import Decoder
    s = model_shapes.MODEL_SHAPES["smollm2_135m"]
    meta = gguf_loader.gguf_metadata(gguf_loader.smollm2_gguf_path())
    assert (s["hidden_size"], s["num_layers"], s["num_heads"], s["num_kv_heads"],
            s["intermediate_size"], s["max_position_embeddings"], s["vocab_size"]) == (
        meta["llama.embedding_length"], meta["llama.block_count"],
        meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"],
        meta["llama.feed_forward_length"], meta["llama.context_length"],
        len(meta["tokenizer.ggml.tokens"]))
    assert s["rope_theta"] == meta["llama.rope.freq_base"]
    cfg = base.get_config().model
    cfg.source = "random:smollm2_135m"
    model = nnx.eval_shape(lambda: Decoder(build.build_model_config(cfg), rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == parameter_count(s) == 134_515_008


def test_random_source_names_the_known_shapes():
    cfg = base.get_config().model
    cfg.source = "random:qwen9"
    with pytest.raises(ValueError, match="unknown model shape 'qwen9'; known shapes: .*qwen2_5_1_5b"):
        build.build_model(cfg, None)


def test_tokenizer_from_a_gguf_header_alone(tmp_path, monkeypatch):
    """The first gguf_header_size bytes (1,785,664 of SmolLM2's 98 MB) are the whole tokenizer."""
    source = gguf_loader.smollm2_gguf_path()
    header = tmp_path / "smollm2_header.gguf"
    size = gguf_loader.write_gguf_header(source, header)
    assert size == header.stat().st_size < source.stat().st_size / 50
    full = gguf_loader.smollm2_tokenizer()
    text = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>"
    try:
        monkeypatch.setenv(gguf_loader.TOKENIZER_GGUF_ENV, str(header))
        gguf_loader.smollm2_tokenizer.cache_clear()
        small = gguf_loader.smollm2_tokenizer()
        assert small is not full
        assert small.vocab_size == full.vocab_size and small.eos_id == full.eos_id
        assert small.encode(text) == full.encode(text)
        # One byte short of the header: the metadata cannot be read whole.
        cut = tmp_path / "cut.gguf"
        cut.write_bytes(header.read_bytes()[:size // 2])
        monkeypatch.setenv(gguf_loader.TOKENIZER_GGUF_ENV, str(cut))
        gguf_loader.smollm2_tokenizer.cache_clear()
        with pytest.raises(Exception):
            gguf_loader.smollm2_tokenizer()
        monkeypatch.setenv(gguf_loader.TOKENIZER_GGUF_ENV, str(tmp_path / "missing.gguf"))
        gguf_loader.smollm2_tokenizer.cache_clear()
        with pytest.raises(FileNotFoundError, match="LOGRA_TOKENIZER_GGUF=.*missing.gguf is not a file"):
            gguf_loader.smollm2_tokenizer()
    finally:
        gguf_loader.smollm2_tokenizer.cache_clear()   # the other tests' tokenizer: the package's


def test_sums_prompts_are_seeded_and_right():
    cfg = base.get_config().data
    cfg.update(source="sums", size=50, task_seed=3)
    source = build.build_prompt_source(cfg)
    again = build.build_prompt_source(cfg)
    cfg.task_seed = 4
    other = build.build_prompt_source(cfg)
    assert len(source) == 50
    assert [source[i] for i in range(50)] == [again[i] for i in range(50)]
    assert [source[i] for i in range(50)] != [other[i] for i in range(50)]
    for i in range(50):
        a, b = source[i]["question"].removeprefix("What is ").removesuffix("?").split(" + ")
        assert source[i]["answer"] == str(int(a) + int(b))
    with pytest.raises(IndexError):
        source[50]


def test_gpu_bundle_holds_the_tree_and_the_tokenizer_header_within_64_mib(tmp_path):
    """The bundle without wheels (a test downloads nothing): the tracked sources, the GGUF header
    and the instructions, under the size limit; the header in it loads the tokenizer."""
    bundle = tmp_path / "bundle.tar.gz"
    done = subprocess.run([sys.executable, "-m", "launch.gpu_bundle", "--out", str(bundle),
                           "--wheels", ""], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert bundle.stat().st_size <= 64 * 2**20
    with tarfile.open(bundle) as tar:
        names = set(tar.getnames())
        assert {"logra_jax/launch/gpu_check.py", "logra_jax/launch/gpu_check_versions.py",
                "logra_jax/launch/gpu_check_page.py", "logra_jax/logra_jax/perf/machines.py",
                "logra_jax/logra_jax/perf/gpu_specs/h200.txtpb", "logra_jax/Makefile",
                "logra_jax/pyproject.toml", "logra_jax/bundle/smollm2_header.gguf",
                "logra_jax/bundle/README.md"} <= names
        assert not any("/.venv/" in n or "/runs/" in n for n in names)
        tar.extract("logra_jax/bundle/smollm2_header.gguf", tmp_path, filter="data")
    header = tmp_path / "logra_jax" / "bundle" / "smollm2_header.gguf"
    meta = gguf_loader.gguf_metadata(header)
    assert len(meta["tokenizer.ggml.tokens"]) == gguf_loader.smollm2_tokenizer().vocab_size


def test_rl_step_time_runs_a_shape_config_with_random_weights_and_the_reference_batch():
    """launch.rl_step_time's config: configs/qwen2_5_1_5b.py's shape becomes random:, the prompts
    the dependency-free sums, and --reference_batch the reference's 16 × 8 rows of 512 + 1536
    tokens, one row per device per micro-step — a config the loop accepts. (In a process of its
    own: the launch modules each define --config, and absl refuses a flag defined twice.)"""
    script = """if True:
        import json, sys
        sys.argv = ["rl_step_time"]
        import jax
        from configs import qwen2_5_1_5b
        from launch.rl_step_time import prepare
        from logra_jax.rl import build
        config = prepare(qwen2_5_1_5b.get_config(), 3, "sums", True)
        build.validate(config)
        print(json.dumps(dict(source=config.model.source, data=config.data.source,
                              steps=config.max_steps, prompts=config.data.prompts_per_step,
                              generations=config.rl.num_generations,
                              lengths=[config.rl.max_prompt_length, config.rl.max_completion_length],
                              micro=config.rl.micro_batch_size, devices=jax.device_count(),
                              width=build.build_model_config(config.model).hidden_size)))
    """
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    data, rl = base.REFERENCE_BATCH
    assert got == dict(source="random:qwen2_5_1_5b", data="sums", steps=3,
                       prompts=data["prompts_per_step"], generations=rl["num_generations"],
                       lengths=[rl["max_prompt_length"], rl["max_completion_length"]],
                       micro=got["devices"], devices=got["devices"], width=1536)
