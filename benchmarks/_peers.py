"""Peer generators for the decode benchmark: `transformers` PyTorch and the Tunix sampler.

Legend: B rows, P prompt tokens, N new tokens, L layers, E embed, F mlp, H query heads,
K kv heads, D head dim, V vocab.

Each builder takes *our* `Decoder` and copies its weights, so all three systems run the
same function (greedy tokens can be compared, not only timed), and returns a callable
`generate(prompts [B, P] int) -> tokens [B, N]` that blocks until the tokens are on the
host. A peer that cannot run raises `PeerUnavailable` with the precise reason; the
benchmark records it instead of crashing.
"""

from __future__ import annotations

import importlib.metadata
import tempfile
import warnings
from collections.abc import Callable

import numpy as np

from treegrpo_jax.model.config import ModelConfig, RopeType
from treegrpo_jax.model.decoder import Decoder

Generate = Callable[[np.ndarray], np.ndarray]

# Tunix' Llama3 `apply_rope` is called without the config's theta and always uses its
# default base; our config must use the same base for the three systems to agree.
TUNIX_ROPE_THETA = 1_000_000.0
# Tunix masks every cached position whose token equals the pad id; prompts avoid it.
PAD_ID = 0


class PeerUnavailable(RuntimeError):
    """A peer system cannot run this setup; the message says exactly why."""


def version_of(dist: str) -> str | None:
    """Installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------ transformers
def transformers_generator(model: Decoder, cfg: ModelConfig, *, new_tokens: int, threads: int) -> Generate:
    """`LlamaForCausalLM.generate` (greedy, KV cache) on our weights, under inference mode.

    The weights go through our own HF export (`save_hf`), so the mapping is the one the
    parity tests check, not a second copy of it.
    """
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError as e:  # the `bench` / `test` extra is not installed
        raise PeerUnavailable(f"transformers/torch not importable: {e}") from e
    from treegrpo_jax.model.weights_hf import save_hf

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, cfg, tmp)
        hf = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # fixed lengths: never stop early
    hf.generation_config.pad_token_id = PAD_ID

    def generate(prompts: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(np.asarray(prompts, np.int64))
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,
            )
        return out[:, ids.shape[1] :].numpy()

    generate.info = {  # type: ignore[attr-defined]
        "attn_implementation": hf.config._attn_implementation,
        "torch_threads": torch.get_num_threads(),
    }
    return generate


# ------------------------------------------------------------------------- Tunix
class _IdTokenizer:
    """Token ids as space-separated text: Tunix' sampler only takes strings."""

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self):
        return None  # no BOS is prepended: prompts are used exactly as given

    def eos_id(self) -> int:
        return -1

    def pad_id(self) -> int:
        return PAD_ID


class LayerRow:
    """Layer `i` of one of our stacked [L, ...] variables, readable with `[...]` like a variable."""

    def __init__(self, stacked, i: int):
        self.stacked, self.i = stacked, i

    def __getitem__(self, _):
        return self.stacked[...][self.i]


def tunix_weight_pairs(model, tm, cfg):
    """(our variable, Tunix variable) pairs for Tunix' Llama3 and Qwen2 (the same attribute names);
    our stacked per-layer arrays are indexed by layer."""
    yield model.embed, tm.embedder.input_embedding
    yield model.final_norm, tm.final_norm.w
    if not cfg.tie_embeddings:
        yield model.lm_head, tm.lm_head.w
    for i, layer in enumerate(tm.layers):
        yield LayerRow(model.attn_norm, i), layer.input_layernorm.w
        yield LayerRow(model.mlp_norm, i), layer.post_attention_layernorm.w
        yield LayerRow(model.wq, i), layer.attn.q_proj.w
        yield LayerRow(model.wk, i), layer.attn.k_proj.w
        yield LayerRow(model.wv, i), layer.attn.v_proj.w
        yield LayerRow(model.wo, i), layer.attn.o_proj.w
        yield LayerRow(model.w_gate, i), layer.mlp.gate_proj.kernel
        yield LayerRow(model.w_up, i), layer.mlp.up_proj.kernel
        yield LayerRow(model.w_down, i), layer.mlp.down_proj.kernel


def _tunix_model(model: Decoder, cfg: ModelConfig):
    """A Tunix `Llama3` of the same shape holding our weights (layouts already match)."""
    from flax import nnx
    from tunix.models.llama3 import model as llama3

    if cfg.qkv_bias:
        raise PeerUnavailable("Tunix Llama3 has no q/k/v bias; use a Llama config (qkv_bias=False)")
    if cfg.rope_scaling.rope_type != RopeType.DEFAULT:
        raise PeerUnavailable(f"Tunix Llama3 has no RoPE scaling; got {cfg.rope_scaling.rope_type}")
    if cfg.rope_theta != TUNIX_ROPE_THETA:
        raise PeerUnavailable(
            f"Tunix 0.1.7 Llama3 ignores rope_theta (always {TUNIX_ROPE_THETA:g}); got {cfg.rope_theta:g}"
        )
    tcfg = llama3.ModelConfig(
        num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        embed_dim=cfg.embed_dim,
        hidden_dim=cfg.mlp_dim,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_kv_heads,
        rope_theta=int(cfg.rope_theta),
        norm_eps=cfg.rms_norm_eps,
        weight_tying=cfg.tie_embeddings,
        shd_config=llama3.ShardingConfig.get_default_sharding(is_sampling=True),
    )
    tm = llama3.Llama3(tcfg, rngs=nnx.Rngs(0))

    # Ours "e h d" / "e k d" / "h d e" / "e f" / "f e" are exactly Tunix' DNH / DKH / NHD / Linear kernels.
    for ours, theirs in tunix_weight_pairs(model, tm, cfg):
        theirs.set_value(ours[...])
    return tm


def tunix_generator(model: Decoder, cfg: ModelConfig, *, prompt_len: int, new_tokens: int) -> Generate:
    """Tunix' vanilla `Sampler` (greedy) on our weights; the KV cache is exactly P + N long."""
    if version_of("google-tunix") is None:
        raise PeerUnavailable("google-tunix is not installed (see benchmarks/README.md for the install)")
    try:
        from tunix.generate import sampler as sampler_lib
    except Exception as e:  # noqa: BLE001 -- any import failure is a reason to report
        raise PeerUnavailable(f"tunix import failed: {type(e).__name__}: {e}") from e
    sampler = sampler_lib.Sampler(
        _tunix_model(model, cfg),
        _IdTokenizer(),
        sampler_lib.CacheConfig(
            cache_size=prompt_len + new_tokens,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
        ),
    )
    never = cfg.vocab_size  # an id the model cannot produce: fixed lengths
    tokenizer = _IdTokenizer()

    def generate(prompts: np.ndarray) -> np.ndarray:
        if np.any(prompts == PAD_ID):
            raise ValueError(f"Tunix treats token {PAD_ID} as padding; prompts must avoid it")
        texts = [tokenizer.decode(row) for row in prompts]
        with warnings.catch_warnings():
            # Llama3 has no `init_cache`, so the sampler warns that it uses its own.
            warnings.simplefilter("ignore", DeprecationWarning)
            out = sampler(
                texts,
                max_generation_steps=new_tokens,
                max_prompt_length=prompts.shape[1],
                eos_tokens=[never],
                temperature=0.0,
            )
        return np.stack([np.asarray(t[:new_tokens]) for t in out.tokens])

    generate.info = {"cache_size": prompt_len + new_tokens}  # type: ignore[attr-defined]
    return generate
