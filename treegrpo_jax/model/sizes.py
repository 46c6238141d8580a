"""Published model shapes by name, as the `config.json` fields their HF checkpoints carry.

What a compile for a target needs is a model's shape, not its weights: `treegrpo-compile`
takes `--config.model.path=qwen2.5-3b` (or any HF directory that holds a `config.json`) and
builds the `ModelConfig` through `ModelConfig.from_hf_dict`, the same path a real checkpoint
takes. The fields below are those of the public `config.json` files of each model.
"""

from __future__ import annotations

import json
import os

from treegrpo_jax.model.config import ModelConfig

_QWEN = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32_768,
)
_LLAMA3 = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    rope_theta=500_000.0,
    rms_norm_eps=1e-5,
    attention_bias=False,
    max_position_embeddings=131_072,
)


def _llama3_scaling(factor: float) -> dict:
    return dict(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


MODEL_SIZES: dict[str, dict] = {
    "qwen2.5-0.5b": _QWEN
    | dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": _QWEN
    | dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-3b": _QWEN
    | dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": _QWEN
    | dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "llama3.2-3b": _LLAMA3
    | dict(
        vocab_size=128256,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_scaling=_llama3_scaling(32.0),
    ),
    "llama3.1-8b": _LLAMA3
    | dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        rope_scaling=_llama3_scaling(8.0),
    ),
}


def model_shape(spec: str, **overrides) -> ModelConfig:
    """The `ModelConfig` of a named size or of an HF directory's `config.json` (weights unread).

    Raises:
      ValueError: `spec` is neither a known name nor a directory holding a `config.json`.
    """
    if spec in MODEL_SIZES:
        return ModelConfig.from_hf_dict(MODEL_SIZES[spec], **overrides)
    path = os.path.join(spec, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return ModelConfig.from_hf_dict(json.load(f), **overrides)
    raise ValueError(
        f"model {spec!r}: not a named size ({', '.join(MODEL_SIZES)}) nor a directory with a config.json"
    )
