"""treegrpo_jax: Tree-GRPO (tree-search rollouts + tree-relative advantages) in JAX/Flax.

Data flows one way: data → rollout (uses model + env) → rl (uses model) → train.
"""

__version__ = "0.1.0"
