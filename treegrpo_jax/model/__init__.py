"""The policy: NNX decoder (Llama / Qwen2 / SmolLM2), slot KV cache, weights and tokenizers."""

from treegrpo_jax.model.bpe_train import train_bpe_tokenizer
from treegrpo_jax.model.build import abstract_model, init_model, param_shardings
from treegrpo_jax.model.cache import KVCache, init_cache
from treegrpo_jax.model.config import ModelConfig, RopeScaling, RopeType
from treegrpo_jax.model.decoder import Decoder, causal_mask
from treegrpo_jax.model.pretrained import load_pretrained
from treegrpo_jax.model.tokenizer import Tokenizer
from treegrpo_jax.model.weights_gguf import load_gguf
from treegrpo_jax.model.weights_hf import load_hf, save_hf

__all__ = [
    "Decoder",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "RopeType",
    "Tokenizer",
    "abstract_model",
    "causal_mask",
    "init_cache",
    "init_model",
    "load_gguf",
    "load_hf",
    "load_pretrained",
    "param_shardings",
    "save_hf",
    "train_bpe_tokenizer",
]
