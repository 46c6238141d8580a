"""Decoder: cached paths equal the full forward; masks and positions are honoured."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.model.build import abstract_model, init_model
from treegrpo_jax.model.cache import init_cache
from treegrpo_jax.model.config import ModelConfig, RopeScaling
from treegrpo_jax.model.decoder import causal_mask
from treegrpo_jax.model.sizes import model_shape

TINY = ModelConfig(
    vocab_size=101,
    embed_dim=48,
    mlp_dim=96,
    num_layers=3,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
    qkv_bias=True,
)


def _full_logits(model, tokens):
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    return model(tokens, pos, causal_mask(jnp.ones((b, t), bool)))


@pytest.mark.parametrize("attend_len", [None, 32])
def test_ragged_appends_equal_full_forward(attend_len):
    model = init_model(TINY, seed=1)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (4, 24)))
    full = np.asarray(_full_logits(model, tokens))
    cache = init_cache(TINY, 4, 32)
    written = np.zeros(4, int)
    # Three rounds of ragged chunks, some rows idle (chunk 0) in some rounds.
    for chunk in ([5, 0, 8, 1], [3, 7, 0, 1], [0, 9, 16, 1]):
        chunk = np.asarray(chunk)
        toks = np.zeros((4, 16), np.int32)
        for s in range(4):
            toks[s, : chunk[s]] = tokens[s, written[s] : written[s] + chunk[s]]
        logits, cache = model.append(
            jnp.asarray(toks), jnp.asarray(chunk), cache, attend_len=attend_len, all_logits=True
        )
        for s in range(4):
            got = np.asarray(logits[s, : chunk[s]])
            np.testing.assert_allclose(got, full[s, written[s] : written[s] + chunk[s]], atol=2e-5)
        written += chunk
    np.testing.assert_array_equal(np.asarray(cache.lengths), written)


def test_decode_step_equals_full_forward_at_per_row_positions():
    model = init_model(TINY, seed=2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, TINY.vocab_size, (3, 12)))
    full = np.asarray(_full_logits(model, tokens))
    cache = init_cache(TINY, 3, 16)
    lens = np.array([2, 5, 9])
    _, cache = model.append(tokens[:, :9], jnp.asarray(lens), cache)
    for _ in range(3):
        nxt = tokens[jnp.arange(3), jnp.asarray(lens)]
        logits, cache = model.decode(nxt, cache, jnp.ones(3, bool))
        for s in range(3):
            np.testing.assert_allclose(np.asarray(logits[s]), full[s, lens[s]], atol=2e-5)
        lens = lens + 1


def test_inactive_slots_are_untouched():
    model = init_model(TINY, seed=3)
    cache = init_cache(TINY, 2, 8)
    _, cache = model.append(jnp.ones((2, 4), jnp.int32), jnp.asarray([4, 4]), cache)
    before = jax.tree.map(np.asarray, cache)
    _, after = model.decode(jnp.asarray([7, 7]), cache, jnp.asarray([True, False]))
    np.testing.assert_array_equal(np.asarray(after.k[:, 1]), before.k[:, 1])
    np.testing.assert_array_equal(np.asarray(after.lengths), [5, 4])


def test_packed_rows_with_block_mask_equal_separate_rows():
    """Two sequences packed in one row (restarted positions, block-diagonal mask)."""
    model = init_model(TINY, seed=4)
    a = np.random.default_rng(2).integers(0, TINY.vocab_size, 7)
    b = np.random.default_rng(3).integers(0, TINY.vocab_size, 5)
    packed = jnp.asarray(np.concatenate([a, b]))[None]
    positions = jnp.asarray(np.concatenate([np.arange(7), np.arange(5)]))[None]
    seg = np.array([0] * 7 + [1] * 5)
    mask = (seg[:, None] == seg[None, :]) & np.tril(np.ones((12, 12), bool))
    got = np.asarray(model(packed, positions, jnp.asarray(mask)[None]))
    np.testing.assert_allclose(
        got[0, :7], np.asarray(_full_logits(model, jnp.asarray(a)[None]))[0], atol=2e-5
    )
    np.testing.assert_allclose(
        got[0, 7:], np.asarray(_full_logits(model, jnp.asarray(b)[None]))[0], atol=2e-5
    )


def test_bf16_compute_is_close_to_f32():
    model = init_model(TINY, seed=5)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, TINY.vocab_size, (2, 10)))
    ref = np.asarray(_full_logits(model, tokens))
    model.cfg = TINY.replace(dtype="bfloat16")  # same params, bf16 matmuls
    got = np.asarray(_full_logits(model, tokens))
    assert got.dtype == np.float32  # logits always f32
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


@pytest.mark.parametrize(
    "name, billions",
    [("qwen2.5-3b", 3.09), ("qwen2.5-7b", 7.62), ("llama3.2-3b", 3.21), ("llama3.1-8b", 8.03)],
)
def test_full_size_configs_build_abstractly(name, billions):
    # The published parameter counts (3.09B, 7.62B, 3.21B, 8.03B) from the published shapes.
    cfg = model_shape(name, param_dtype="bfloat16")
    _, state = abstract_model(cfg)  # nnx.eval_shape: no memory
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    assert n == cfg.num_params
    assert abs(n / 1e9 - billions) < 0.01


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
        (dict(head_dim=7), "head_dim must be even"),
        (dict(dtype="float8"), "allowed"),
        (dict(num_layers=0), "num_layers must be a positive int"),
    ],
)
def test_bad_config_names_the_field(kwargs, message):
    base = dict(vocab_size=10, embed_dim=8, mlp_dim=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**base, **kwargs})


def test_unknown_architecture_is_one_line_error():
    with pytest.raises(ValueError, match="unsupported architecture.*MistralForCausalLM") as e:
        ModelConfig.from_hf_dict({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    message = str(e.value)
    assert "\n" not in message and "LlamaForCausalLM" in message  # one line, naming what is supported


def test_llama3_rope_scaling_changes_only_low_frequencies():
    from treegrpo_jax.model.rope import inv_frequencies

    base = TINY.replace(head_dim=64, num_heads=2, num_kv_heads=1, rope_theta=500_000.0)
    scaled = base.replace(
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=8192)
    )
    a, b = inv_frequencies(base), inv_frequencies(scaled)
    assert np.allclose(a[:4], b[:4])  # high frequencies untouched
    assert np.allclose(a[-1] / 8.0, b[-1])  # lowest frequency divided by the factor
