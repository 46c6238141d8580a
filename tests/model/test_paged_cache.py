"""The paged cache is the slot cache read through a page table: same logits, same keys."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.cache import fork_slots, init_cache
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.paged_cache import copy_pages, init_paged_cache
from treegrpo_jax.native import Kernels, build

CFG = ModelConfig(
    vocab_size=61, embed_dim=48, mlp_dim=64, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8
)
KERNELS = [Kernels.XLA] + ([Kernels.NATIVE] if build.available() else [])


def _scattered_tables(num_slots, pages_per_seq, num_pages, seed):
    """Every sequence gets its pages in a random, non-contiguous order."""
    perm = np.random.default_rng(seed).permutation(num_pages)[: num_slots * pages_per_seq]
    return perm.reshape(num_slots, pages_per_seq).astype(np.int32)


def _paged_keys(cache, slot):
    """Sequence `slot`'s keys `[L, K, T, D]` in token order, read through its page table."""
    pages = np.asarray(cache.page_table[slot])
    return np.asarray(cache.k, np.float32)[:, :, pages].reshape(
        CFG.num_layers, CFG.num_kv_heads, -1, CFG.head_dim
    )


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16])
def test_prefill_then_decode_equals_the_slot_cache(kernels, kv_dtype):
    model = init_model(CFG, seed=3)
    slots_cache = init_cache(CFG, num_slots=4, max_len=32, dtype=kv_dtype)
    paged = init_paged_cache(CFG, num_slots=4, max_len=32, num_pages=19, page_size=8, dtype=kv_dtype)
    paged = dataclasses.replace(paged, page_table=jnp.asarray(_scattered_tables(4, 4, 19, seed=0)))
    prompts = jax.random.randint(jax.random.key(1), (4, 13), 1, 61)
    chunk = jnp.asarray([13, 3, 9, 0])
    append = jax.jit(lambda t, n, c, s: model.append(t, n, c, slots=s))
    rows = jnp.arange(4)
    ls, slots_cache = append(prompts, chunk, slots_cache, rows)
    lp, paged = append(prompts, chunk, paged, rows)
    np.testing.assert_allclose(np.asarray(lp)[:3], np.asarray(ls)[:3], atol=1e-5)
    step = jax.jit(lambda t, n, c, s: model.append(t, n, c, slots=s, kernels=kernels))
    decode_rows = jnp.asarray([2, 0, 1, 9])  # 9: a padding row
    for i in range(12):  # crosses page boundaries for every row
        tok = jnp.asarray([[4 + i], [5], [6 + i], [7]])
        ones = jnp.ones(4, jnp.int32)
        ls, slots_cache = step(tok, ones, slots_cache, decode_rows)
        lp, paged = step(tok, ones, paged, decode_rows)
        np.testing.assert_allclose(np.asarray(lp)[:3], np.asarray(ls)[:3], atol=2e-5)
    np.testing.assert_array_equal(np.asarray(paged.lengths), np.asarray(slots_cache.lengths))
    for s in range(3):
        n = int(slots_cache.lengths[s])
        np.testing.assert_allclose(
            _paged_keys(paged, s)[:, :, :n], np.asarray(slots_cache.k, np.float32)[:, s, :, :n], atol=1e-6
        )


@pytest.mark.parametrize("kernels", KERNELS)
def test_branches_sharing_prefix_pages_equal_forked_slots(kernels):
    """Two sequences share the full pages of a prefix and own a copy of its partial page."""
    model = init_model(CFG, seed=4)
    p, prefix = 8, 19  # two full pages shared, the third (3 tokens) copied on write
    slots_cache = init_cache(CFG, num_slots=3, max_len=32)
    paged = init_paged_cache(CFG, num_slots=3, max_len=32, num_pages=12, page_size=p)
    table = np.full((3, 4), 12, np.int32)
    table[0] = [5, 2, 9, 0]
    paged = dataclasses.replace(paged, page_table=jnp.asarray(table))
    prompt = jax.random.randint(jax.random.key(2), (1, 24), 1, 61)
    append = jax.jit(lambda t, n, c, s: model.append(t, n, c, slots=s))
    _, slots_cache = append(prompt, jnp.asarray([24]), slots_cache, jnp.asarray([0]))
    _, paged = append(prompt, jnp.asarray([24]), paged, jnp.asarray([0]))
    # Branches 1 and 2 start from the first 19 tokens of sequence 0.
    slots_cache = fork_slots(
        slots_cache, jnp.asarray([0, 0]), jnp.asarray([1, 2]), jnp.asarray([prefix, prefix])
    )
    table[1] = [5, 2, 7, 1]
    table[2] = [5, 2, 3, 4]
    paged = copy_pages(paged, jnp.asarray([9, 9]), jnp.asarray([7, 3]))
    paged = dataclasses.replace(
        paged, page_table=jnp.asarray(table), lengths=paged.lengths.at[jnp.asarray([1, 2])].set(prefix)
    )
    step = jax.jit(lambda t, n, c, s: model.append(t, n, c, slots=s, kernels=kernels))
    rows = jnp.asarray([0, 1, 2])
    for i in range(6):
        tok = jnp.asarray([[3], [10 + i], [20 + i]])
        ls, slots_cache = step(tok, jnp.ones(3, jnp.int32), slots_cache, rows)
        lp, paged = step(tok, jnp.ones(3, jnp.int32), paged, rows)
        np.testing.assert_allclose(np.asarray(lp), np.asarray(ls), atol=2e-5)
    # The shared pages were never written by a branch: sequence 0's prefix is intact.
    np.testing.assert_allclose(
        _paged_keys(paged, 0)[:, :, :30], np.asarray(slots_cache.k)[:, 0, :, :30], atol=1e-6
    )


def test_writes_without_a_page_are_dropped_and_reads_need_whole_pages():
    model = init_model(CFG, seed=5)
    paged = init_paged_cache(CFG, num_slots=2, max_len=16, num_pages=2, page_size=8)
    paged = dataclasses.replace(paged, page_table=jnp.asarray([[0, 2], [1, 2]], jnp.int32))
    _, out = model.append(jnp.ones((1, 12), jnp.int32), jnp.asarray([12]), paged, slots=jnp.asarray([0]))
    np.testing.assert_array_equal(np.asarray(out.k[:, :, 1]), 0.0)  # tokens 8..11 had no page
    assert np.any(np.asarray(out.k[:, :, 0]) != 0)
    with pytest.raises(ValueError, match="multiple of the page size"):
        paged.read(0, None, 12)
    with pytest.raises(ValueError, match="multiple of page_size"):
        init_paged_cache(CFG, num_slots=1, max_len=20, num_pages=4, page_size=8)
