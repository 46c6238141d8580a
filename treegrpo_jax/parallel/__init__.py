"""Mesh, logical-axis rules and shardings."""

from treegrpo_jax._exports import lazy_exports

_EXPORTS = {
    "AXES": "mesh",
    "MeshConfig": "mesh",
    "make_mesh": "mesh",
    "DEFAULT_RULES": "rules",
    "Rules": "rules",
    "constrain": "rules",
    "logical_to_spec": "rules",
    "named_sharding": "rules",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
