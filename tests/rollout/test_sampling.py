"""The O(V) sampling kernel against the sort-based XLA reference (same tokens, same log-probs,
same entropies), and both against plain NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.native import Kernels, build
from treegrpo_jax.rollout.sampling import SamplingParams, _filtered_logits, first_argmax, sample

pytestmark = pytest.mark.skipif(not build.available(), reason="CPU kernels not built (no compiler)")


def _rows(seed: int, n: int, v: int) -> jax.Array:
    """Flat, peaked and heavily tied rows (quantised logits), some with a -1e9 tail."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    scale = jnp.asarray([0.2, 1.0, 4.0, 12.0])[jnp.arange(n) % 4][:, None]
    x = jax.random.normal(k1, (n, v)) * scale
    tied = jnp.round(x * 2) / 2
    x = jnp.where((jnp.arange(n) % 3 == 0)[:, None], tied, x)
    tail = jax.random.uniform(k2, (n, v)) < 0.1
    return jnp.where(tail & (jnp.arange(n) % 5 == 0)[:, None], -1e9, x)


def _knobs(n: int) -> SamplingParams:
    rng = np.random.default_rng(0)
    return SamplingParams.make(
        n,
        temperature=rng.choice([0.3, 0.7, 1.0, 1.7], n),
        top_p=rng.choice([1.0, 0.95, 0.9, 0.5, 0.1], n),
        top_k=rng.choice([0, 0, 1, 5, 50], n),
        greedy=rng.random(n) < 0.1,
    )


def _reference_margin(logits, keys, params) -> np.ndarray:
    """Distance of each row's scaled uniform to the nearest cumulative-mass boundary (reference)."""
    filtered = _filtered_logits(logits / params.temperature[:, None], params)
    cdf = jnp.cumsum(jax.nn.softmax(filtered, axis=-1), axis=-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, dtype=jnp.float32))(keys) * cdf[:, -1]
    return np.asarray(jnp.min(jnp.abs(cdf - u[:, None]), axis=-1))


@pytest.mark.parametrize("vocab", [7, 300, 4096])
def test_native_draws_the_reference_tokens(vocab):
    n, draws = 64, 40
    logits = _rows(vocab, n, vocab)
    params = _knobs(n)
    # Inputs as arguments, not constants: XLA would constant-fold the reference's sort (~30 s).
    ref = jax.jit(lambda x, k, p: sample(x, k, p, kernels=Kernels.XLA))
    nat = jax.jit(lambda x, k, p: sample(x, k, p, kernels=Kernels.NATIVE))
    mismatches = near_boundary = 0
    for d in range(draws):
        keys = jax.random.split(jax.random.key(100 + d), n)
        (t_ref, lp_ref, h_ref), (t_nat, lp_nat, h_nat) = ref(logits, keys, params), nat(logits, keys, params)
        np.testing.assert_allclose(np.asarray(h_nat), np.asarray(h_ref), atol=2e-5, rtol=1e-5)
        t_ref, t_nat = np.asarray(t_ref), np.asarray(t_nat)
        differ = t_ref != t_nat
        if differ.any():
            margin = _reference_margin(logits, keys, params)
            # A token may differ only where the uniform sits within float rounding of a boundary.
            assert np.all(margin[differ] < 1e-5), (np.flatnonzero(differ), margin[differ])
            mismatches += int(differ.sum())
        near_boundary += int((_reference_margin(logits, keys, params) < 1e-5).sum()) if d < 3 else 0
        same = ~differ
        np.testing.assert_allclose(np.asarray(lp_nat)[same], np.asarray(lp_ref)[same], atol=5e-6, rtol=1e-6)
    assert mismatches <= max(1, n * draws // 1000), mismatches


def test_greedy_rows_take_the_first_maximum():
    logits = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-2.0, -1.0, -3.0, -1.0]])
    params = SamplingParams.make(3, greedy=True)
    keys = jax.random.split(jax.random.key(0), 3)
    tokens, logp, _ = sample(logits, keys, params, kernels=Kernels.NATIVE)
    np.testing.assert_array_equal(np.asarray(tokens), [1, 0, 1])
    np.testing.assert_array_equal(np.asarray(first_argmax(logits)), np.argmax(np.asarray(logits), -1))
    want = jax.nn.log_softmax(logits, -1)[jnp.arange(3), tokens]
    np.testing.assert_allclose(np.asarray(logp), np.asarray(want), atol=1e-6)


@pytest.mark.parametrize("kernels", [Kernels.XLA, Kernels.NATIVE])
def test_entropy_is_that_of_the_tempered_unfiltered_distribution(kernels):
    """H = -Σ p log p of softmax(logits / T) in float64 NumPy, whatever top-k / top-p / greedy
    (the distribution the log-probs are recorded under); 0 for a one-hot row, log V for a flat one."""
    n, v = 32, 300
    logits = _rows(7, n, v)
    params = _knobs(n)
    keys = jax.random.split(jax.random.key(1), n)
    _, _, h = jax.jit(lambda x, k, p: sample(x, k, p, kernels=kernels))(logits, keys, params)
    x = np.asarray(logits, np.float64) / np.asarray(params.temperature, np.float64)[:, None]
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = -(np.exp(logp) * logp).sum(-1)
    np.testing.assert_allclose(np.asarray(h), want, atol=5e-5, rtol=1e-5)
    assert want.min() < 0.5 and want.max() > 4.0  # peaked and flat rows both present
    flat = jnp.zeros((2, v)).at[1, 0].set(1e9)  # a flat row, and a one-hot row
    _, _, h2 = sample(flat, keys[:2], SamplingParams.make(2), kernels=kernels)
    np.testing.assert_allclose(np.asarray(h2), [np.log(v), 0.0], atol=1e-5)


def _golden(row, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The filtered distribution, written out in plain Python (independent of `_filtered_logits`):
    keep the k best, then the smallest most-probable prefix whose mass reaches top_p."""
    scaled = [x / temperature for x in row]
    order = sorted(range(len(row)), key=lambda i: -scaled[i])
    z = sum(np.exp(x) for x in scaled)
    keep, mass = [], 0.0
    for rank, i in enumerate(order):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep.append(i)
        mass += np.exp(scaled[i]) / z
    w = np.zeros(len(row))
    for i in keep:
        w[i] = np.exp(scaled[i])
    return w / w.sum()


def test_the_golden_filter_by_hand():
    """softmax([2, 1, .5, 0, -1, -3]) = .561 .206 .125 .076 .028 .004: top-p 0.8 keeps 3 tokens
    (mass before the 4th is .892); at temperature 0.5 the best alone holds .829 ≥ 0.8."""
    row = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]
    assert np.flatnonzero(_golden(row, 1.0, 0, 0.8)).tolist() == [0, 1, 2]
    assert np.flatnonzero(_golden(row, 0.5, 0, 0.8)).tolist() == [0]
    assert np.flatnonzero(_golden(row, 1.0, 3, 1.0)).tolist() == [0, 1, 2]
    np.testing.assert_allclose(
        _golden(row, 1.0, 0, 0.8)[:3], np.array([0.561, 0.206, 0.125]) / 0.892, atol=2e-3
    )


@pytest.mark.parametrize("kernels", [Kernels.XLA, Kernels.NATIVE])
def test_sampling_matches_the_categorical_distribution(kernels):
    """Inverse-CDF sampling with top-k / top-p filters: frequencies follow the golden filtered
    softmax (vmapped over keys: the kernel takes the extra batch dimension as more rows)."""
    row = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]
    knobs = [(1.0, 0, 1.0), (0.5, 0, 0.8), (1.0, 3, 1.0), (1.0, 0, 0.8), (0.7, 4, 0.9)]
    logits = jnp.asarray([row] * len(knobs))
    t, k, p = (list(x) for x in zip(*knobs, strict=True))
    params = SamplingParams.make(len(knobs), temperature=t, top_k=k, top_p=p)
    n = 20000
    keys = jax.random.split(jax.random.key(0), n * len(knobs)).reshape(n, len(knobs))
    draw = jax.jit(jax.vmap(lambda k, x, p: sample(x, k, p, kernels=kernels), in_axes=(0, None, None)))
    tokens, _, _ = draw(keys, logits, params)
    for r, (temperature, top_k, top_p) in enumerate(knobs):
        freq = np.bincount(np.asarray(tokens[:, r]), minlength=6) / n
        want = _golden(row, temperature, top_k, top_p)
        np.testing.assert_allclose(freq, want, atol=0.015)
        assert np.all(freq[want == 0] == 0)  # never outside the filtered support


def test_making_params_for_a_new_row_count_compiles_nothing():
    """A rollout makes params for every row count its calls see: a transfer each, not a program
    (`jnp.asarray` of a NumPy array compiled a copy program per new shape, ~17 ms apiece)."""
    from treegrpo_jax.train.compile_clock import compile_count

    SamplingParams.make(2, temperature=0.7)
    before = compile_count()
    made = [SamplingParams.make(n, temperature=[0.0] * (n - 1) + [0.7], top_k=3) for n in range(3, 40)]
    assert compile_count() == before
    last = made[-1]
    assert last.temperature.shape == (39,) and bool(last.greedy[0]) and not bool(last.greedy[-1])
    assert float(last.temperature[0]) == 1.0 and int(last.top_k[5]) == 3  # temperature 0 → greedy
