"""The paged engine against the slot engine it replaces: same tokens, less memory, clear errors."""

import jax
import numpy as np
import pytest

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.native import build
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.page_pool import OutOfPagesError, PagePool
from treegrpo_jax.rollout.sampling import SamplingParams

CFG = ModelConfig(
    vocab_size=61, embed_dim=48, mlp_dim=64, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8
)
KERNELS = ["xla"] + (["native"] if build.available() else [])


def _keys(seed, n):
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), n)))


def _check_pool(pool: PagePool):
    """Every reference is a table entry, and free + referenced pages are the whole pool."""
    counted = np.zeros(pool.num_pages, np.int64)
    for s in range(pool.table.shape[0]):
        h = int(pool.held[s])
        assert np.all(pool.table[s, h:] == pool.num_pages)
        np.add.at(counted, pool.table[s, :h], 1)
    np.testing.assert_array_equal(counted, pool.refs)
    assert pool.num_free == int(np.sum(pool.refs == 0))


def _script(engine, rng):
    """Prefill, decode, fork from inside pages and at ends, free, reuse: the tree workload."""
    out = []
    a = engine.allocate(3)
    engine.append({a[0]: list(rng.integers(1, 61, 21)), a[1]: list(rng.integers(1, 61, 5)), a[2]: [7]})
    for rnd in range(4):
        live = list(a)
        res = engine.decode(
            live, max_new_tokens=[9, 13, 6], sampling=SamplingParams.make(3), keys=_keys(rnd, 3)
        )
        out += [res.tokens, res.logprobs]
        src = [a[0], a[1], a[0]]
        seqs = [engine.lengths[s] + 1 for s in src]
        cut = [max(1, int(n) - 3 * (i + 1)) for i, n in enumerate(seqs)]  # prefixes inside pages
        b = engine.allocate(3)
        engine.fork(src, b, [list(range(c)) for c in cut])
        engine.append({b[1]: list(rng.integers(1, 61, 4)), a[2]: list(rng.integers(1, 61, 3))})
        res = engine.decode(
            b + [a[2]], max_new_tokens=7, sampling=SamplingParams.make(4), keys=_keys(10 + rnd, 4)
        )
        out += [res.tokens, res.logprobs]
        engine.free([b[0], b[2]])
        engine.free([a[0]])
        a = [b[1], a[1], a[2]]
        if engine.pool:
            _check_pool(engine.pool)
    return out


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("page_size", [1, 8, 32])
def test_paged_engine_equals_slot_engine(kernels, page_size):
    model = init_model(CFG, seed=3)
    slots = Engine(model, num_slots=12, max_len=64, kernels=kernels)
    paged = Engine(model, num_slots=12, max_len=64, kernels=kernels, kv_layout="paged", page_size=page_size)
    want = _script(slots, np.random.default_rng(0))
    got = _script(paged, np.random.default_rng(0))
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)
    held = paged.peek_stats().kv_peak_tokens
    assert held < slots.peek_stats().kv_peak_tokens  # pages hold live tokens, slots all of max_len
    paged.free([s for s in range(12) if paged.pending[s] >= 0])
    assert paged.free_pages == paged.pool.num_pages
    _check_pool(paged.pool)


def test_paged_engine_with_the_pallas_kernel_equals_slot_engine():
    """The Pallas decode path (interpreted here) inside the engine's decode loop."""
    model = init_model(CFG, seed=3)
    slots = Engine(model, num_slots=12, max_len=64, kernels="xla")
    paged = Engine(model, num_slots=12, max_len=64, kernels="pallas", kv_layout="paged", page_size=16)
    want = _script(slots, np.random.default_rng(1))
    got = _script(paged, np.random.default_rng(1))
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)


def test_out_of_pages_changes_nothing_and_says_so():
    model = init_model(CFG, seed=4)
    engine = Engine(model, num_slots=4, max_len=32, kv_layout="paged", page_size=8, num_pages=4)
    a = engine.allocate(2)
    engine.append({a[0]: list(range(1, 17))})  # 15 written: 2 pages
    with pytest.raises(OutOfPagesError, match="need 3 pages, 2 of 4 free"):
        engine.append({a[1]: list(range(1, 23))})
    assert engine.pending[a[1]] == -1 and engine.free_pages == 2
    engine.append({a[1]: [1, 2, 3]})  # 2 written: 1 page
    assert engine.decode_pages_needed([a[0]], 32, 20) == 2  # up to 35 → 32 positions: 4 pages, 2 held
    with pytest.raises(OutOfPagesError, match="need 2 pages, 1 of 4 free"):
        engine.decode([a[0]], max_new_tokens=20, sampling=SamplingParams.make(1), keys=_keys(0, 1))
    assert engine.lengths[a[0]] == 15 and engine.free_pages == 1
    res = engine.decode([a[0]], max_new_tokens=8, sampling=SamplingParams.make(1), keys=_keys(0, 1))
    assert res.num_tokens[0] == 8 and engine.free_pages == 0  # 23 written + pending: 3 pages
    c = engine.allocate(1)
    with pytest.raises(OutOfPagesError, match="fork needs 1 pages, 0 of 4 free"):
        engine.fork([a[0]], c, [list(range(18))])
    engine.free([a[1]])
    engine.fork([a[0]], c, [list(range(18))])  # 17 tokens: 2 pages shared, 1 copied
    assert engine.free_pages == 0 and engine.pool.copied == 1
    engine.free([a[0]])
    assert engine.free_pages == 1  # the shared pages stay with the branch
    _check_pool(engine.pool)


def test_bad_layout_arguments_are_refused():
    model = init_model(CFG, seed=5)
    with pytest.raises(ValueError, match="kv_layout='pages'; allowed"):
        Engine(model, num_slots=1, max_len=8, kv_layout="pages")
    with pytest.raises(ValueError, match="power of two"):
        Engine(model, num_slots=1, max_len=8, kv_layout="paged", page_size=24)


def test_slot_engine_with_the_pallas_kernel_equals_xla():
    """The GPU default (`kernels=auto` there): the Pallas decode kernel over slots (interpreted here)."""
    model = init_model(CFG, seed=3)
    want = _script(Engine(model, num_slots=12, max_len=64, kernels="xla"), np.random.default_rng(2))
    got = _script(Engine(model, num_slots=12, max_len=64, kernels="pallas"), np.random.default_rng(2))
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)
