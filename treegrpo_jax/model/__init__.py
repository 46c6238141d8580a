"""The policy: NNX decoder (Llama / Qwen2 / SmolLM2), slot KV cache, weights and tokenizers."""

from treegrpo_jax._exports import lazy_exports

_EXPORTS = {
    "train_bpe_tokenizer": "bpe_train",
    "abstract_model": "build",
    "init_model": "build",
    "param_shardings": "build",
    "KVCache": "cache",
    "init_cache": "cache",
    "ModelConfig": "config",
    "RopeScaling": "config",
    "RopeType": "config",
    "Decoder": "decoder",
    "causal_mask": "decoder",
    "load_pretrained": "pretrained",
    "Tokenizer": "tokenizer",
    "load_gguf": "weights_gguf",
    "load_hf": "weights_hf",
    "save_hf": "weights_hf",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
