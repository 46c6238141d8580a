"""The slot cache's forks: the in-place block copies against the gather/scatter reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.model.cache import FORK_CHUNK, KVCache, copy_prefixes, fork_slots


def _random_cache(num_slots, max_len, seed, layers=2, kv_heads=2, dim=4):
    shape = (layers, num_slots, kv_heads, max_len, dim)
    rng = np.random.default_rng(seed)
    return KVCache(
        k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
        v=jnp.asarray(rng.standard_normal(shape), jnp.float32),
        lengths=jnp.asarray(rng.integers(0, max_len, num_slots), jnp.int32),
    )


@pytest.mark.parametrize("max_len", [3 * FORK_CHUNK, 2 * FORK_CHUNK + 37])  # a ragged last chunk too
def test_copy_prefixes_writes_what_fork_slots_writes(max_len):
    cache = _random_cache(num_slots=10, max_len=max_len, seed=0)
    src = np.asarray([0, 1, 2, 0, 3, 0], np.int32)
    dst = np.asarray([5, 6, 7, 8, 9, 10], np.int32)  # the last pair is padding (dst = S)
    # 0 positions, part of a chunk, exactly a chunk, over one, the whole slot; padding.
    lengths = np.asarray([0, 17, FORK_CHUNK, FORK_CHUNK + 1, max_len, 50], np.int32)
    ref = fork_slots(cache, src, dst, lengths)
    ours = jax.jit(copy_prefixes)(cache, src, dst, lengths)

    np.testing.assert_array_equal(ours.lengths, ref.lengths)
    for name in ("k", "v"):
        x_ours, x_ref, x_in = (np.asarray(getattr(c, name)) for c in (ours, ref, cache))
        for d, n in zip(dst[:-1], lengths[:-1], strict=True):  # the prefix each branch attends
            np.testing.assert_array_equal(x_ours[:, d, :, :n], x_ref[:, d, :, :n])
        untouched = np.setdiff1d(np.arange(10), dst)  # sources and bystanders keep every position
        np.testing.assert_array_equal(x_ours[:, untouched], x_in[:, untouched])
        np.testing.assert_array_equal(x_ref[:, untouched], x_in[:, untouched])


def test_copy_prefixes_copies_from_the_sources_as_they_were():
    # Two branches of one source, then a fork into a slot whose old content must go.
    cache = _random_cache(num_slots=4, max_len=FORK_CHUNK * 2, seed=1)
    src, dst, lengths = np.asarray([0, 0]), np.asarray([1, 2]), np.asarray([90, 40])
    out = copy_prefixes(cache, src, dst, lengths)
    k0 = np.asarray(cache.k)[:, 0]
    np.testing.assert_array_equal(np.asarray(out.k)[:, 1, :, :90], k0[:, :, :90])
    np.testing.assert_array_equal(np.asarray(out.k)[:, 2, :, :40], k0[:, :, :40])
    np.testing.assert_array_equal(np.asarray(out.lengths)[[1, 2]], [90, 40])
