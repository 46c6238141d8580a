"""The single-hop QA config (NQ).

The config ships in the package, `treegrpo_jax/configs/singlehop.py` (its variants are documented
there); this file keeps the design card's top-level `configs/`.
"""

from treegrpo_jax.configs.singlehop import get_config

__all__ = ["get_config"]
