"""The multi-hop QA config: the paper run and its variants.

The config ships in the package, `treegrpo_jax/configs/multihop.py` (its variants are documented
there); this file keeps the design card's top-level `configs/`.
"""

from treegrpo_jax.configs.multihop import get_config

__all__ = ["get_config"]
