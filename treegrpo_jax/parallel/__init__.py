"""Mesh, logical-axis rules and shardings."""

from treegrpo_jax.parallel.mesh import AXES, MeshConfig, make_mesh
from treegrpo_jax.parallel.rules import DEFAULT_RULES, Rules, constrain, logical_to_spec, named_sharding

__all__ = [
    "AXES",
    "DEFAULT_RULES",
    "MeshConfig",
    "Rules",
    "constrain",
    "logical_to_spec",
    "make_mesh",
    "named_sharding",
]
