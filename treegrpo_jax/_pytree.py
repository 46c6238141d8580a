"""Frozen dataclasses as JAX pytrees whose unflattening does not run `__init__`.

`jax.tree_util.register_dataclass` rebuilds an instance by calling the class, so every
`jax.tree.map`, `jit` lowering or sharding spec rebuilds it with whatever the leaves are then:
tracers, `ShapeDtypeStruct`s, `ArgInfo`s, `NamedSharding`s, `None`. A class whose `__init__`
checks its fields (`__post_init__`, or the tests' run-time shape checks: jaxtyping + beartype)
would reject those placeholders. Here unflattening sets the fields directly, as `equinox.Module`
does; constructing an instance by hand still runs `__init__` and every check.
"""

from __future__ import annotations

import dataclasses

import jax


def pytree_dataclass(cls: type) -> type:
    """Registers the dataclass `cls` as a pytree (fields with `metadata=dict(static=True)` are
    static, like `register_dataclass`'s) and returns it. Key paths name the fields, as
    `register_dataclass`'s do."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    data = tuple(f.name for f in fields if not f.metadata.get("static", False))
    meta = tuple(f.name for f in fields if f.metadata.get("static", False))
    keys = tuple(jax.tree_util.GetAttrKey(name) for name in data)

    def flatten_with_keys(x):
        children = [(k, getattr(x, n)) for k, n in zip(keys, data, strict=True)]
        return children, tuple(getattr(x, n) for n in meta)

    def flatten(x):
        return [getattr(x, n) for n in data], tuple(getattr(x, n) for n in meta)

    def unflatten(aux, children):
        obj = object.__new__(cls)
        for name, value in zip(data, children, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(meta, aux, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten_func=flatten)
    return cls
