"""GGUF files (llama.cpp) → `Decoder`, dequantised to float, loaded straight into shardings.

A GGUF file is presented to `weights_hf.assemble_decoder` as one more tensor source in HF
layout, so the sharded assembly is shared with the safetensors loader. Two GGUF habits
are undone here:

* GGUF lists shapes innermost-first; `gguf.quants.dequantize` already returns the
  row-major array ([out, in], like HF), so only names need mapping.
* llama.cpp's converter permutes the rows of Q and K of *Llama* models so that rotary
  pairs are adjacent (interleaved RoPE); our decoder, like HF, rotates halves. We apply
  the inverse permutation per head (Qwen2 GGUFs use half-rotation and are not permuted).
"""

from __future__ import annotations

import functools
import pathlib
import re

import gguf
import jax
import numpy as np

from treegrpo_jax.model.config import ModelConfig, RopeScaling
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.model.weights_hf import assemble_decoder, check_source
from treegrpo_jax.parallel import DEFAULT_RULES, Rules

# architecture → whether llama.cpp permuted Q/K rows for interleaved rotary.
_ARCHITECTURES = {"llama": True, "qwen2": False}

# GGUF tensor name → HF name ({i} is the layer).
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_PATTERNS = [(re.compile("^" + re.escape(g).replace(r"\{i\}", r"(\d+)") + "$"), h) for g, h in _NAMES.items()]


def _hf_name(gguf_name: str) -> str | None:
    for pattern, hf in _PATTERNS:
        match = pattern.match(gguf_name)
        if match:
            return hf.format(i=match.group(1)) if match.groups() else hf
    return None


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` (convert_hf_to_gguf.py) on Q/K rows.

    llama.cpp: `w.reshape(n_head, 2, rows // n_head // 2, *cols).swapaxes(1, 2)` turns each
    head's [first half; second half] rows into interleaved pairs. Works for biases too.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: str | pathlib.Path) -> gguf.GGUFReader:
    """A memory-mapped reader, with one-line errors for a missing or foreign file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    try:
        return gguf.GGUFReader(path)
    except ValueError as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e})") from None


def field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader: gguf.GGUFReader, **overrides) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.*` keys); tied when there is no `output.weight`."""
    arch = field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        # Llama 3.1+ GGUFs bake their rope scaling into per-frequency factors we do not model.
        raise ValueError("GGUF has rope_freqs (Llama 3.1+ rope scaling): load the HF checkpoint instead")
    scaling_type = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}; supported: none, linear")
    rope = RopeScaling()
    if scaling_type == "linear":
        rope = RopeScaling(rope_type="linear", factor=float(field(reader, f"{arch}.rope.scaling.factor")))
    embed = int(field(reader, f"{arch}.embedding_length"))
    heads = int(field(reader, f"{arch}.attention.head_count"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    head_dim = int(field(reader, f"{arch}.attention.key_length", embed // heads))
    if int(field(reader, f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(
            "GGUF rotates only part of each head (rope.dimension_count != head_dim): unsupported"
        )
    kwargs = dict(
        vocab_size=int(vocab),
        embed_dim=embed,
        mlp_dim=int(field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10_000.0)),
        rope_scaling=rope,
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        qkv_bias="blk.0.attn_q.bias" in names,
        tie_embeddings="output.weight" not in names,
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 4096)),
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


class GGUFSource:
    """HF-layout, dequantised (float32) view of a GGUF file's tensors.

    Quantised blocks cannot be sliced cheaply, so a tensor is dequantised whole and kept
    in a small LRU cache: every device's callback for the same layer reuses it, and at
    most one parameter's worth of layers is alive at a time.
    """

    def __init__(self, reader: gguf.GGUFReader, cfg: ModelConfig):
        arch = field(reader, "general.architecture")
        self._cfg, self._permuted = cfg, _ARCHITECTURES[arch]
        self._tensors = {}
        for t in reader.tensors:  # unknown tensors keep their GGUF name: check_source reports them
            self._tensors[_hf_name(t.name) or t.name] = t
        self._full = functools.lru_cache(maxsize=cfg.num_layers + 1)(self._dequantize)

    def _dequantize(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        # A plain ndarray view: dequantising a memmap subclass is several times slower.
        w = np.asarray(gguf.quants.dequantize(t.data.view(np.ndarray), t.tensor_type), np.float32)
        # A 1-D tensor comes back as [1, n] from some quant types; GGUF shapes are reversed.
        w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
        if self._permuted and ".q_proj." in name:
            w = unpermute_rotary(w, self._cfg.num_heads)
        elif self._permuted and ".k_proj." in name:
            w = unpermute_rotary(w, self._cfg.num_kv_heads)
        return w

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self._tensors.get(name)
        return None if t is None else tuple(int(n) for n in reversed(t.shape))

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self._full(name)[index]


def load_gguf(
    path: str | pathlib.Path,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    param_dtype: str = "float32",
    dtype: str | None = None,
) -> tuple[Decoder, ModelConfig]:
    """Loads a Llama / Qwen2 GGUF file, dequantised.

    Args:
      path: the .gguf file.
      mesh: target mesh; None → single device.
      rules: logical-axis rules.
      param_dtype: storage dtype after dequantisation.
      dtype: compute dtype; default: `param_dtype`.

    Returns:
      (decoder, config).
    """
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, param_dtype=param_dtype, dtype=dtype or param_dtype)
    source = GGUFSource(reader, cfg)
    check_source(source, cfg, str(path))
    return assemble_decoder(source, cfg, mesh=mesh, rules=rules), cfg
