"""Imports cost only what they use, and every package's public names still resolve."""

import importlib
import subprocess
import sys

import pytest

PACKAGES = ["data", "env", "model", "parallel", "rl", "rollout"]


def _loaded_after(statement: str, heavy: tuple[str, ...]) -> list[str]:
    code = f"import sys; {statement}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return eval(out.stdout.strip())


@pytest.mark.parametrize(
    "module", ["treegrpo_jax.rl.loss", "treegrpo_jax.rl.advantages", "treegrpo_jax.model.decoder"]
)
def test_the_numeric_core_loads_no_tokenizer_or_weight_reader(module):
    assert (
        _loaded_after(
            f"import {module}", ("transformers", "tokenizers", "gguf", "bm25s", "tensorflow_datasets")
        )
        == []
    )


def test_a_name_loads_its_module_on_first_use():
    assert _loaded_after("from treegrpo_jax.model import ModelConfig", ("gguf", "transformers")) == []
    assert _loaded_after("from treegrpo_jax.model import load_gguf", ("gguf",)) == ["gguf"]


def test_a_function_named_like_its_module_is_the_function():
    from treegrpo_jax.rl import advantages, train_step

    assert callable(train_step) and train_step.__module__ == "treegrpo_jax.rl.train_step"
    assert advantages.__name__ == "treegrpo_jax.rl.advantages" and callable(advantages.compute)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_resolves(package):
    module = importlib.import_module(f"treegrpo_jax.{package}")
    assert module.__all__ and sorted(dir(module)) == sorted(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None, (package, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        module.nope  # noqa: B018
