"""The tiny model of the RL tests, and compiling jitted steps quickly on CPU."""

from treegrpo_jax.model.config import ModelConfig

TINY = ModelConfig(
    vocab_size=64, embed_dim=32, mlp_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)

# XLA's CPU backend optimisations cost most of a tiny step's compile time and none of its
# meaning: tests compile the jitted steps with them off.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def compile_fast(jitted, *args):
    """`jitted` lowered for `args` and compiled with FAST_COMPILE (same shardings, same donation)."""
    return jitted.lower(*args).compile(compiler_options=FAST_COMPILE)
