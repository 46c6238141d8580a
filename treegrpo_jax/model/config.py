"""Frozen configuration of the decoder (Llama / Qwen2 / SmolLM2 family).

One dataclass drives the whole model. It is built either by hand (tests, the tiny
synthetic-world model), from an HF ``config.json`` (``from_hf_dict``), or from GGUF
metadata (``model.gguf``). It validates itself so that a bad value fails here, with
the name of the field, rather than as a shape error deep inside a jitted function.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp


class RopeType(enum.StrEnum):
    DEFAULT = "default"
    LINEAR = "linear"  # positions divided by `factor`
    LLAMA3 = "llama3"  # frequency-dependent scaling of Llama 3.1+


# Architectures (HF `architectures[0]` / `model_type`) this decoder reproduces exactly.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_scaling``/``rope_parameters``)."""

    rope_type: RopeType | str = RopeType.DEFAULT  # a name (HF's) is parsed in __post_init__
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self):
        object.__setattr__(self, "rope_type", RopeType(self.rope_type))
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.rope_type == RopeType.LLAMA3 and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("rope_scaling: llama3 needs high_freq_factor > low_freq_factor")


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class Remat(enum.StrEnum):
    """What a differentiated forward pass keeps per layer for its backward pass."""

    NONE = "none"  # everything (fastest; a [B, H, T, T] attention block per layer)
    LAYER = "layer"  # only each layer's input: the backward recomputes the layer (~1.3x the FLOPs)
    DOTS = "dots"  # also the weight matmuls' outputs; attention is recomputed


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Decoder hyper-parameters. Letters are the dimension legend used across the package.

    Attributes:
      vocab_size: V.
      embed_dim: E, the residual width (HF ``hidden_size``).
      mlp_dim: F, the SwiGLU hidden width (HF ``intermediate_size``).
      num_layers: L.
      num_heads: H query heads.
      num_kv_heads: K key/value heads (grouped-query attention: H % K == 0).
      head_dim: D.
      rope_theta: RoPE base.
      rope_scaling: optional frequency scaling.
      rms_norm_eps: epsilon of every RMSNorm.
      qkv_bias: whether q/k/v projections have a bias (Qwen2: yes).
      tie_embeddings: whether the LM head is the transposed token embedding.
      max_position_embeddings: longest context the checkpoint was trained for (informative).
      param_dtype: storage dtype of parameters.
      dtype: compute dtype of matmuls (norms, softmax and logits are always f32).
      bos_token_id / eos_token_ids: from the checkpoint, for generation.
      remat: what training keeps per layer for the backward pass (`Remat`); a training-time
        choice, not part of the checkpoint: it changes memory and time, never the numbers.
      attention_chunk: full-sequence attention computes its queries this many tokens at a time,
        each chunk recomputed in the backward (0: all at once). Scores then take
        `chunk × T` per row and head instead of `T × T`: what lets 4,096-token rows train where
        HBM is 16 GiB. A training-time choice like `remat` (numbers equal up to float rounding);
        used when it divides T (and, for packed trees, is a multiple of their 64-token blocks).
    """

    vocab_size: int
    embed_dim: int
    mlp_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    param_dtype: str = "float32"
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: Sequence[int] = ()  # any sequence (a JSON list); stored as a tuple
    remat: Remat | str = Remat.NONE  # a name is parsed in __post_init__
    attention_chunk: int = 0

    def __post_init__(self):
        for name in (
            "vocab_size",
            "embed_dim",
            "mlp_dim",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; allowed: {sorted(_DTYPES)}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if self.remat not in set(Remat):
            raise ValueError(f"ModelConfig.remat={self.remat!r}; allowed: {[r.value for r in Remat]}")
        object.__setattr__(self, "remat", Remat(self.remat))
        chunk = self.attention_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"ModelConfig.attention_chunk must be an int ≥ 0 (0: off), got {chunk!r}")

    @property
    def jnp_param_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        e, f, h, k, d, v = (
            self.embed_dim,
            self.mlp_dim,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size,
        )
        attn = e * h * d + 2 * e * k * d + h * d * e + (h * d + 2 * k * d if self.qkv_bias else 0)
        per_layer = attn + 3 * e * f + 2 * e
        return v * e * (1 if self.tie_embeddings else 2) + self.num_layers * per_layer + e

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> ModelConfig:
        """Builds the config from an HF ``config.json`` dict (Llama 3.x, Qwen2/2.5, SmolLM2)."""
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        known = set(SUPPORTED_ARCHITECTURES) | set(SUPPORTED_ARCHITECTURES.values())
        if not (set(archs) & known or model_type in known):
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type {sorted(SUPPORTED_ARCHITECTURES.values())})"
            )
        is_qwen2 = model_type == "qwen2" or "Qwen2ForCausalLM" in archs
        if hf.get("use_sliding_window"):  # Qwen2 option; the decoder attends to the full context
            raise ValueError("use_sliding_window=true (sliding-window attention) is not supported")
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta", scaling.get("rope_theta", 10_000.0))
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        if rope_type not in {t.value for t in RopeType}:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {[t.value for t in RopeType]}"
            )
        rope = RopeScaling(
            rope_type=rope_type,
            factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        num_heads = hf["num_attention_heads"]
        kwargs = dict(
            vocab_size=hf["vocab_size"],
            embed_dim=hf["hidden_size"],
            mlp_dim=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=bool(hf.get("attention_bias", is_qwen2)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` that makes `transformers` build this exact model."""
        qwen = self.qkv_bias
        hf: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.embed_dim,
            "intermediate_size": self.mlp_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.param_dtype,
        }
        if not qwen:
            hf["attention_bias"] = False
            hf["mlp_bias"] = False
        if self.rope_scaling.rope_type != RopeType.DEFAULT:
            rs = self.rope_scaling
            hf["rope_scaling"] = {"rope_type": rs.rope_type.value, "factor": rs.factor}
            if rs.rope_type == RopeType.LLAMA3:
                hf["rope_scaling"].update(
                    low_freq_factor=rs.low_freq_factor,
                    high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_position_embeddings,
                )
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            hf["eos_token_id"] = (
                list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
            )
        return hf
