"""KV-cache sampler: cache == recompute, log-probs, stopping, padding, no recompiles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models import Decoder
from logra_jax.models.config import tiny
from logra_jax.rl.policy import Policy, Sequences
from logra_jax.rl.sampler import (Sampler, filter_logits, first_argmax, gumbel_max, left_align,
                                  pad_prompts)

PROMPT_LEN, STEPS, PAD = 8, 6, 0
EOS_OFTEN = list(range(1, 96, 2))   # half the vocabulary ends a row


@pytest.fixture(scope="module")
def setup():
    model = Decoder(tiny(), rngs=nnx.Rngs(0))
    policy = Policy(model)
    params = Policy.params_of(model)
    # An EOS id no random token will hit, so every row runs the full length unless a test says so.
    sampler = Sampler(policy, max_prompt_length=PROMPT_LEN, max_completion_length=STEPS,
                      eos_ids=[95], pad_id=PAD)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3]]
    tokens, mask = pad_prompts(prompts, PROMPT_LEN, PAD)
    return policy, params, sampler, prompts, tokens, mask


@functools.partial(jax.jit, static_argnums=0)
def _logits_without_cache(policy, params, tokens):
    return policy.bind(params)(tokens)


def greedy_by_recompute(policy, params, prompt, steps):
    """Reference: re-run the whole sequence without a cache for every new token. The sequence is
    right-padded to one length (one compiled forward; causal attention keeps the padding out of
    the positions read)."""
    seq = list(prompt)
    for _ in range(steps):
        tokens = jnp.asarray([seq + [PAD] * (len(prompt) + steps - len(seq))], jnp.int32)
        logits = _logits_without_cache(policy, params, tokens)
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


def kept_lengths(tokens, eos_ids, steps: int) -> np.ndarray:
    """Each row's completion length read from its tokens alone: through its first EOS, else all
    ``steps`` (the masks are not read)."""
    lengths = []
    for row in np.asarray(tokens)[:, :steps]:
        ends = np.flatnonzero(np.isin(row, eos_ids))
        lengths.append(ends[0] + 1 if ends.size else steps)
    return np.array(lengths)


def steps_each_pass_runs(lengths, passes: int, chunk: int | None = None) -> np.ndarray:
    """[b]: the token steps of the pass holding each row (pass j holds rows j, j + passes, …): a
    draw from the prefill, then one per forward pass until its longest row has ended, L_max in
    all; in ``chunk``-step chunks the last chunk's discarded steps too."""
    lengths = np.asarray(lengths)
    longest = np.array([lengths[j::passes].max() for j in range(passes)])
    if chunk:
        longest = 1 + chunk * -(-(longest - 1) // chunk)
    return longest[np.arange(len(lengths)) % passes]


def check_work_metrics(out, eos_ids, steps: int, passes: int, chunk: int | None = None):
    """`SampleOutput.token_steps` and `rollout.work_metrics` of ``out`` against the counts its
    tokens give."""
    from logra_jax.rl.rollout import work_metrics
    lengths = kept_lengths(out.tokens, eos_ids, steps)
    np.testing.assert_array_equal(np.asarray(out.mask).sum(axis=1), lengths)
    expected = steps_each_pass_runs(lengths, passes, chunk)
    np.testing.assert_array_equal(out.token_steps, expected)
    rows, window = out.prompt_tokens.shape
    metrics = work_metrics(np.asarray(out.mask), np.asarray(out.token_steps), rows * window)
    assert metrics == {"rollout/kept_tokens": lengths.sum(), "rollout/decode_row_steps": expected.sum(),
                       "rollout/efficiency": lengths.sum() / expected.sum(),
                       "rollout/prefill_tokens": rows * PROMPT_LEN}
    return metrics


def test_greedy_with_cache_equals_recompute(setup):
    policy, params, sampler, prompts, tokens, mask = setup
    out = sampler.generate(params, tokens, mask, jax.random.PRNGKey(0), greedy=True)
    for row, prompt in enumerate(prompts):
        assert np.asarray(out.tokens[row]).tolist() == greedy_by_recompute(policy, params, prompt, STEPS)
    assert bool(np.all(out.mask))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_the_models(setup, temperature):
    """The sampler's log-probs are the trainer's at the sampling temperature: log softmax(z / T)
    at the drawn token (a sampler returning temperature-1 log-probs fails at 0.7)."""
    policy, params, sampler, _, tokens, mask = setup
    out = sampler.generate(params, tokens, mask, jax.random.PRNGKey(1), temperature=temperature,
                           top_p=1.0)
    seqs = Sequences.from_sample(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
    logp, _ = policy.completion_logprobs(params, seqs, temperature=temperature)
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(logp) * np.asarray(out.mask),
                               atol=1e-5)


def test_new_weights_do_not_recompile(setup):
    _, params, sampler, _, tokens, mask = setup
    sampler.generate(params, tokens, mask, jax.random.PRNGKey(2))
    size = sampler.program._cache_size()
    moved = jax.tree.map(lambda x: x * 1.01, params)
    out = sampler.generate(moved, tokens, mask, jax.random.PRNGKey(2))
    assert sampler.program._cache_size() == size
    first = sampler.generate(params, tokens, mask, jax.random.PRNGKey(2))
    assert not np.array_equal(np.asarray(out.logprobs), np.asarray(first.logprobs))


def test_eos_stops_a_row_and_masks_the_rest(setup):
    policy, params, _, prompts, tokens, mask = setup
    first = greedy_by_recompute(policy, params, prompts[0], 2)
    sampler = Sampler(policy, max_prompt_length=PROMPT_LEN, max_completion_length=STEPS,
                      eos_ids=[first[1]], pad_id=PAD)
    out = sampler.generate(params, tokens[:1], mask[:1], jax.random.PRNGKey(0), greedy=True)
    assert np.asarray(out.tokens[0, :2]).tolist() == first
    assert np.asarray(out.mask[0]).tolist() == [True, True] + [False] * (STEPS - 2)
    assert bool(out.finished[0])
    assert np.all(np.asarray(out.tokens[0, 2:]) == PAD)


def test_the_last_token_costs_no_forward_pass(setup):
    """Sampling C tokens takes the prefill and C − 1 decode passes: the last draw's logits come
    from the pass before it, and nothing reads a pass after it. Counted at run time (a host
    callback in the model's call), on full-length rows and on a row that stops early."""
    policy, params, sampler, prompts, tokens, mask = setup
    calls = []

    class CountingPolicy:
        def __init__(self, inner):
            self.inner = inner

        def bind(self, params):
            model = self.inner.bind(params)
            original = type(model).__call__

            class Counted(type(model)):
                def __call__(self, *args, **kwargs):
                    jax.debug.callback(lambda: calls.append(1))
                    return original(self, *args, **kwargs)

            model.__class__ = Counted
            return model

        def probes(self, params, probes=None):
            return self.inner.probes(params, probes)

    counted = Sampler(CountingPolicy(policy), max_prompt_length=PROMPT_LEN,
                      max_completion_length=STEPS, eos_ids=[95], pad_id=PAD)
    out = counted.generate(params, tokens, mask, jax.random.PRNGKey(0), greedy=True)
    jax.effects_barrier()
    assert len(calls) == STEPS          # 1 prefill + (STEPS - 1) decode passes
    reference = sampler.generate(params, tokens, mask, jax.random.PRNGKey(0), greedy=True)
    np.testing.assert_array_equal(out.tokens, reference.tokens)

    first = greedy_by_recompute(policy, params, prompts[0], 2)    # stops after its 2nd token
    calls.clear()
    stopping = Sampler(CountingPolicy(policy), max_prompt_length=PROMPT_LEN,
                       max_completion_length=STEPS, eos_ids=[first[1]], pad_id=PAD)
    out = stopping.generate(params, tokens[:1], mask[:1], jax.random.PRNGKey(0), greedy=True)
    jax.effects_barrier()
    assert len(calls) == 2              # the prefill and the pass after the first token
    assert np.asarray(out.mask[0]).tolist() == [True, True] + [False] * (STEPS - 2)


def test_right_padding_gives_the_same_completions(setup):
    _, params, sampler, prompts, tokens, mask = setup
    right = np.full_like(tokens, PAD)
    right_mask = np.zeros_like(mask)
    for i, p in enumerate(prompts):
        right[i, :len(p)] = p
        right_mask[i, :len(p)] = True
    a = sampler.generate(params, tokens, mask, jax.random.PRNGKey(3), greedy=True)
    b = sampler.generate(params, right, right_mask, jax.random.PRNGKey(3), greedy=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    aligned, aligned_mask = left_align(right, right_mask, PAD)
    np.testing.assert_array_equal(aligned, tokens)
    np.testing.assert_array_equal(aligned_mask, mask)


def test_per_layer_decode_matches_the_scanned_stack():
    """decode_weights="per_layer" (the CPU default) runs the same model as the scanned stack: on a
    model with a sliding layer whose window the completion outgrows, the same tokens and log-probs."""
    import dataclasses
    config = dataclasses.replace(tiny(), layer_types=("sliding", "full"), sliding_window=5,
                                 rope_local_theta=100.0)
    model = Decoder(config, rngs=nnx.Rngs(1))
    policy, params = Policy(model), Policy.params_of(model)
    tokens, mask = pad_prompts([[5, 6, 7], [9, 10, 11, 12, 13, 14]], PROMPT_LEN, PAD)
    outs = {}
    for mode in ("stacked", "per_layer"):
        sampler = Sampler(policy, max_prompt_length=PROMPT_LEN, max_completion_length=STEPS,
                          eos_ids=[95], pad_id=PAD, decode_weights=mode)
        assert sampler.per_layer_decode == (mode == "per_layer")
        outs[mode] = [sampler.generate(params, tokens, mask, jax.random.PRNGKey(4), greedy=greedy)
                      for greedy in (True, False)]
    for stacked, per_layer in zip(outs["stacked"], outs["per_layer"]):
        np.testing.assert_array_equal(per_layer.tokens, stacked.tokens)
        np.testing.assert_allclose(per_layer.logprobs, stacked.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="decode_weights must be one of"):
        Sampler(policy, max_prompt_length=4, max_completion_length=4, eos_ids=[1], pad_id=PAD,
                decode_weights="unrolled")


def test_passes_of_rows_draw_the_one_pass_tokens_in_less_memory(setup):
    """rows_per_pass (rl.rollout_micro_batch): 16 rows of an 8-device batch in passes of 8 draw the
    tokens one pass draws for the same key (the noise of each row comes from its place in the whole
    batch), rows ending at different steps, while the compiled program holds a smaller KV cache."""
    from jax.sharding import NamedSharding, PartitionSpec
    from logra_jax.sharding import make_mesh
    policy, params, *_ = setup
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 90, size=rng.integers(1, PROMPT_LEN + 1))) for _ in range(16)]
    rows = NamedSharding(make_mesh({"fsdp": 8}), PartitionSpec("fsdp"))
    tokens, mask = jax.device_put(pad_prompts(prompts, PROMPT_LEN, PAD), rows)
    args = (params, tokens, mask, jax.random.PRNGKey(3), jnp.float32(1.0))
    outs, temporaries = [], []
    for per_pass in (0, 8):
        sampler = Sampler(policy, max_prompt_length=PROMPT_LEN, max_completion_length=2 * STEPS,
                          eos_ids=EOS_OFTEN, pad_id=PAD, rows_per_pass=per_pass)
        compiled = sampler.program.lower(*args, top_k=0, top_p=1.0, greedy=False).compile()
        outs.append(compiled(*args))
        temporaries.append(compiled.memory_analysis().temp_size_in_bytes)
    one, passes = outs
    lengths = np.asarray(one.mask).sum(axis=1)
    assert len(set(lengths.tolist())) > 2, lengths   # rows end at different steps
    # The work each ran: every row of a pass stepped until the pass's longest row ended.
    eos = EOS_OFTEN
    assert check_work_metrics(one, eos, 2 * STEPS, 1)["rollout/efficiency"] < 1
    check_work_metrics(passes, eos, 2 * STEPS, 2)
    for field in ("tokens", "mask", "finished", "prompt_tokens", "prompt_mask"):
        np.testing.assert_array_equal(getattr(passes, field), getattr(one, field), err_msg=field)
    # Log-probs: the same arithmetic on a batch of another size (a kernel may block it otherwise).
    np.testing.assert_allclose(passes.logprobs, one.logprobs, atol=1e-5)
    assert passes.tokens.sharding.is_equivalent_to(rows, 2)
    # Half the rows per pass: at least half of one pass's KV cache (keys and values, fp32, 2 of the
    # 16 rows per device) is not held any more.
    c = policy.bind(params).config
    kv_cache = 2 * c.num_layers * 2 * (PROMPT_LEN + 2 * STEPS) * c.num_kv_heads * c.head_dim * 4
    assert temporaries[0] - temporaries[1] >= kv_cache // 2, (temporaries, kv_cache)
    with pytest.raises(ValueError, match="does not split into passes of rows_per_pass=3"):
        Sampler(policy, max_prompt_length=PROMPT_LEN, max_completion_length=STEPS, eos_ids=[95],
                pad_id=PAD, rows_per_pass=3).generate(params, tokens, mask, jax.random.PRNGKey(0))


def test_rows_stay_split_over_the_params_mesh():
    """On an accelerator generate traces under the mesh its params and prompts lie on, so the
    model's shard_batch keeps each device on its own rows. Traced without it, XLA kept the
    prefill's activations whole on every device (the weights split along ``embed``, it summed
    partial products instead of gathering weights): over 3× the temporaries here; at Qwen2.5-7B's
    shape two MLP intermediates of all rows, 2.3 GiB each per TPU chip on any number of chips.
    On XLA:CPU's simulated devices XLA's own layout is kept (the faster one there)."""
    from jax.sharding import NamedSharding, PartitionSpec
    from logra_jax.perf import machines
    from logra_jax.sharding import make_mesh, shard_model
    mesh = make_mesh({"fsdp": 8})
    model = shard_model(Decoder(tiny(), rngs=nnx.Rngs(0)), mesh)
    policy, params = Policy(model), Policy.params_of(model)
    tokens, mask = jax.device_put(pad_prompts([[5, 6, 7]] * 32, 32, PAD),
                                  NamedSharding(mesh, PartitionSpec("fsdp")))
    sampler = Sampler(policy, max_prompt_length=32, max_completion_length=STEPS, eos_ids=[95],
                      pad_id=PAD)
    args = (params, tokens, mask, jax.random.PRNGKey(4), jnp.float32(1.0))
    split = sampler.program.lower(*args, top_k=0, top_p=1.0, greedy=False, mesh=mesh.abstract_mesh)
    out = split.compile()(*args)   # draws the model's own tokens with their log-probs
    seqs = Sequences.from_sample(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
    np.testing.assert_allclose(out.logprobs, policy.completion_logprobs(params, seqs)[0] * out.mask,
                               atol=1e-5)
    split, whole = (sampler.program.lower(*args, top_k=0, top_p=1.0, greedy=False, mesh=m)
                    .compile().memory_analysis().temp_size_in_bytes
                    for m in (mesh.abstract_mesh, None))
    assert 2 * split < whole, (split, whole)
    # Which mesh generate traces under: the chips' for a TPU slice's devices, none on XLA:CPU.
    assert Sampler.mesh_of(params, tokens) is None
    chips = make_mesh({"fsdp": 8}, machines.machine("v5e-8").jax_devices())
    on_chips = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype,
                                    sharding=NamedSharding(chips, PartitionSpec("fsdp")))
    assert Sampler.mesh_of({}, on_chips) == chips.abstract_mesh


def test_filters():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda x: np.isfinite(np.asarray(x)) & (np.asarray(x) > -1e29)
    assert kept(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [[True, True, False, False]]
    # Nucleus: the smallest prefix reaching 0.7 is {0.5, 0.3}; 0.85 needs three tokens.
    assert kept(filter_logits(logits, top_k=0, top_p=0.7)).tolist() == [[True, True, False, False]]
    assert kept(filter_logits(logits, top_k=0, top_p=0.85)).tolist() == [[True, True, True, False]]
    assert kept(filter_logits(logits, top_k=0, top_p=1.0)).all()


def test_gumbel_max_draws_from_the_softmax():
    """40 000 rows of one 6-way distribution (one of them filtered out): the token counts pass
    Pearson's χ² test against softmax(logits), and the filtered token never comes."""
    probs = np.asarray([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    rows = 40_000
    logits = jnp.broadcast_to(jnp.asarray(np.where(probs > 0, np.log(np.maximum(probs, 1e-30)),
                                                   -1e30), jnp.float32), (rows, 6))
    tokens = np.asarray(gumbel_max(jax.random.PRNGKey(7), logits))
    counts = np.bincount(tokens, minlength=6)
    assert counts[5] == 0
    expected = rows * probs[:5]
    chi2 = float(np.sum((counts[:5] - expected) ** 2 / expected))
    assert chi2 < 18.5, (counts, chi2)   # χ²(4 dof) exceeds 18.5 with probability 0.001
    # Another key draws other tokens; the same key the same ones.
    again = np.asarray(gumbel_max(jax.random.PRNGKey(7), logits))
    other = np.asarray(gumbel_max(jax.random.PRNGKey(8), logits))
    assert (again == tokens).all() and (other != tokens).mean() > 0.5


def test_gumbel_max_is_the_same_draw_on_any_layout():
    """A batch split over 8 devices draws exactly the tokens of one device: the noise is a
    function of the key and each logit's global position (what multi-host sampling needs)."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (16, 40)) * 3
    one = np.asarray(jax.jit(gumbel_max)(jax.random.PRNGKey(1), logits))
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("fsdp",))
    split = jax.device_put(logits, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
    eight = np.asarray(jax.jit(gumbel_max)(jax.random.PRNGKey(1), split))
    assert (one == eight).all()
    # Not just the argmax of the logits: the noise moves some rows off it.
    assert (one != np.asarray(jnp.argmax(logits, axis=-1))).any()


def test_gumbel_max_reads_either_layout_and_keeps_its_formula():
    """[rows, V] and [V, rows] logits (the decode head's layout) draw the same tokens: the
    argmax of logits − log(−log u), u from hashed_bits at each logit's row-major position in
    [rows, V] (the formula in gumbel_max's docstring, computed here from hashed_bits)."""
    from logra_jax.projections import hashed_bits
    logits = jax.random.normal(jax.random.PRNGKey(0), (16, 40)) * 3
    key = jax.random.PRNGKey(3)
    u = ((np.asarray(hashed_bits(key, logits.shape)) >> 8).astype(np.float32) + 0.5) * 2.0 ** -24
    expected = np.argmax(np.asarray(logits) - np.log(-np.log(u)), axis=-1)
    rows_first = np.asarray(gumbel_max(key, logits))
    vocab_first = np.asarray(jax.jit(gumbel_max, static_argnames="vocab_axis")(
        key, logits.T, vocab_axis=0))
    np.testing.assert_array_equal(rows_first, expected)
    np.testing.assert_array_equal(vocab_first, expected)
    with pytest.raises(ValueError, match="gumbel_max takes"):
        gumbel_max(key, logits[None])


def test_first_argmax_is_argmax_with_ties_and_nans():
    x = np.asarray([[1.0, 3.0, 3.0, 0.0], [2.0, np.nan, 5.0, np.nan], [-1.0, -1.0, -1.0, -1.0]],
                   np.float32)
    for axis in (0, 1, -1):
        np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x), axis)),
                                      np.asarray(jnp.argmax(jnp.asarray(x), axis=axis)))
    assert np.asarray(first_argmax(jnp.asarray(x), 1)).tolist() == [1, 1, 0]


def test_bad_input_is_rejected(setup):
    policy, params, sampler, _, tokens, mask = setup
    with pytest.raises(ValueError, match="max_prompt_length=4"):
        pad_prompts([[1, 2, 3, 4, 5]], 4, PAD)
    with pytest.raises(ValueError, match="temperature"):
        sampler.generate(params, tokens, mask, jax.random.PRNGKey(0), temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        sampler.generate(params, tokens, mask, jax.random.PRNGKey(0), top_p=0.0)
    with pytest.raises(ValueError, match="eos_ids"):
        Sampler(policy, max_prompt_length=4, max_completion_length=4, eos_ids=[], pad_id=PAD)


def test_sampler_bench_refuses_an_unknown_decode_mode():
    """(Its table on the tiny model is checked on `make gpu-check`'s sampler part, which runs the
    same command: tests/test_gpu_check.py.)"""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    bad = subprocess.run([sys.executable, "-m", "launch.sampler_bench", "--config", "configs/tiny.py",
                          "--decode_weights", "unrolled"], cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode != 0 and "--decode_weights ['unrolled']" in bad.stderr


def test_nucleus_over_candidates_draws_the_full_sorts_tokens_where_it_fits():
    """top-p over the TOP_P_CANDIDATES most probable tokens (`truncation`), not a sort of the whole
    vocabulary: where the nucleus has at most that many tokens, the same kept set as
    `filter_logits` and the same draw as `gumbel_max` of its output, for every row and key; with
    top_k, the nucleus of the top-k-renormalized distribution, as there."""
    from logra_jax.rl.sampler import TOP_P_CANDIDATES, truncated_draw, truncation
    rng = np.random.default_rng(0)
    # Peaked rows (a few large logits over a flat rest): every nucleus below fits the candidates.
    logits = rng.normal(size=(32, 300)).astype(np.float32)
    logits[:, :12] += rng.uniform(8.0, 12.0, size=(32, 12)).astype(np.float32)
    logits = jnp.asarray(rng.permuted(logits, axis=1))
    rows = jnp.arange(32, dtype=jnp.int32) + 5
    for top_k, top_p in [(0, 0.9), (0, 0.5), (8, 0.8), (5, 1.0), (40, 0.95)]:
        kept = np.asarray(filter_logits(logits, top_k, top_p)) > -1e29
        values, ids, keep = truncation(logits, top_k, top_p)
        assert keep.shape[1] == max(top_k, TOP_P_CANDIDATES if top_p < 1 else 0)
        mine = np.zeros_like(kept)
        np.put_along_axis(mine, np.asarray(ids), np.asarray(keep), axis=1)
        np.testing.assert_array_equal(mine, kept, err_msg=f"top_k={top_k}, top_p={top_p}")
        assert kept.sum(axis=1).max() < keep.shape[1] or top_p == 1.0   # it did fit
        for seed in range(3):
            key = jax.random.PRNGKey(seed)
            np.testing.assert_array_equal(
                truncated_draw(key, logits, top_k, top_p, rows=rows),
                gumbel_max(key, filter_logits(logits, top_k, top_p), rows=rows))


def test_a_nucleus_wider_than_the_candidates_is_capped_there():
    """A flat row: the full sort's 0.9-nucleus of 300 near-equal tokens holds most of them, the
    candidate set TOP_P_CANDIDATES, and all of those are kept (the documented cap) and drawn;
    equal logits enter it lowest id first."""
    from logra_jax.rl.sampler import TOP_P_CANDIDATES, truncated_draw, truncation
    logits = jnp.linspace(0.0, -0.3, 300, dtype=jnp.float32)[None]
    assert int((np.asarray(filter_logits(logits, 0, 0.9)) > -1e29).sum()) > 10 * TOP_P_CANDIDATES
    values, ids, keep = truncation(logits, 0, 0.9)
    assert bool(keep.all()) and keep.shape == (1, TOP_P_CANDIDATES)
    assert np.asarray(ids[0]).tolist() == list(range(TOP_P_CANDIDATES))
    draws = {int(truncated_draw(jax.random.PRNGKey(s), logits, 0, 0.9)[0]) for s in range(200)}
    assert draws == set(range(TOP_P_CANDIDATES))
    _, tied, _ = truncation(jnp.zeros((1, 300), jnp.float32), 0, 0.9)
    assert np.asarray(tied[0]).tolist() == list(range(TOP_P_CANDIDATES))


def test_chunked_decoding_draws_the_per_token_loops_tokens(setup, monkeypatch):
    """A GPU decodes DECODE_CHUNK steps between two looks at "is a row still going?"
    (`Sampler`'s in_chunks); run here on XLA:CPU, it records exactly what the per-token loop
    records: rows ending at different steps, a row that never ends, a call stopped early
    (``limit``), a completion shorter than one chunk."""
    from logra_jax.rl.sampler import static as sampler_lib
    policy, params, _, prompts, tokens, mask = setup
    eos = [int(t) for t in greedy_by_recompute(policy, params, prompts[1], 3)[1:2]]   # row 1 ends
    steps = sampler_lib.DECODE_CHUNK + 5

    def run(chunked, limit=steps, **kwargs):
        monkeypatch.setattr(sampler_lib, "CHUNKED_PLATFORMS", ("cpu",) if chunked else ())
        sampler = Sampler(policy, max_prompt_length=PROMPT_LEN, max_completion_length=steps,
                          eos_ids=eos, pad_id=PAD)
        return sampler.program(params, jnp.asarray(tokens), jnp.asarray(mask),
                                 jax.random.PRNGKey(7), jnp.float32(1.0), jnp.int32(limit),
                                 top_k=0, top_p=1.0, per_layer=True, **kwargs)

    for kwargs in (dict(greedy=True), dict(greedy=False), dict(greedy=False, limit=4)):
        per_token, chunked = run(False, **kwargs), run(True, **kwargs)
        for field in ("tokens", "logprobs", "mask", "finished"):
            np.testing.assert_array_equal(getattr(chunked, field), getattr(per_token, field),
                                          err_msg=f"{field} {kwargs}")
        # The steps each loop ran: the chunked one to the end of its last chunk.
        limit = kwargs.get("limit", steps)
        check_work_metrics(per_token, eos, limit, 1)
        check_work_metrics(chunked, eos, limit, 1, chunk=sampler_lib.DECODE_CHUNK)
    lengths = np.asarray(per_token.mask).sum(axis=1)
    assert np.asarray(run(False, greedy=True).mask)[1].sum() == 2 and lengths.max() == 4


def test_a_stacked_decode_holds_the_kv_cache_once():
    """The layer scan carries the KV cache stack and writes each decode step's slot into it, so
    `generate`'s temporaries hold the stack once, plus a layer's worth XLA:CPU reads out: 1.40×
    the cache on a 4-layer model whose cache dwarfs the rest. With the stack as the scan's output
    (every layer's cache copied into a new stack every token) they held it twice (2.40×), and
    when XLA:CPU fused the layer's read into the slot's write it copied the whole stack every
    layer (2.15×)."""
    import dataclasses
    config = dataclasses.replace(tiny(), num_layers=4, max_position_embeddings=2048)
    model = Decoder(config, rngs=nnx.Rngs(0))
    policy, params = Policy(model), Policy.params_of(model)
    rows, prompt, steps = 4, 8, 1024
    sampler = Sampler(policy, max_prompt_length=prompt, max_completion_length=steps, eos_ids=[95],
                      pad_id=PAD, decode_weights="stacked")
    args = (params, jax.ShapeDtypeStruct((rows, prompt), jnp.int32),
            jax.ShapeDtypeStruct((rows, prompt), jnp.bool_), jax.random.PRNGKey(0), jnp.float32(1.0))
    compiled = sampler.program.lower(*args, top_k=0, top_p=1.0, greedy=False).compile()
    kv_cache = 2 * config.num_layers * rows * (prompt + steps) * config.num_kv_heads * config.head_dim * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 1.6 * kv_cache


@pytest.mark.parametrize("top_k", [0, 8])
def test_a_nucleus_draw_at_a_temperature_keeps_the_tempered_nucleus(setup, top_k):
    """Sampler.generate at T = 0.5 with top_p = 0.8 (and top_k = 8): every drawn token lies in the
    nucleus of softmax(z / T) — of the top-k renormalized distribution with top_k — where z are
    the model's logits at its position, recomputed without the cache; its log-prob is log
    softmax(z / T) there. Filtering z before dividing by T would keep the wider nucleus of
    softmax(z): the head is scaled 30× so the logits are peaked (the tiny model's are near flat,
    std 0.1, where every nucleus is the candidate cap), and at T = 0.5 the T = 1 nucleus is wider
    at most positions (checked below), so 64 rows × 6 tokens draw outside the tempered one."""
    policy, params, sampler, prompts, _, _ = setup
    temperature, top_p = 0.5, 0.8
    sharp = dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * 30.0})
    many = [prompts[i % len(prompts)] for i in range(64)]
    tokens, mask = pad_prompts(many, PROMPT_LEN, PAD)
    out = sampler.generate(sharp, tokens, mask, jax.random.PRNGKey(3), temperature=temperature,
                           top_p=top_p, top_k=top_k)
    seqs = Sequences.from_sample(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
    z = np.asarray(policy.completion_logits(sharp, seqs), np.float64)   # [rows, C, V]
    drawn = np.asarray(out.tokens)
    valid = np.asarray(out.mask)

    def nucleus(t):
        """[rows, C, V] bool: the tokens a top-k / top-p draw at temperature t keeps, and the
        probability mass of the kept set's tokens ranked before each (the boundary's distance)."""
        order = np.argsort(-z, axis=-1, kind="stable")
        ranked = np.take_along_axis(z, order, axis=-1) / t
        if top_k:
            ranked[..., top_k:] = -np.inf
        probs = np.exp(ranked - ranked.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        before = np.cumsum(probs, axis=-1) - probs
        kept = np.zeros(z.shape, bool)
        np.put_along_axis(kept, order, (before < top_p) & (probs > 0), axis=-1)
        mass_before = np.zeros(z.shape)
        np.put_along_axis(mass_before, order, before, axis=-1)
        return kept, mass_before

    logp = z / temperature - np.log(np.sum(np.exp(z / temperature - (z / temperature).max(-1, keepdims=True)),
                                           -1, keepdims=True)) - (z / temperature).max(-1, keepdims=True)
    at_drawn = np.take_along_axis(logp, drawn[..., None], -1)[..., 0]
    # The sampler's cached logits and this recompute round differently: 1e-4 in log-prob.
    slack = 1e-4
    np.testing.assert_allclose(np.asarray(out.logprobs), np.where(valid, at_drawn, 0.0), atol=slack)
    tempered, mass_before = nucleus(temperature)
    wide, _ = nucleus(1.0)
    # A log-prob error d moves each probability by a factor e^±d, so a prefix's mass by ≤ d:
    # a token within d of the boundary may fall either side of it.
    inside = np.take_along_axis(tempered, drawn[..., None], -1)[..., 0]
    near = np.take_along_axis(mass_before, drawn[..., None], -1)[..., 0] < top_p + slack
    outside = valid & ~inside & ~near
    assert not outside.any(), (f"{int(outside.sum())} tokens drawn outside the nucleus of "
                               f"softmax(z / {temperature}), e.g. row/step {np.argwhere(outside)[0]}")
    # The check can fail: the untempered nucleus is wider at most drawn positions.
    wider = (wide.sum(-1) > tempered.sum(-1))[valid]
    assert wider.mean() > 0.5, wider.mean()


@pytest.mark.parametrize("top_k", [0, 5])
def test_a_rows_draw_is_keyed_by_its_row_and_position_not_its_place_in_the_batch(top_k):
    """`draw`'s noise depends on the run key, the row's index in the rollout batch and the token's
    position only: the same rows drawn in another order, or a few of them alone (a slot engine
    decodes any row in any slot, next to any others), draw the same tokens; the same row at
    another position draws other noise."""
    from logra_jax.rl.sampler import draw
    vocab, batch = 64, 12
    logits_t = jax.random.normal(jax.random.key(0), (vocab, batch)) * 0.1   # nearly flat
    key = jax.random.key(7)
    positions = jnp.arange(batch, dtype=jnp.int32) * 3 % 7
    rows = jnp.arange(batch, dtype=jnp.int32) + 100
    kw = dict(temperature=1.0, greedy=False, top_k=top_k, top_p=1.0)
    tokens, logprobs = draw(logits_t, key, positions, rows, **kw)
    perm = jnp.asarray(np.random.default_rng(0).permutation(batch))
    again, again_logprobs = draw(logits_t[:, perm], key, positions[perm], rows[perm], **kw)
    np.testing.assert_array_equal(again, tokens[perm])
    np.testing.assert_array_equal(again_logprobs, logprobs[perm])
    few = perm[:3]
    np.testing.assert_array_equal(draw(logits_t[:, few], key, positions[few], rows[few], **kw)[0],
                                  tokens[few])
    moved, _ = draw(logits_t, key, positions + 1, rows, **kw)
    assert (moved != tokens).sum() >= batch // 2, "a row's noise ignores its token's position"
