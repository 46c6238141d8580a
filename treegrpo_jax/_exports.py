"""Package `__init__`s that cost only what is used: public names load from their module on first use.

`import treegrpo_jax.rl.loss` runs `treegrpo_jax/rl/__init__.py` first; if that imported every
module of the package (and they theirs), a loss function would pull in transformers, tokenizers and
gguf. Each package instead lists its public names and the module that defines them; PEP 562's
module `__getattr__` imports that module when a name is first asked for
(`from treegrpo_jax.model import Decoder` still works) and caches the value in the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable, Callable]:
    """(`__getattr__`, `__dir__`) for `package`; `names` maps each public name to the submodule
    (relative to `package`) that defines it, or to "" when the name *is* a submodule
    (`rl.advantages`). A function named like its own module (`rl.train_step`) cannot be lazy:
    importing the module binds the module as the package attribute, so such a package binds the
    function eagerly after this call."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{names[name] or name}")
        value = module if not names[name] else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
