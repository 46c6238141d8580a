"""The lock-step driver: the reference the scheduler is tested against.

Prompts run in waves of as many as the pool holds; in each wave, every tree's first
chain runs, then each expansion round's branches of all trees. Running a set of walks
repeats, until all reached a leaf: one `Engine.decode` over every live walk until each
row's step ends; `end_step` for each; one retriever call for all searches; one
`Engine.append` of every observation. Simple and exact, but every decode call runs until
its longest row stops, retrieval blocks the loop, and a round waits for every tree of
the wave (`benchmarks/rollout.py --parts=scheduler` measures what that costs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from treegrpo_jax.data.rows import QARow
from treegrpo_jax.rollout.agent import (
    StepEnd,
    StepOutput,
    Trajectory,
    end_step,
    observation_text,
    place_observation,
    step_budget,
)
from treegrpo_jax.rollout.sampling import SamplingParams
from treegrpo_jax.rollout.search_state import (
    RolloutCancelled,
    RolloutContext,
    TreeState,
    fork_branches,
    record_holder,
    start_trees,
)
from treegrpo_jax.rollout.tree import Tree


def advance(
    ctx: RolloutContext, trajs: list[Trajectory], should_stop: Callable[[], bool] | None = None
) -> None:
    """Runs `trajs` until every one reaches a leaf; grows their trees in place.

    Slots are not freed: a finished trajectory's slot still holds its whole sequence, so
    later expansion rounds can fork from any node on its path.
    """
    engine, env, cfg, times, counters = ctx.engine, ctx.env, ctx.agent, ctx.times, ctx.counters
    active = list(trajs)
    while active:
        if should_stop is not None and should_stop():
            raise RolloutCancelled("rollout stopped on request (SIGTERM)")
        t0 = time.perf_counter()
        slots = [t.slot for t in active]
        budgets = [step_budget(cfg, 0, engine.room(s)) for s in slots]
        sampling = SamplingParams.make(
            len(active),
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k_sampling,
            greedy=ctx.greedy,
        )
        keys = np.stack([t.key for t in active])  # raw key words: one host array
        counters.reprefill_tokens += int(sum(engine.lengths[s] + 1 for s in slots))
        res = engine.decode(slots, max_new_tokens=budgets, sampling=sampling, keys=keys)
        t1 = time.perf_counter()
        times.decode += t1 - t0

        searches, feedback = [], []
        for i, traj in enumerate(active):
            step = StepOutput(*res.row(i), **res.ending(i))
            node, end = end_step(traj, step, room=engine.room(traj.slot), env=env, cfg=cfg, counters=counters)
            if end is StepEnd.SEARCH:
                searches.append((traj, node))
            elif end is StepEnd.FEEDBACK:
                feedback.append((traj, node))
        t2 = time.perf_counter()
        times.host += t2 - t1

        results = env.retriever.search([n.query for _, n in searches], cfg.top_k) if searches else []
        t3 = time.perf_counter()
        times.retrieval += t3 - t2

        writes: dict[int, list[int]] = {}
        active = []
        for (traj, node), result in [*zip(searches, results, strict=True), *((f, None) for f in feedback)]:
            obs = env.encode_obs(observation_text(env, cfg, node, result, counters))
            if place_observation(traj, node, obs, engine.room(traj.slot), env, cfg, counters):
                writes[traj.slot] = obs
                active.append(traj)
        # Keep the walks in their original order (searches and feedback were split above).
        order = {id(t): i for i, t in enumerate(trajs)}
        active.sort(key=lambda t: order[id(t)])
        t4 = time.perf_counter()
        engine.append(writes)
        times.host += t4 - t3
        times.append += time.perf_counter() - t4


def rollout_lockstep(
    ctx: RolloutContext,
    rows: Sequence[QARow],
    uids: Sequence[int],
    *,
    should_stop: Callable[[], bool] | None = None,
) -> list[Tree]:
    """Grows every row's trees wave by wave (prompt-major, then tree id)."""
    g = ctx.search.leaves_per_prompt
    wave = max(1, ctx.engine.num_free // g)
    trees: list[Tree] = []
    for start in range(0, len(rows), wave):
        idx = list(range(start, min(start + wave, len(rows))))
        trees += _wave(ctx, [rows[i] for i in idx], idx, [uids[i] for i in idx], should_stop, trees)
    return trees


def _wave(ctx: RolloutContext, rows, row_ids, uids, should_stop, done: list[Tree]) -> list[Tree]:
    engine, times = ctx.engine, ctx.times
    t0 = time.perf_counter()
    states, trajs, used = start_trees(ctx, rows, row_ids, uids)
    times.append += time.perf_counter() - t0
    try:
        _advance_and_record(ctx, states, trajs, should_stop)
        ctx.report([*done, *(s.tree for s in states)])
        for round_idx in range(ctx.search.expansion_rounds):
            t0 = time.perf_counter()
            picks = [(state, ctx.pick(state, round_idx)) for state in states]
            slots = engine.allocate(sum(len(p) for _, p in picks))
            used += slots
            branch_trajs = fork_branches(ctx, picks, slots)
            times.fork += time.perf_counter() - t0
            _advance_and_record(ctx, states, branch_trajs, should_stop)
            ctx.report([*done, *(s.tree for s in states)])
    finally:
        engine.free(used)
    return [s.tree for s in states]


def _advance_and_record(
    ctx: RolloutContext, states: list[TreeState], trajs: list[Trajectory], should_stop
) -> None:
    """Runs the walks to their leaves and records which slot holds each new node."""
    by_tree = {id(s.tree): s for s in states}
    advance(ctx, trajs, should_stop)
    for traj in trajs:
        record_holder(by_tree[id(traj.tree)], traj)
