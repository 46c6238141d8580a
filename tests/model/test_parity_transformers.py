"""Our decoder, loaded with `load_hf`, gives transformers' PyTorch logits (tiny random models).

Each case builds a random Llama or Qwen2 in PyTorch (weights redrawn so that biases and
norm scales are not their trivial init), saves it with `save_pretrained`, loads it with
`load_hf`, and compares logits in float32. Cases cover q/k/v bias, tied and untied
embeddings, GQA and MHA, a head_dim other than E/H, and the default, linear and llama3
RoPE variants (positions past `original_max_position_embeddings` so scaling matters).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from treegrpo_jax.model.cache import init_cache
from treegrpo_jax.model.config import RopeType
from treegrpo_jax.model.decoder import causal_mask
from treegrpo_jax.model.weights_hf import load_hf

_BASE = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, rms_norm_eps=1e-5)
CASES = {
    "qwen2_tied_gqa": (
        Qwen2ForCausalLM,
        Qwen2Config,
        dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "qwen2_untied_linear_rope": (
        Qwen2ForCausalLM,
        Qwen2Config,
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
        ),
    ),
    "llama_untied_llama3_rope": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,  # ≠ hidden/heads
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500000.0,
            },
        ),
    ),
    "llama_tied_mha": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    ),
}
T = 40  # > original_max_position_embeddings of the llama3 case


def _save_random_torch(tmp_path, name):
    model_cls, config_cls, extra = CASES[name]
    torch.manual_seed(list(CASES).index(name))
    model = model_cls(config_cls(**_BASE, **extra)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # Norm scales around 1, everything else (biases included) clearly non-zero.
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.15 * torch.randn_like(p))
    out = tmp_path / name
    model.save_pretrained(out)
    return model, out


@pytest.fixture(scope="module")
def load_case(tmp_path_factory, torch):  # `torch` fixture: one intra-op thread
    """name → (name, torch model, our decoder, config), each built once per module."""
    loaded = {}

    def load(name):
        if name not in loaded:
            torch_model, path = _save_random_torch(tmp_path_factory.mktemp("hf"), name)
            loaded[name] = (name, torch_model, *load_hf(path))
        return loaded[name]

    return load


@pytest.mark.parametrize("name", list(CASES))
def test_config_read_from_checkpoint(load_case, name):
    case = load_case(name)
    name, torch_model, _, cfg = case
    hf = torch_model.config
    assert cfg.qkv_bias == name.startswith("qwen2")
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.head_dim if getattr(hf, "head_dim", None) else hf.hidden_size // hf.num_attention_heads,
    )
    expected = {"linear": RopeType.LINEAR, "llama3": RopeType.LLAMA3}
    assert cfg.rope_scaling.rope_type == next((v for k, v in expected.items() if k in name), RopeType.DEFAULT)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(load_case, name):
    case = load_case(name)
    _, torch_model, ours, cfg = case
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (3, T))
    lengths = np.array([T, 17, 1])  # right padding on rows 1 and 2
    valid = np.arange(T)[None, :] < lengths[:, None]
    with torch.no_grad():
        ref = torch_model(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(valid.astype(np.int64))
        ).logits.numpy()
    positions = jnp.broadcast_to(jnp.arange(T), (3, T))
    got = np.asarray(ours(jnp.asarray(tokens), positions, causal_mask(jnp.asarray(valid))))
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero numbers
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(got[row, :n], ref[row, :n], atol=1e-4, rtol=0)


# Default RoPE is covered by tests/model/test_decoder.py; these add the scaled variants.
@pytest.mark.parametrize("name", ["qwen2_untied_linear_rope", "llama_untied_llama3_rope"])
def test_cached_ragged_prefill_then_decode_equals_full_forward(load_case, name):
    _, _, ours, cfg = load_case(name)
    graphdef, state = nnx.split(ours)
    # jitted once (eager NNX calls re-trace the layer scan every time: seconds per step)
    append = jax.jit(lambda st, tok, n, c: nnx.merge(graphdef, st).append(tok, n, c, all_logits=True))
    decode = jax.jit(lambda st, tok, c, act: nnx.merge(graphdef, st).decode(tok, c, act))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (3, T))
    full = np.asarray(
        ours(
            jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(T), (3, T)), causal_mask(jnp.ones((3, T), bool))
        )
    )
    prefill = np.array([5, 23, 1])
    chunk = np.where(np.arange(24)[None, :] < prefill[:, None], tokens[:, :24], 0)
    logits, cache = append(state, jnp.asarray(chunk), jnp.asarray(prefill), init_cache(cfg, 3, T))
    for row, n in enumerate(prefill):
        np.testing.assert_allclose(np.asarray(logits[row, :n]), full[row, :n], atol=1e-4, rtol=0)
    written = prefill.copy()
    for step in range(6):
        active = np.array([True, step % 2 == 0, True])  # row 1 idles every other step
        step_tokens = tokens[np.arange(3), np.minimum(written, T - 1)]
        logits, cache = decode(state, jnp.asarray(step_tokens), cache, jnp.asarray(active))
        for row in np.flatnonzero(active):
            np.testing.assert_allclose(np.asarray(logits[row]), full[row, written[row]], atol=1e-4, rtol=0)
        written += active
    np.testing.assert_array_equal(np.asarray(cache.lengths), written)
