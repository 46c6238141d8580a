"""GGUF loading: the offline SmolLM2 matches transformers' PyTorch model built from the same file."""

import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from treegrpo_jax.model.cache import init_cache
from treegrpo_jax.model.decoder import causal_mask
from treegrpo_jax.model.weights_gguf import load_gguf, unpermute_rotary

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain in a few sentences what a CPU does.",
    "Give me three tips for learning to cook.",
]
PARIS = "What is the capital of France?"
NEW_TOKENS = 24


def _llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, verbatim in NumPy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape,heads", [((48, 10), 6), ((24, 10), 3), ((48,), 6)])
def test_unpermute_inverts_llama_cpp_permute(shape, heads):
    w = np.random.default_rng(0).standard_normal(shape)
    np.testing.assert_array_equal(unpermute_rotary(_llama_cpp_permute(w, heads), heads), w)


def test_config_from_metadata(smollm2):
    _, cfg, _ = smollm2
    assert (cfg.num_layers, cfg.embed_dim, cfg.mlp_dim) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_embeddings and not cfg.qkv_bias
    assert cfg.rope_theta == 100_000.0 and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


@pytest.fixture(scope="module")
def torch_smollm2(smollm2_path, torch):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


def _chat_ids(tokenizer, prompt):
    return tokenizer.encode_chat([{"role": "user", "content": prompt}])


@functools.partial(jax.jit, static_argnames="graphdef")
def _prefill(graphdef, state, tokens, lens, cache):
    return nnx.merge(graphdef, state).append(tokens, lens, cache)


@functools.partial(jax.jit, static_argnames="graphdef")
def _step(graphdef, state, tokens, cache):
    return nnx.merge(graphdef, state).decode(tokens, cache, jnp.ones(tokens.shape, bool))


def greedy(model, prompts: list[list[int]], new_tokens: int) -> np.ndarray:
    """Batched greedy decoding with the decoder's own cache ops: ragged prefill, then 1-token steps."""
    graphdef, state = nnx.split(model)
    lens = np.array([len(p) for p in prompts])
    tokens = np.zeros((len(prompts), lens.max()), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    cache = init_cache(model.cfg, len(prompts), int(lens.max()) + new_tokens)
    logits, cache = _prefill(graphdef, state, jnp.asarray(tokens), jnp.asarray(lens), cache)
    out = [jnp.argmax(logits, -1)]
    for _ in range(new_tokens - 1):
        logits, cache = _step(graphdef, state, out[-1], cache)
        out.append(jnp.argmax(logits, -1))
    return np.asarray(jnp.stack(out, 1))


@pytest.fixture(scope="module")
def continuations(smollm2, torch_smollm2, torch):
    """Our greedy continuations, and transformers' logits over prompt + continuation.

    Greedy decoding is deterministic, so transformers' greedy continuation equals ours iff
    at every generated position its argmax (given our prefix) is our next token: one
    batched forward checks every prompt, where `generate` would need a call per token.
    The Paris prompt rides in the same batch so the jitted steps compile once.
    """
    model, _, tokenizer = smollm2
    prompts = [_chat_ids(tokenizer, p) for p in [*PROMPTS, PARIS]]
    new = greedy(model, prompts, NEW_TOKENS)
    seqs = [p + n.tolist() for p, n in zip(prompts, new, strict=True)]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int64)
    valid = np.zeros(ids.shape, bool)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)], valid[row, : len(seq)] = seq, True
    with torch.no_grad():
        ref = torch_smollm2(torch.tensor(ids), attention_mask=torch.tensor(valid.astype(np.int64))).logits
    return prompts, new, ids, valid, ref.numpy()


def test_logits_match_transformers(smollm2, continuations):
    model, _, _ = smollm2
    _, _, ids, valid, ref = continuations
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    got = np.asarray(model(jnp.asarray(ids), positions, causal_mask(jnp.asarray(valid))))
    # Same dequantised f32 weights; 30 layers of f32 rounding on logits of magnitude ~30.
    np.testing.assert_allclose(got[valid], ref[valid], atol=5e-4, rtol=0)


@pytest.mark.parametrize("row", range(len(PROMPTS)))
def test_greedy_continuation_matches_transformers(smollm2, continuations, row):
    _, cfg, tokenizer = smollm2
    prompts, new, _, _, ref = continuations
    n = len(prompts[row])
    ref_greedy = ref[row, n - 1 : n - 1 + NEW_TOKENS].argmax(-1).tolist()
    eos = [i for i, tok in enumerate(ref_greedy) if tok in cfg.eos_token_ids]
    stop = eos[0] + 1 if eos else NEW_TOKENS  # transformers stops at EOS; compare up to it
    assert stop >= 20, tokenizer.decode(ref_greedy)  # long enough to mean something
    assert new[row, :stop].tolist() == ref_greedy[:stop], tokenizer.decode(new[row])


def test_greedy_generate_matches_transformers_generate(continuations, torch_smollm2, torch):
    """One literal `generate` call (KV-cached, as users run it) for the first prompt."""
    prompts, new, _, _, _ = continuations
    with torch.no_grad():
        out = torch_smollm2.generate(
            torch.tensor([prompts[0]]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2
        )
    ref = out[0, len(prompts[0]) :].tolist()
    assert len(ref) >= 20 and new[0, : len(ref)].tolist() == ref


def test_smollm2_answers_paris(smollm2, continuations):
    _, _, tokenizer = smollm2
    _, new, _, _, _ = continuations
    assert "Paris" in tokenizer.decode(new[-1])


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        load_gguf(tmp_path / "nope.gguf")
    assert "\n" not in str(info.value)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTAGGUF" * 16)
    with pytest.raises(ValueError, match="not a readable GGUF file") as info:
        load_gguf(bad)
    assert "\n" not in str(info.value)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'") as info:
        load_gguf(path)
    assert "\n" not in str(info.value)
