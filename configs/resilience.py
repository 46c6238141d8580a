"""The resilience config: toy runs the reliability checks kill and resume.

The config ships in the package, `treegrpo_jax/configs/resilience.py` (its variants are documented
there); this file keeps the design card's top-level `configs/`.
"""

from treegrpo_jax.configs.resilience import get_config

__all__ = ["get_config"]
