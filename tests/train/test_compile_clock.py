"""The compile clock counts XLA compiles and nothing else."""

import jax
import jax.numpy as jnp

from treegrpo_jax.train.compile_clock import compile_seconds


def test_a_new_shape_adds_compile_seconds_and_a_cached_one_adds_none():
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    before = compile_seconds()
    f(jnp.ones(17)).block_until_ready()
    after_first = compile_seconds()
    assert after_first > before  # a compile happened and was timed
    f(jnp.ones(17)).block_until_ready()  # cached: no compile
    assert compile_seconds() == after_first
    f(jnp.ones(18)).block_until_ready()  # a new shape compiles again
    assert compile_seconds() > after_first
