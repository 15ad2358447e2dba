"""Logits parity with transformers (CPU torch) for tiny Llama (3.1) / Qwen2 / Qwen3 / Gemma 3
checkpoints read by from_pretrained, full forward and KV-cache decoding."""

import copy
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from logra_jax.models import from_pretrained  # noqa: E402
from logra_jax.models.hf_loader import read_safetensors  # noqa: E402
from logra_jax.sharding import make_mesh  # noqa: E402

VOCAB = 64
WORDS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"] + [
    f"w{i}" for i in range(VOCAB - 6)]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
            "<|{{ m['role'] }}|> {{ m['content'] | trim }} {{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
            "{% if tools is defined %}{{ tools | tojson }}{% endif %}")

LLAMA31_ROPE = dict(rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=64)
# Architectures differing in GQA ratio, q/k/v bias, q/k norm, tying, RoPE (base, llama3 and linear
# scaling), head_dim ≠ d/heads, sliding windows shorter than the test sequence, depth and width.
# Two widths (d, MLP, heads); every config adds its depth, GQA ratio and features.
NARROW = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4)
WIDE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_attention_heads=6)
CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(NARROW, num_hidden_layers=2, num_key_value_heads=2, rope_theta=5000.0,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(WIDE, num_hidden_layers=3, num_key_value_heads=1, rope_theta=1e6, rms_norm_eps=1e-6,
                   tie_word_embeddings=True)),
    "llama3.1": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                 dict(NARROW, num_hidden_layers=2, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-5,
                      rope_parameters=LLAMA31_ROPE, tie_word_embeddings=False)),
    "qwen3-tied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                   dict(NARROW, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                        rope_parameters=dict(rope_type="default", rope_theta=1e6),
                        tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(WIDE, num_hidden_layers=3, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6,
                   tie_word_embeddings=False)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(NARROW, num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                    query_pre_attn_scalar=24, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0,
                                                            rope_theta=1e5),
                                     "sliding_attention": dict(rope_type="default", rope_theta=50.0)},
                    tie_word_embeddings=True, attn_implementation="eager")),
    "gemma3-untied": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                      dict(WIDE, num_hidden_layers=2, num_key_value_heads=1, head_dim=8,
                           query_pre_attn_scalar=8, sliding_window=6,
                           layer_types=["full_attention", "sliding_attention"],
                           tie_word_embeddings=False, attn_implementation="eager")),
}
# What each config's loader must have switched on.
FEATURES = {  # num_kv_heads, qkv_bias, qk_norm, tied, rope scaling, sliding layers
    "llama": (2, False, False, False, None, ()), "qwen2": (1, True, False, True, None, ()),
    "llama3.1": (1, False, False, False, "llama3", ()),
    "qwen3-tied": (2, False, True, True, None, ()), "qwen3": (1, False, True, False, None, ()),
    "gemma3": (2, False, True, True, "linear", (True, False, True)),
    "gemma3-untied": (1, False, True, False, None, (False, True)),
}


def write_tokenizer(folder, template_in_jinja_file: bool):
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                                               unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens([tokenizers.AddedToken(w, special=True) for w in WORDS[:6]])
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}, "unk_token": "<unk>"}
    if template_in_jinja_file:
        (folder / "chat_template.jinja").write_text(TEMPLATE)
    else:
        config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def randomise(model, seed):
    """HF init gives near-uniform logits (std 0.02, zero biases): use larger weights so parity bites."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (folder, torch model in fp32)}; llama is saved sharded (index file), in bf16."""
    out = {}
    for i, (name, (config_cls, model_cls, kwargs)) in enumerate(CONFIGS.items()):
        torch.manual_seed(i)
        model = model_cls(config_cls(**kwargs)).eval()
        randomise(model, i)
        folder = tmp_path_factory.mktemp(name)
        if name == "llama":  # bf16 storage and several shards + index: the other loader paths
            with torch.no_grad():  # the fp32 reference holds exactly the bf16 values ...
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
            # ... and only the parameters are converted (model.to(bf16) would also round RoPE's inv_freq)
            copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder, max_shard_size="20KB")
        else:
            model.save_pretrained(folder)
        write_tokenizer(folder, template_in_jinja_file=(name == "llama"))
        out[name] = (folder, model)
    return out


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, size=(2, 11)).astype(np.int32)


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def forward(model):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, t, cache=None: nnx.merge(graphdef, state)(t, cache=cache)), state


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(checkpoints, tokens, name):
    folder, torch_model = checkpoints[name]
    assert name != "llama" or (folder / "model.safetensors.index.json").is_file()
    model, _ = from_pretrained(folder)
    c = model.config
    sliding = c.sliding_layers if c.layer_types else ()
    assert (c.num_kv_heads, c.qkv_bias, c.qk_norm, c.tie_embeddings,
            c.rope_scaling and c.rope_scaling.rope_type, sliding) == FEATURES[name]
    fn, state = forward(model)
    ours = np.asarray(fn(state, tokens))
    ref = torch_logits(torch_model, tokens)
    assert np.abs(ref).max() > 1.0  # logits are far from uniform: the comparison has teeth
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_prefill_and_decode_match_transformers(checkpoints, tokens, name):
    """Prefill 6 tokens, then decode one at a time: the logits equal transformers' full forward
    (so KV-cache decoding equals recompute), across sliding windows shorter than the sequence."""
    folder, torch_model = checkpoints[name]
    model, _ = from_pretrained(folder)
    fn, state = forward(model)
    logits, cache = fn(state, tokens[:, :6], cache=model.init_cache(2, 16))
    pieces = [logits]
    for i in range(6, tokens.shape[1]):
        step, cache = fn(state, tokens[:, i:i + 1], cache=cache)
        pieces.append(step)
    np.testing.assert_allclose(np.concatenate(pieces, 1), torch_logits(torch_model, tokens), atol=1e-4, rtol=0)


def test_sharded_load_matches_transformers(checkpoints, tokens):
    folder, torch_model = checkpoints["qwen2"]
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    model, _ = from_pretrained(folder, mesh=mesh)
    kernel = model.layers.mlp.gate_proj.kernel[...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    fn, state = forward(model)
    batch = np.concatenate([tokens] * 4)
    np.testing.assert_allclose(fn(state, batch), np.concatenate([torch_logits(torch_model, tokens)] * 4),
                               atol=1e-4, rtol=0)


def test_bf16_compute_is_close(checkpoints, tokens):
    folder, torch_model = checkpoints["qwen2"]
    model, _ = from_pretrained(folder, dtype="bfloat16", param_dtype="bfloat16", remat=True)
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16 and model.config.remat
    fn, state = forward(model)
    ours = np.asarray(fn(state, tokens))
    ref = torch_logits(torch_model, tokens)
    # bf16 weights and activations against transformers in fp32, on random weights: measured a
    # mean gap of 0.058 and a largest of 0.60 (logits up to 7.9, mean |logit| 1.7; XLA:CPU). A
    # mean gap under 1e-3 would mean bf16 was not used at all.
    gap = np.abs(ours - ref)
    assert 1e-3 < gap.mean() < 0.1 and gap.max() < 1.0, (gap.mean(), gap.max())
    # The bf16 weights alone give a gap of that size too. The same bf16 weights computed in fp32
    # show that the activations were bf16 as well: measured a mean gap of 0.043 (XLA:CPU); a
    # compute dtype left at fp32 gives 0.
    weights_only, _ = from_pretrained(folder, dtype="float32", param_dtype="bfloat16", remat=True)
    fn32, state32 = forward(weights_only)
    compute_gap = np.abs(ours - np.asarray(fn32(state32, tokens))).mean()
    assert compute_gap > 1e-2, compute_gap


def test_tokenizer_from_folder_matches_transformers(checkpoints):
    for name in CONFIGS:
        folder, _ = checkpoints[name]
        _, tok = from_pretrained(folder)
        # (AutoTokenizer would pick Qwen2Tokenizer from config.json and rebuild a different vocabulary.)
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
        messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": " w3 w4 \n"}]
        for generation_prompt in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)
            theirs = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
            assert ours == theirs
        tools = [{"name": "calc", "doc": "a 'quoted' <tag> & é"}]
        assert tok.apply_chat_template(messages, tools=tools) == hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False)
        text = tok.apply_chat_template(messages)
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
        assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
        assert tok.decode(tok.encode("w5 w6")) == "w5 w6"
        with pytest.raises(Exception, match="bad role"):
            tok.apply_chat_template([{"role": "tool", "content": "x"}])


def _copy(folder, tmp_path, name):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def test_loader_errors_name_the_problem(checkpoints, tmp_path):
    folder, _ = checkpoints["qwen2"]
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in read_safetensors(folder / "model.safetensors").items()}

    missing = _copy(folder, tmp_path, "missing")
    safetensors_torch.save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
                                missing / "model.safetensors")
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        from_pretrained(missing)

    bad_shape = _copy(folder, tmp_path, "bad_shape")
    safetensors_torch.save_file(dict(tensors, **{"model.norm.weight": torch.zeros(7)}),
                                bad_shape / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(7,\), expected \(48,\)"):
        from_pretrained(bad_shape)

    extra = _copy(folder, tmp_path, "extra")
    safetensors_torch.save_file(dict(tensors, **{"model.layers.3.mlp.up_proj.weight": torch.zeros(2)}),
                                extra / "model.safetensors")
    with pytest.raises(ValueError, match="not used by a 3-layer model.*layers.3.mlp"):
        from_pretrained(extra)

    other_arch = _copy(folder, tmp_path, "gemma")
    config = json.loads((folder / "config.json").read_text())
    (other_arch / "config.json").write_text(json.dumps(dict(config, model_type="gemma")))
    with pytest.raises(ValueError, match="model_type 'gemma' is not supported"):
        from_pretrained(other_arch)
    (other_arch / "config.json").write_text(json.dumps(dict(config, rope_parameters={"rope_type": "yarn"})))
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        from_pretrained(other_arch)
    (other_arch / "config.json").write_text(json.dumps(dict(config, rope_parameters=dict(
        LLAMA31_ROPE, partial_rotary_factor=0.5))))
    with pytest.raises(ValueError, match=r"fields \['partial_rotary_factor'\] of rope type 'llama3'"):
        from_pretrained(other_arch)
    for field, value in (("final_logit_softcapping", 30.0), ("hidden_act", "gelu"),
                         ("use_sliding_window", True)):
        (other_arch / "config.json").write_text(json.dumps(dict(config, **{field: value})))
        with pytest.raises(ValueError, match=field if field != "hidden_act" else "activation 'gelu'"):
            from_pretrained(other_arch)
    (other_arch / "config.json").write_text(json.dumps(dict(config, model_type="gemma3")))
    with pytest.raises(ValueError, match="model_type 'gemma3' has no text_config"):
        from_pretrained(other_arch)

    no_tokenizer = _copy(folder, tmp_path, "no_tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        from_pretrained(no_tokenizer)

    cut = _copy(folder, tmp_path, "cut_tokenizer")   # an interrupted copy: one line naming it
    whole = (cut / "tokenizer.json").read_bytes()
    (cut / "tokenizer.json").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match=f"^{cut / 'tokenizer.json'} cannot be read as a "
                                         f"tokenizer \\(EOF while parsing"):
        from_pretrained(cut)
    (cut / "tokenizer.json").write_bytes(b"\xff" + whole)
    with pytest.raises(ValueError, match=f"^{cut / 'tokenizer.json'} cannot be read as a "
                                         f"tokenizer \\(stream did not contain valid UTF-8\\)"):
        from_pretrained(cut)

    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unknown model source 'gpt-17'"):
        from_pretrained("gpt-17")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_round_trip(checkpoints, tokens, name, tmp_path):
    """Loaded, exported by write_hf_folder, loaded again by transformers as the same class: the
    logits equal the original torch model's; our loader reads the export back to the same config."""
    from logra_jax.models.hf_export import write_hf_folder
    from logra_jax.tree_paths import leaves_with_paths

    folder, torch_model = checkpoints[name]
    model, tokenizer = from_pretrained(folder)
    weights = {p: np.asarray(v) for p, v in leaves_with_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param)))}
    out = write_hf_folder(model.config, weights, tokenizer, tmp_path / "hf")
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(again) is type(torch_model)
    # The round trip itself is exact: every tensor comes back with the original's bits.
    original = torch_model.state_dict()
    for name_, tensor in again.state_dict().items():
        assert torch.equal(tensor, original[name_]), name_
    # Logits of the same weights may still differ in the last bits: torch's CPU kernels pick their
    # blocking from tensor strides and thread count (seen: 1.03e-5 at 2 of 1 408 logits of
    # magnitude ~2 under two test workers), so these are compared to fp32 accumulation accuracy.
    np.testing.assert_allclose(torch_logits(again, tokens), torch_logits(torch_model, tokens), atol=1e-4, rtol=0)
    back, _ = from_pretrained(out)
    assert back.config == model.config
    with pytest.raises(FileExistsError, match="not empty"):
        write_hf_folder(model.config, weights, tokenizer, out)


def test_a_weights_file_holding_a_nan_is_refused_naming_the_file_and_tensor(checkpoints, tmp_path):
    """A NaN in a weights file was found only after a whole rollout, blamed on the learning rate,
    with a metrics row left behind: the loader names the folder and the parameter instead."""
    from logra_jax.models.hf_export import write_hf_folder
    from logra_jax.tree_paths import leaves_with_paths

    folder, _ = checkpoints[next(iter(CONFIGS))]
    model, tokenizer = from_pretrained(folder)
    weights = {p: np.array(v) for p, v in leaves_with_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param)))}
    weights["layers/mlp/down_proj/kernel"][1, 2, 3] = np.nan
    out = write_hf_folder(model.config, weights, tokenizer, tmp_path / "hf")
    with pytest.raises(ValueError, match=f"parameter 'layers/mlp/down_proj/kernel' read from {out} "
                                         f"holds 1 NaN or infinite value"):
        from_pretrained(out)


def test_the_multimodal_gemma3_checkpoint_loads_its_language_model(tmp_path, tokens):
    """google/gemma-3-*-it folders are Gemma3ForConditionalGeneration (model_type "gemma3", the
    text model's config under text_config, a vision tower beside it): we read the language model
    and compute transformers' text-only logits."""
    text = dict(CONFIGS["gemma3"][2])
    text.pop("attn_implementation")
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                                       eoi_token_index=VOCAB - 2)
    config._attn_implementation = "eager"
    torch.manual_seed(7)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomise(model, 7)
    model.save_pretrained(tmp_path)
    write_tokenizer(tmp_path, template_in_jinja_file=False)
    ours, _ = from_pretrained(tmp_path)
    assert ours.config.sliding_layers == (True, False, True) and ours.config.tie_embeddings
    fn, state = forward(ours)
    np.testing.assert_allclose(np.asarray(fn(state, tokens)), torch_logits(model, tokens), atol=1e-4, rtol=0)
