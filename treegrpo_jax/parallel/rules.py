"""Logical axis names → mesh axes.

Parameters and activations are annotated with a few short logical names
(batch, length, vocab, embed, mlp, heads, kv_heads, head_dim, layers). A rules table,
set in the config, maps each name to a mesh axis (or a tuple of axes, or None).

A mapping is dropped for a dimension the mesh axes do not divide (e.g. SmolLM2's 3 KV
heads on a tensor axis of 2): that dimension is replicated instead of failing, which is
what a user wants when the same rules serve models of many sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# FSDP shards the embedding dimension of weights; tensor parallelism shards heads/mlp/vocab.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),
)


def _axis_size(mesh: Mesh, axes) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def logical_to_spec(
    names: Sequence[str | None], rules: Rules = DEFAULT_RULES, *, shape=None, mesh: Mesh | None = None
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry `names`.

    With `shape` and `mesh`, mappings that do not divide the dimension are dropped, and a
    mesh axis already used by an earlier dimension is not used twice.
    """
    table = dict(rules)
    unknown = [n for n in names if n is not None and n not in table]
    if unknown:
        raise ValueError(f"logical axis names {unknown} have no rule; known: {sorted(table)}")
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        axes = None if name is None else table[name]
        if axes is not None:
            tup = (axes,) if isinstance(axes, str) else tuple(axes)
            if used & set(tup) or shape is not None and mesh is not None and shape[i] % _axis_size(mesh, tup):
                axes = None
            else:
                used |= set(tup)
        spec.append(axes)
    return PartitionSpec(*spec)


def named_sharding(
    names: Sequence[str | None], shape, mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules, shape=shape, mesh=mesh))


def constrain(x: jax.Array, names: Sequence[str | None], mesh: Mesh | None, rules: Rules = DEFAULT_RULES):
    """`with_sharding_constraint` by logical names; a no-op without a mesh (single device)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(names, x.shape, mesh, rules))
