"""Engine: generation, fork + continue equal recomputing from scratch; sampling knobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.native import build
from treegrpo_jax.rollout import engine as engine_lib
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.generate import generate_ids
from treegrpo_jax.rollout.sampling import SamplingParams

from .reference import full_logits, greedy_reference

TINY = ModelConfig(
    vocab_size=89, embed_dim=32, mlp_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)


@pytest.fixture(scope="module")
def model():
    return init_model(TINY, seed=7)


def test_greedy_generation_equals_recompute(model):
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4]]
    out = generate_ids(model, prompts, max_new_tokens=10)
    for p, o in zip(prompts, out, strict=True):
        assert o == greedy_reference(model, p, 10)


def test_fork_then_continue_equals_recompute(model):
    """A tree: root prompt → chain → fork into 3 branches with different observations."""
    eng = Engine(model, num_slots=4, max_len=64)
    greedy = SamplingParams.make(3, greedy=True)
    greedy1 = SamplingParams.make(1, greedy=True)
    keys = jax.random.split(jax.random.key(0), 4)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    eng.append({0: prompt})
    first = eng.decode([0], max_new_tokens=5, sampling=greedy1, keys=keys[:1])
    node = prompt + first.tokens[0, :5].tolist()
    eng.fork([0, 0, 0], [1, 2, 3])
    observations = {
        1: [10, 11, 12],
        2: [20],
        3: [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47],
    }
    eng.append(observations)
    out = eng.decode([1, 2, 3], max_new_tokens=6, sampling=greedy, keys=keys[:3])
    for row, obs in enumerate(observations.values()):
        assert out.tokens[row, :6].tolist() == greedy_reference(model, node + obs, 6)
    # The source slot is unchanged by its children: continuing it matches too.
    out0 = eng.decode([0], max_new_tokens=4, sampling=greedy1, keys=keys[:1])
    assert out0.tokens[0, :4].tolist() == greedy_reference(model, node, 4)


def test_same_seed_same_samples_and_knobs_do_not_recompile(model):
    engine_lib._decode.clear_cache()

    def run(seed, temperature, top_p, top_k):
        eng = Engine(model, num_slots=3, max_len=48)
        eng.append({0: [1, 2], 1: [3, 4, 5], 2: [6]})
        sp = SamplingParams.make(3, temperature=temperature, top_p=top_p, top_k=top_k)
        keys = jax.random.split(jax.random.key(seed), 3)
        return eng.decode([0, 1, 2], max_new_tokens=16, sampling=sp, keys=keys)

    a, b = run(1, 1.0, 1.0, 0), run(1, 1.0, 1.0, 0)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    c = run(2, 1.0, 1.0, 0)
    assert not np.array_equal(a.tokens, c.tokens)
    run(1, [0.5, 1.0, 2.0], [0.9, 1.0, 0.5], [0, 5, 1])
    assert engine_lib._decode._cache_size() == 1


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    ref = generate_ids(model, [[7, 8, 9]], max_new_tokens=8)
    assert generate_ids(model, [[7, 8, 9]], max_new_tokens=8, temperature=1.0, top_k=1) == ref
    assert generate_ids(model, [[7, 8, 9]], max_new_tokens=8, temperature=1.0, top_p=1e-6) == ref


def test_logprobs_match_log_softmax(model):
    eng = Engine(model, num_slots=1, max_len=32)
    eng.append({0: [2, 3, 4]})
    sp = SamplingParams.make(1, temperature=0.7)
    out = eng.decode([0], max_new_tokens=5, sampling=sp, keys=jax.random.split(jax.random.key(3), 1))
    seq = [2, 3, 4] + out.tokens[0, :5].tolist()
    logp = jax.nn.log_softmax(full_logits(model, seq) / 0.7, axis=-1)
    want = [float(logp[2 + i, seq[3 + i]]) for i in range(5)]
    np.testing.assert_allclose(out.logprobs[0, :5], want, atol=1e-5)


def test_eos_and_context_limit_stop_rows(model):
    first = generate_ids(model, [[1, 2, 3]], max_new_tokens=6)[0]
    eos = first[2]  # pretend the 3rd greedy token is EOS
    got = generate_ids(model, [[1, 2, 3]], max_new_tokens=6, eos_ids=(eos,))[0]
    assert got == first[: first.index(eos) + 1]
    eng = Engine(model, num_slots=1, max_len=8)
    eng.append({0: [1, 2, 3]})
    out = eng.decode(
        [0],
        max_new_tokens=20,
        sampling=SamplingParams.make(1, greedy=True),
        keys=jax.random.split(jax.random.key(0), 1),
    )
    assert out.hit_context[0] and eng.lengths[0] + 1 == 8 and eng.room(0) == 0
    with pytest.raises(ValueError, match="exceed max_len"):
        eng.append({0: [5, 6]})


def test_fork_from_a_prefix_of_a_longer_sequence_equals_recompute(model):
    """Branching from an inner node: copy a descendant's slot, cut to the node's prefix."""
    eng = Engine(model, num_slots=3, max_len=64, min_rows=2)
    greedy1 = SamplingParams.make(1, greedy=True)
    key = jax.random.split(jax.random.key(0), 1)
    (a,) = eng.allocate(1)
    prompt = [5, 4, 3, 2, 1]
    eng.append({a: prompt})
    step1 = eng.decode([a], max_new_tokens=4, sampling=greedy1, keys=key).row(0)[0]
    eng.append({a: [40, 41]})  # an observation
    eng.decode([a], max_new_tokens=5, sampling=greedy1, keys=key)
    node = prompt + step1 + [40, 41]  # the inner node's full prefix, observation included
    b, c = eng.allocate(2)
    eng.fork([a, a], [b, c], prefix=[node, prompt + step1[:2]])
    eng.append({c: [77]})
    out = eng.decode(
        [b, c],
        max_new_tokens=6,
        sampling=SamplingParams.make(2, greedy=True),
        keys=jnp.concatenate([key, key]),
    )
    assert out.row(0)[0] == greedy_reference(model, node, 6)
    assert out.row(1)[0] == greedy_reference(model, prompt + step1[:2] + [77], 6)
    assert eng.stats.forked_tokens == len(node) + len(prompt) + 2


def test_a_fork_copies_the_live_span_only_and_equals_recompute(model):
    """A fork copies the source's live prefix in chunks of `FORK_CHUNK` positions, not the whole
    slot: the destination's old K/V past them (a longer, different sequence freed before) must
    never reach a later step. Also at the boundary: a prefix exactly one chunk long."""
    eng = Engine(model, num_slots=4, max_len=256, min_rows=2)
    greedy = SamplingParams.make(2, greedy=True)
    keys = jax.random.split(jax.random.key(0), 2)
    a, b, c, d = eng.allocate(4)
    rng = np.random.default_rng(3)
    short, boundary = [7, 6, 5, 4, 3, 2, 1, 9, 8, 7], rng.integers(1, TINY.vocab_size, 65).tolist()
    old = {s: rng.integers(1, TINY.vocab_size, 200).tolist() for s in (b, d)}  # 200 tokens each
    eng.append({a: short, c: boundary} | old)  # c holds 64 cache rows (its pending token is the 65th)
    eng.free([b, d])
    b, d = eng.allocate(2)
    assert {b, d} == set(old)  # the destinations are the slots holding the old sequences
    eng.fork([a, c], [b, d])
    out = eng.decode([b, d], max_new_tokens=6, sampling=greedy, keys=keys)
    assert out.row(0)[0] == greedy_reference(model, short, 6)
    assert out.row(1)[0] == greedy_reference(model, boundary, 6)


def test_a_fork_whose_pairs_overlap_is_refused(model):
    """Pairs are copied in turn, so a destination that is also a source (or twice a destination)
    would depend on the order: refused before anything changes."""
    eng = Engine(model, num_slots=4, max_len=32)
    a, b, c, _ = eng.allocate(4)
    eng.append({a: [1, 2, 3], b: [4, 5]})
    before = eng.lengths.copy()
    for src, dst in (([a, b], [b, c]), ([a, a], [c, c])):
        with pytest.raises(ValueError, match="destination twice or also a source"):
            eng.fork(src, dst)
    np.testing.assert_array_equal(eng.lengths, before)


def test_slots_allocate_free_and_reuse(model):
    eng = Engine(model, num_slots=2, max_len=32)
    s0, s1 = eng.allocate(2)
    with pytest.raises(engine_lib.OutOfSlotsError, match="asked for 1 slots, 0 of 2 free"):
        eng.allocate(1)
    eng.append({s0: [1, 2, 3, 4, 5, 6], s1: [9, 9]})
    eng.free([s0])
    (again,) = eng.allocate(1)
    assert again == s0
    eng.append({again: [7, 8]})  # a fresh sequence: the old one must not leak into it
    out = eng.decode(
        [again],
        max_new_tokens=5,
        sampling=SamplingParams.make(1, greedy=True),
        keys=jax.random.split(jax.random.key(0), 1),
    )
    assert out.row(0)[0] == greedy_reference(model, [7, 8], 5)


@pytest.mark.skipif(not build.available(), reason="CPU kernels not built (no compiler)")
@pytest.mark.parametrize(("greedy", "kv_dtype"), [(True, "float32"), (False, "float32"), (False, "bfloat16")])
def test_native_kernels_engine_equals_xla_engine(model, greedy, kv_dtype):
    """The same tree (prefill, decode, fork from a prefix, observation, decode) on both paths:
    identical tokens, log-probs to rounding; sampled rows use top-k and top-p."""
    runs = {}
    for kernels in ("xla", "native"):
        eng = Engine(model, num_slots=6, max_len=64, kernels=kernels, kv_dtype=kv_dtype)
        sp = SamplingParams.make(4, temperature=0.9, top_p=0.9, top_k=[0, 20, 5, 0], greedy=greedy)
        keys = jax.random.split(jax.random.key(5), 4)
        eng.append({0: [3, 1, 4, 1, 5], 1: [9, 2, 6, 5, 3, 5, 8, 9, 7]})
        a = eng.decode([0, 1], max_new_tokens=9, sampling=_rows(sp, 2), keys=keys[:2])
        seq0 = [3, 1, 4, 1, 5] + a.row(0)[0]
        eng.fork([0, 0, 1], [2, 3, 4], prefix=[seq0[:7], seq0, [9, 2, 6, 5, 3, 5, 8, 9, 7]])
        eng.append({2: [11, 12], 3: [13]})
        b = eng.decode([2, 3, 4, 1], max_new_tokens=12, sampling=sp, keys=keys)
        runs[kernels] = (a, b)
    for x, n in zip(runs["xla"], runs["native"], strict=True):
        np.testing.assert_array_equal(n.tokens, x.tokens)
        np.testing.assert_array_equal(n.num_tokens, x.num_tokens)
        np.testing.assert_allclose(n.logprobs, x.logprobs, atol=2e-5)


def _rows(sp: SamplingParams, n: int) -> SamplingParams:
    return jax.tree.map(lambda x: x[:n], sp)


def test_bf16_kv_cache_is_close_to_f32_and_a_bad_dtype_is_refused(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = {}
    for kv in ("float32", "bfloat16"):
        eng = Engine(model, num_slots=1, max_len=48, kv_dtype=kv)
        eng.append({0: prompt})
        out[kv] = eng.decode(
            [0],
            max_new_tokens=12,
            sampling=SamplingParams.make(1, greedy=True),
            keys=jax.random.split(jax.random.key(0), 1),
        )
    assert eng.cache.k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out["bfloat16"].tokens, out["float32"].tokens)
    np.testing.assert_allclose(out["bfloat16"].logprobs, out["float32"].logprobs, atol=2e-2)
    with pytest.raises(ValueError, match="kv_dtype='float16'; allowed: float32, bfloat16"):
        Engine(model, num_slots=1, max_len=8, kv_dtype="float16")


def test_host_arrays_reach_the_device_without_a_compile():
    """What the engine sends per call (rows, token counts, page tables) is a transfer."""
    from treegrpo_jax.rollout.engine import _device, _pad_rows
    from treegrpo_jax.train.compile_clock import compile_count

    _device(np.zeros(1, np.int64), np.int32)
    before = compile_count()
    for n in range(2, 30):
        x = _device(np.arange(n, dtype=np.int64), np.int32)
        y = _pad_rows(np.arange(n, dtype=np.float32), 3)
        got = np.asarray(y)  # (indexing the device array would compile a gather per shape)
        assert x.dtype == np.int32 and got.shape == (n + 3,) and got[-1] == 0.0 and got[n - 1] == n - 1
    assert compile_count() == before


@pytest.mark.parametrize("kernels", ["xla", "native"])
@pytest.mark.parametrize("whole_pool", [False, True], ids=["some-slots", "whole-pool"])
def test_shrinking_rows_inside_a_call_changes_nothing_but_the_cost(model, kernels, whole_pool):
    """Rows with budgets from 1 to 24, an EOS token, sampled: with `shrink_to=8` a 32-row call
    goes on at 24, 16, 12 and then 8 rows as rows end; every row's tokens, log-probs, entropies, endings,
    the engine's lengths and its next call are what the call without shrinking gives."""
    if kernels == "native" and not build.available():
        pytest.skip("CPU kernels not built")
    assert engine_lib._phase_widths(32, 8) == [32, 24, 16, 12, 8]
    assert engine_lib._phase_widths(48, 8) == [48, 32, 24, 16, 12, 8]
    assert engine_lib._phase_widths(12, 8) == [12, 8] and engine_lib._phase_widths(8, 8) == [8]
    assert engine_lib._phase_widths(32, 0) == [32] and engine_lib._phase_widths(6, 1) == [6, 4, 3, 2, 1]
    # Wider than 64 rows: halving, as each phase costs a compile of the step.
    assert engine_lib._phase_widths(96, 8) == [96, 48, 24, 12]
    assert engine_lib._phase_widths(128, 8) == [128, 64, 32, 16, 8]
    rng = np.random.default_rng(3)
    rows = 32
    slots = list(range(rows)) if whole_pool else list(range(1, 2 * rows, 2))
    budgets = rng.integers(1, 25, rows).tolist()
    prompts = {s: rng.integers(1, TINY.vocab_size, rng.integers(2, 12)).tolist() for s in slots}
    sampling = SamplingParams.make(rows, temperature=0.9)
    keys = jax.random.split(jax.random.key(5), rows)
    results = []
    for shrink_to in (0, 8):
        eng = Engine(model, num_slots=rows if whole_pool else 2 * rows, max_len=64, kernels=kernels,
                     eos_ids=(7,), shrink_to=shrink_to)  # fmt: skip
        eng.append(prompts)
        first = eng.decode(slots, max_new_tokens=budgets, sampling=sampling, keys=keys, num_steps=32)
        second = eng.decode(slots, max_new_tokens=3, sampling=sampling, keys=keys, num_steps=4)
        results.append((first, second, eng.lengths.copy(), eng.stats))
    (a1, a2, la, sa), (b1, b2, lb, sb) = results
    # What was computed: every row at full width without shrinking, fewer row-steps with it.
    assert sa.row_steps == rows * (a1.steps + a2.steps) and sb.row_steps < sa.row_steps
    assert a1.num_tokens.tolist() == budgets or a1.hit_eos.any()  # rows ended at many moments
    assert len(set(a1.num_tokens.tolist())) > 8
    # The CPU kernel: bit for bit. XLA:CPU blocks the sampler's vocabulary sums by the batch's
    # width, so a float may move by an ulp there (seen: one entropy in 1,024 by 4.8e-7); tokens and
    # endings never do (the scheduler tests take the same tolerance for the same reason).
    atol = 0.0 if kernels == "native" else 2e-6
    for a, b in ((a1, b1), (a2, b2)):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=atol)
        np.testing.assert_allclose(a.entropies, b.entropies, rtol=0, atol=atol)
        for f in ("num_tokens", "hit_eos", "hit_stop", "hit_context"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    np.testing.assert_array_equal(la, lb)


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_a_bad_shrink_to_names_itself(model, bad):
    # (a float is a TypeError from the tests' shape checker before the engine's own ValueError)
    with pytest.raises((ValueError, TypeError), match="shrink_to"):
        Engine(model, num_slots=2, max_len=16, shrink_to=bad)


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_released_pool_is_made_again_and_decodes_as_before(model, layout):
    """`release_kv` between rollouts frees the pool; the next calls see an empty pool again, and
    a slot still holding a sequence keeps the pool where it is."""
    eng = Engine(model, num_slots=4, max_len=64, kv_layout=layout, page_size=8)
    greedy = SamplingParams.make(2, greedy=True)
    keys = jax.random.split(jax.random.key(0), 2)

    def rollout():
        slots = eng.allocate(2)
        eng.append({slots[0]: [3, 1, 4, 1, 5], slots[1]: [9, 2, 6]})
        branch = eng.allocate(1)
        eng.fork([slots[0]], branch)
        out = eng.decode(slots, max_new_tokens=6, sampling=greedy, keys=keys).tokens[:, :6].tolist()
        eng.free(slots + branch)
        return out

    first = rollout()
    assert first[0] == greedy_reference(model, [3, 1, 4, 1, 5], 6)
    held = eng.allocate(1)
    eng.append({held[0]: [7, 7]})
    eng.release_kv()  # a slot holds a sequence: nothing is freed
    assert eng._cache is not None
    eng.free(held)
    old = jax.tree.leaves(eng.cache)
    eng.release_kv()
    assert eng._cache is None and all(x.is_deleted() for x in old)
    assert rollout() == first  # the pool is made again on first use
    assert eng._cache is not None
