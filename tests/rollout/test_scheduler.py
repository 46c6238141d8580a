"""The continuous-batching scheduler grows exactly the lock-step reference's trees.

Two policies: a Markov-chain agent (sampled searches, answers, invalid steps, EOS, stop
strings split into byte tokens so they straddle decode calls) for the control flow, and
a random transformer for the numerics (attention and the sampler over batches of
different shapes). Trees are compared field by field: tokens, log-probs, node ids,
parents, children, observations, rewards.
"""

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from treegrpo_jax.env.actions import STOP_SEQUENCES
from treegrpo_jax.env.observation import ObservationConfig
from treegrpo_jax.env.retrieval import RetrieverUnavailableError, SearchResult
from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.native import Kernels
from treegrpo_jax.rollout import stops
from treegrpo_jax.rollout.agent import AgentConfig
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.page_pool import OutOfPagesError
from treegrpo_jax.rollout.sampling import SamplingParams
from treegrpo_jax.rollout.scheduler import Driver
from treegrpo_jax.rollout.tree_search import RolloutCancelled, SchedulerConfig, TreeSearchConfig, rollout
from treegrpo_jax.testing.bigram import bigram_config, bigram_model, set_transitions
from treegrpo_jax.testing.markov_agent import agent_chain

AGENT = AgentConfig(max_tool_calls=2, max_turns=4, max_step_tokens=12, top_k=2, temperature=1.0, top_p=1.0)
LOCKSTEP = SchedulerConfig(driver=Driver.LOCKSTEP)
STOPS = STOP_SEQUENCES


@pytest.fixture(scope="module")
def env(world_env):
    # Shorter observations than test_tree_search's, so more steps run into the context cap.
    return dataclasses.replace(world_env, observation=ObservationConfig(passage_tokens=16, max_tokens=40))


@pytest.fixture(scope="module")
def markov(env):
    tok = env.tokenizer
    model = bigram_model(bigram_config(tok.vocab_size, max_len=512, eos_ids=tok.eos_ids), {}, default=0)
    set_transitions(model, *agent_chain(tok, seed=0)[:1], default=agent_chain(tok, seed=0)[1])
    return model


@pytest.fixture(scope="module")
def transformer(env):
    dims = dict(embed_dim=32, mlp_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    return init_model(ModelConfig(vocab_size=env.tokenizer.vocab_size, **dims), seed=0)


def _engine(model, env, slots, *, max_len=512, kernels=Kernels.AUTO, **paged):
    table = stops.make_stop_table(stops.token_bytes(env.tokenizer), STOPS, model.cfg.vocab_size)
    return Engine(
        model,
        num_slots=slots,
        max_len=max_len,
        eos_ids=env.tokenizer.eos_ids,
        stop_table=table,
        min_rows=4,
        kernels=kernels,
        **paged,
    )


def _run(model, env, rows, search, agent, scheduler, *, slots, key=0, greedy=False, **kw):
    eng = _engine(model, env, slots, **kw)
    trees, stats = rollout(
        eng, env, rows, search, agent, key=jax.random.key(key), greedy=greedy, scheduler=scheduler
    )
    assert eng.num_free == eng.num_slots  # every slot handed back
    if eng.paged:
        assert eng.free_pages == eng.pool.num_pages  # and every page
    return [dataclasses.asdict(t) for t in trees], stats


_SAME_STATS = (
    "leaves",
    "decoded_tokens",
    "prefilled_tokens",
    "forked_tokens",
    "reprefill_tokens",
    "tool_calls",
    "invalid_steps",
    "truncated_leaves",
    "retrieval_errors",
    "capped_steps",
)


def _assert_same(ref, ours, logp_atol=0.0):
    (ref_trees, ref_stats), (our_trees, our_stats) = ref, ours
    assert len(our_trees) == len(ref_trees)
    for r, o in zip(ref_trees, our_trees, strict=True):
        if not logp_atol:
            assert o == r
            continue
        floats = ("logprobs", "entropies")

        def strip(t, floats=floats):
            return [{k: v for k, v in n.items() if k not in floats} for n in t["nodes"]]

        assert strip(o) == strip(r)
        for a, b in zip(o["nodes"], r["nodes"], strict=True):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=logp_atol)
            # An entropy sums V terms of the same logits: its rounding scales with its size (~log V).
            np.testing.assert_allclose(a["entropies"], b["entropies"], rtol=logp_atol, atol=logp_atol)
    for k in _SAME_STATS:
        assert getattr(our_stats, k) == getattr(ref_stats, k), k


@pytest.mark.parametrize(
    "shape,slots", [((2, 2, 1), 12), ((1, 2, 2), 5), ((3, 0, 0), 7), ((2, 1, 2), 30)], ids=str
)
@pytest.mark.parametrize("quantum,exit_fraction", [(1, 1.0), (4, 0.25), (16, 0.5)], ids=str)
def test_scheduler_trees_equal_lockstep_markov_agent(
    markov, env, world, shape, slots, quantum, exit_fraction
):
    """Sampled steps of every kind; pools smaller than the prompts (continuous admission)."""
    search = TreeSearchConfig(num_trees=shape[0], num_picks=shape[1], num_rounds=shape[2])
    rows = list(world.train[:5])
    cfg = SchedulerConfig(quantum=quantum, exit_fraction=exit_fraction, admit_prompts=2)
    ref = _run(markov, env, rows, search, AGENT, LOCKSTEP, slots=slots, key=7)
    ours = _run(markov, env, rows, search, AGENT, cfg, slots=slots, key=7)
    _assert_same(ref, ours)
    st = ref[1]
    # The trees exercised what they claim: searches, feedback, answers, several nodes per tree.
    assert st.tool_calls > 0 and st.invalid_steps > 0 and st.capped_steps > 0
    kinds = {n["kind"] for t in ref[0] for n in t["nodes"]}
    assert {"search", "answer", "invalid"} <= kinds


@pytest.mark.parametrize("sync", [0.0, 1.0], ids=["never-wait", "wait"])
def test_waiting_for_searches_in_flight_grows_the_same_trees(markov, env, world, sync):
    """`retrieval_sync` only moves a walk into an earlier call: the trees are the lock-step loop's.
    (1.0: the in-process retriever lands within any call's time, so the wait is taken.)"""
    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
    rows = list(world.train[:5])
    cfg = SchedulerConfig(quantum=4, retrieval_sync=sync, admit_prompts=2)
    ref = _run(markov, env, rows, search, AGENT, LOCKSTEP, slots=30, key=11)
    _assert_same(ref, _run(markov, env, rows, search, AGENT, cfg, slots=30, key=11))
    assert ref[1].tool_calls > 0


@pytest.mark.parametrize("rule", ["entropy", "last"])
def test_branching_rules_grow_the_same_trees_in_both_drivers(markov, env, world, rule):
    """A weighted rule reads the trees' recorded entropies / leaves: the scheduler, which finishes
    steps in another order, still picks what the lock-step loop picks (two rounds)."""
    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=2, rule=rule, rule_temperature=0.3)
    rows = list(world.train[:4])
    ref = _run(markov, env, rows, search, AGENT, LOCKSTEP, slots=20, key=3)
    ours = _run(
        markov, env, rows, search, AGENT, SchedulerConfig(quantum=4, exit_fraction=0.5), slots=20, key=3
    )
    _assert_same(ref, ours)
    uniform = _run(
        markov, env, rows, dataclasses.replace(search, rule="uniform"), AGENT, LOCKSTEP, slots=20, key=3
    )
    assert uniform[0] != ref[0]  # the rule changed where branches start


@pytest.mark.parametrize("kernels", [Kernels.NATIVE, Kernels.XLA])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_scheduler_trees_equal_lockstep_transformer(transformer, env, world, kernels, greedy):
    """Attention and sampling over batches of other shapes give identical tokens and log-probs.

    A row's sampling stream folds in only its own key and write position, so the tokens are
    the same whenever the row's logits are. What can differ is float rounding: a prefill
    (`append`) attends the power-of-two bucket of its batch's *longest* row (and on the XLA
    path so does decode), so the span changes with the batch; the padded keys add exact
    zeros, but XLA:CPU blocks the reduction by span. Measured here: greedy trees bit-equal on
    both paths; sampled log-probs within 4.8e-7 (native) / 9.5e-7 (XLA), tokens equal — a
    draw flips only if its uniform lands within ~1e-6 of a CDF boundary (none in this
    test's ~900 draws; about one in 10⁶ draws in general).
    """
    if kernels is Kernels.NATIVE and not _native_ok():
        pytest.skip("native kernels did not build here")
    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
    rows = list(world.train[:4])
    cfg = SchedulerConfig(quantum=4, exit_fraction=0.25, admit_prompts=1)
    kw = dict(slots=15, key=3, greedy=greedy, kernels=kernels, max_len=1024)
    ref = _run(transformer, env, rows, search, AGENT, LOCKSTEP, **kw)
    ours = _run(transformer, env, rows, search, AGENT, cfg, **kw)
    _assert_same(ref, ours, logp_atol=0.0 if greedy else 2e-6)
    assert ref[1].decoded_tokens > 500


# Counted per prompt and dropped with a preempted prompt, so they match the reference exactly;
# token counters include the preempted prompts' reruns.
_COUNTER_STATS = tuple(k for k in _SAME_STATS if not k.endswith("ed_tokens"))


@pytest.mark.parametrize(
    "pages,page_size,shape",
    [(4096, 16, (2, 2, 1)), (160, 16, (2, 2, 1)), (80, 32, (1, 2, 2)), (3000, 1, (3, 0, 0))],
    ids=str,
)
def test_paged_scheduler_trees_equal_lockstep_slots(markov, env, world, pages, page_size, shape):
    """Pools from roomy to a few prompts' worth: walks wait for pages, the youngest prompt is
    preempted and rerun, and the trees are still the lock-step reference's."""
    search = TreeSearchConfig(num_trees=shape[0], num_picks=shape[1], num_rounds=shape[2])
    rows = list(world.train[:6])
    ref = _run(markov, env, rows, search, AGENT, LOCKSTEP, slots=30, key=5)
    cfg = SchedulerConfig(quantum=4, exit_fraction=0.5, admit_prompts=1)
    ours = _run(
        markov,
        env,
        rows,
        search,
        AGENT,
        cfg,
        slots=60,
        key=5,
        kv_layout="paged",
        page_size=page_size,
        num_pages=pages,
    )
    assert ours[0] == ref[0]
    for k in _COUNTER_STATS:
        assert getattr(ours[1], k) == getattr(ref[1], k), k
    st = ours[1]
    if pages * page_size < 4000:  # the small pools (~2 prompts' trees) made prompts wait and rerun
        assert st.preempted_prompts > 0
        assert st.kv_peak_tokens <= pages * page_size
    else:
        assert st.preempted_prompts == 0 and st.decoded_tokens == ref[1].decoded_tokens
    # Slots hold max_len per sequence; pages hold what the trees hold (plus partial pages).
    assert st.kv_peak_over_unique < ref[1].kv_peak_over_unique
    assert st.page_truncated == 0


@pytest.mark.parametrize("driver", ["lockstep", "continuous", "continuous_preempting"])
def test_progress_reports_each_leaf_once_and_ends_at_all_of_them(markov, env, world, driver):
    """`rollout(progress=...)` (the run's leaf bars): never more than the total, lowered only when
    a preempted prompt's leaves are dropped (to be rerun), and it ends with every leaf, scored as
    the returned trees are."""
    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
    rows = list(world.train[:6])
    paged = dict(kv_layout="paged", page_size=16, num_pages=160) if driver == "continuous_preempting" else {}
    cfg = LOCKSTEP if driver == "lockstep" else SchedulerConfig(quantum=4, exit_fraction=0.5)
    eng = _engine(markov, env, 12 if driver == "lockstep" else 60, **paged)
    seen = []
    trees, st = rollout(
        eng,
        env,
        rows,
        search,
        AGENT,
        key=jax.random.key(5),
        scheduler=cfg,
        progress=lambda leaves: seen.append(leaves),
    )
    total = len(rows) * search.leaves_per_prompt
    counts = [len(leaves) for leaves in seen]
    assert counts[-1] == total and max(counts) == total
    assert len(set(counts)) > 2  # reported as leaves finished, not only at the end
    if driver == "continuous_preempting":
        assert st.preempted_prompts > 0  # reruns happened; their dropped leaves may lower a count
    else:
        assert counts == sorted(counts)
    final = sorted((leaf.reward, leaf.em) for leaf in seen[-1])
    assert final == sorted((leaf.reward, leaf.em) for t in trees for leaf in t.leaves())


@pytest.mark.parametrize("kernels", [Kernels.NATIVE, Kernels.XLA])
def test_paged_scheduler_transformer_equals_lockstep_slots(transformer, env, world, kernels):
    if kernels is Kernels.NATIVE and not _native_ok():
        pytest.skip("native kernels did not build here")
    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
    rows = list(world.train[:4])
    kw = dict(key=3, greedy=True, kernels=kernels, max_len=1024)
    ref = _run(transformer, env, rows, search, AGENT, LOCKSTEP, slots=15, **kw)
    cfg = SchedulerConfig(quantum=4, exit_fraction=0.25)
    ours = _run(transformer, env, rows, search, AGENT, cfg, slots=30, kv_layout="paged", page_size=16, **kw)
    _assert_same(ref, ours, logp_atol=2e-6)
    assert ref[1].decoded_tokens > 500
    assert ours[1].cow_pages > 0  # forks from inside a page copied it


def test_a_prompt_larger_than_the_pool_is_truncated_or_refused_not_hung(markov, env, world):
    """One prompt's chains outgrow the pool: they end as truncated leaves. A prompt whose prefill
    alone does not fit is refused with the numbers. Either way every page and slot comes back."""
    eng = _engine(markov, env, 20, kv_layout="paged", page_size=16, num_pages=34)  # the prompt: 27 pages
    chains = TreeSearchConfig(num_trees=3, num_picks=0, num_rounds=0)
    trees, st = rollout(eng, env, world.train[:1], chains, AGENT, key=jax.random.key(2))
    assert st.page_truncated > 0 and st.truncated_leaves >= st.page_truncated
    assert len(trees) == 3 and all(len(t.leaves()) == 1 for t in trees)
    assert eng.free_pages == 34 and eng.num_free == 20
    small = _engine(markov, env, 20, kv_layout="paged", page_size=16, num_pages=14)
    with pytest.raises(OutOfPagesError, match="needs 29 pages for 3 trees but the pool has 14"):
        rollout(small, env, world.train[:1], chains, AGENT, key=jax.random.key(2))
    assert small.free_pages == 14 and small.num_free == 20


def _native_ok() -> bool:
    from treegrpo_jax.native import build

    return build.available()


class _SlowFlaky:
    """BM25 behind a delay, failing every third query (deterministically, by its text)."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s, self.calls = inner, delay_s, 0
        self.threads: set[str] = set()

    def search(self, queries, k):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        results = self.inner.search(queries, k)
        return [
            SearchResult(error="timed out") if sum(q.encode()) % 3 == 0 else r
            for q, r in zip(queries, results, strict=True)
        ]


def test_slow_failing_retriever_same_trees_and_runs_beside_decoding(markov, env, world):
    slow = dataclasses.replace(env, retriever=_SlowFlaky(env.retriever, 0.02))
    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
    rows = list(world.train[:4])
    ref = _run(markov, slow, rows, search, AGENT, LOCKSTEP, slots=24, key=1)
    ours = _run(markov, slow, rows, search, AGENT, SchedulerConfig(quantum=4), slots=24, key=1)
    _assert_same(ref, ours)
    assert ref[1].retrieval_errors > 0
    assert any(name.startswith("retrieval") for name in slow.retriever.threads)  # the worker thread


class _Down:
    def search(self, queries, k):
        raise RetrieverUnavailableError("the server has been unreachable for 61 s")


def test_retriever_outage_reaches_the_caller_and_frees_the_pool(markov, env, world):
    down = dataclasses.replace(env, retriever=_Down())
    eng = _engine(markov, env, 12)
    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
    with pytest.raises(RetrieverUnavailableError, match="unreachable"):
        rollout(eng, down, world.train[:2], search, AGENT, key=jax.random.key(0))
    assert eng.num_free == eng.num_slots


def test_should_stop_cancels_within_one_quantum(markov, env, world):
    eng = _engine(markov, env, 12)
    calls = []

    def stop():
        calls.append(eng.stats.decode_calls)
        return len(calls) > 3

    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
    with pytest.raises(RolloutCancelled):
        rollout(eng, env, world.train[:2], search, AGENT, key=jax.random.key(0), should_stop=stop)
    assert calls[-1] <= 3  # no decode call after the request
    assert eng.num_free == eng.num_slots


def test_rollout_key_changes_the_picks(markov, env, world):
    """Greedy steps are the same for every key, so different trees can only come from the picks."""
    search = TreeSearchConfig(num_trees=1, num_picks=3, num_rounds=1)
    picked = set()
    for key in range(6):
        trees, _ = _run(
            markov, env, list(world.train[:1]), search, AGENT, None, slots=4, key=key, greedy=True
        )
        nodes = trees[0]["nodes"]
        chain = [n for n in nodes[1:] if not n["is_leaf"]]
        assert chain  # the root and at least one inner node to pick from
        # Nodes after the first chain start branches: their parents are the picks.
        first_leaf = next(n["node_id"] for n in nodes if n["is_leaf"])
        picked.add(tuple(sorted(n["parent"] for n in nodes[first_leaf + 1 :] if n["parent"] <= first_leaf)))
    assert len(picked) > 1


def test_a_step_split_into_quanta_is_the_same_step(markov, env):
    """Tokens, log-probs and the stop flag of one call equal those of 1-, 3- and 5-step calls."""
    tok = env.tokenizer
    prompt = tok.encode("Who founded the city?")
    keys = jax.random.split(jax.random.key(4), 16)
    sampling = SamplingParams.make(16, temperature=1.0, top_p=1.0)
    outcomes = {}
    for q in (None, 1, 3, 5):
        eng = _engine(markov, env, 16)
        eng.append({s: prompt for s in range(16)})
        toks = {s: [] for s in range(16)}
        logp = {s: [] for s in range(16)}
        live, ended = list(range(16)), {}
        while live:
            res = eng.decode(
                live,
                max_new_tokens=[12 - len(toks[s]) for s in live],
                sampling=SamplingParams.make(len(live), temperature=1.0, top_p=1.0),
                keys=keys[np.asarray(live)],
                num_steps=q,
            )
            nxt = []
            for i, s in enumerate(live):
                t, lp, _ = res.row(i)
                toks[s] += t
                logp[s] += lp
                if res.hit_eos[i] or res.hit_stop[i] or len(toks[s]) >= 12:
                    ended[s] = (bool(res.hit_eos[i]), bool(res.hit_stop[i]))
                else:
                    nxt.append(s)
            live = nxt
        outcomes[q] = (toks, logp, ended)
    del sampling
    for q in (1, 3, 5):
        assert outcomes[q] == outcomes[None], q
    assert any(stop for _, stop in outcomes[None][2].values())


def test_scheduler_config_errors_name_the_field():
    for kw, field in [
        (dict(quantum=12), "quantum"),
        (dict(exit_fraction=0), "exit_fraction"),
        (dict(admit_prompts=0), "admit_prompts"),
        (dict(driver="async"), "driver"),
        (dict(retrieval_sync=1.5), "retrieval_sync"),
        (dict(retrieval_sync=True), "retrieval_sync"),
    ]:
        with pytest.raises(ValueError, match=field):
            SchedulerConfig(**kw)


@pytest.mark.parametrize("hostility", [0.2, 0.6])
def test_hostile_streams_through_the_scheduler_stay_bounded(env, world, hostility):
    """Property check (the resilience benchmark runs 10⁴ of these): tag soup, random tokens,
    byte-split stops and EOS anywhere, sampled — no crash, every leaf there, every bound kept."""
    from treegrpo_jax.testing.hostile import _bounds

    tok = env.tokenizer
    model = bigram_model(bigram_config(tok.vocab_size, max_len=512, eos_ids=tok.eos_ids), {}, default=0)
    transitions, default = agent_chain(tok, hostile=hostility, seed=3)
    set_transitions(model, transitions, default=default)
    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
    agent = dataclasses.replace(AGENT, max_step_tokens=40)
    rows = list(world.train[:6])
    trees, stats = _run(model, env, rows, search, agent, SchedulerConfig(quantum=4), slots=36, key=11)
    steps = sum(len(t["nodes"]) - 1 for t in trees)
    assert steps > 40  # ~50 steps of every kind per rollout
    assert stats.leaves == len(rows) * search.leaves_per_prompt
    eng = _engine(model, env, 36)
    real, _ = rollout(
        eng, env, rows, search, agent, key=jax.random.key(11), scheduler=SchedulerConfig(quantum=4)
    )
    assert _bounds(real, agent, env, len(rows) * search.leaves_per_prompt) == []
