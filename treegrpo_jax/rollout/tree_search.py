"""Tree-search rollouts: `rollout` grows M·(1+N·L)-leaf trees for a batch of questions.

The search itself (initialize-then-expand, keys, picks) is in `search_state.py`; the two
drivers that run it on the engine are `scheduler.py` (continuous batching, the default)
and `lockstep.py` (the reference). Both grow the same trees for the same key.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax

from treegrpo_jax.data.rows import QARow
from treegrpo_jax.rollout.agent import AgentConfig, AgentEnv
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.lockstep import rollout_lockstep
from treegrpo_jax.rollout.scheduler import Driver, RolloutCancelled, Scheduler, SchedulerConfig
from treegrpo_jax.rollout.search_state import (
    RolloutContext,
    RolloutStats,
    TreeSearchConfig,
    check_pool,
    prompt_tokens,
)
from treegrpo_jax.rollout.tree import Node, Tree

__all__ = [
    "RolloutCancelled",
    "RolloutStats",
    "SchedulerConfig",
    "TreeSearchConfig",
    "prompt_tokens",
    "rollout",
]


def rollout(
    engine: Engine,
    env: AgentEnv,
    rows: Sequence[QARow],
    search: TreeSearchConfig,
    agent: AgentConfig,
    *,
    key: jax.Array,
    prompt_uids: Sequence[int] | None = None,
    greedy: bool = False,
    scheduler: SchedulerConfig | None = None,
    should_stop: Callable[[], bool] | None = None,
    progress: Callable[[list[Node]], None] | None = None,
) -> tuple[list[Tree], RolloutStats]:
    """Grows M·(1+N·L)-leaf trees for every row; returns trees (prompt-major) and costs.

    Args:
      engine: the engine (its free slots bound how many prompts run at once).
      env: tokenizer, retriever and prompt texts.
      rows: the questions.
      search: the tree shape.
      agent: per-trajectory limits and sampling.
      key: the rollout key (fold in the step before calling).
      prompt_uids: stable ids for the rows (default 0..P-1); tree.prompt_id is the row index.
      greedy: greedy decoding (evaluation).
      scheduler: the driver and its knobs (default: continuous batching).
      should_stop: polled between decode calls; when it returns True the rollout raises
        `RolloutCancelled` within one call (SIGTERM handling).
      progress: called between engine calls with the leaves finished so far (of
        `len(rows) · search.leaves_per_prompt`), each scored (`reward`, `em`).
    """
    t_start = time.perf_counter()
    check_pool(engine, search)
    scheduler = scheduler or SchedulerConfig()
    uids = list(range(len(rows))) if prompt_uids is None else list(prompt_uids)
    ctx = RolloutContext(
        engine=engine, env=env, search=search, agent=agent, key=key, greedy=greedy, progress=progress
    )
    before = engine.reset_stats()
    try:
        if scheduler.driver is Driver.LOCKSTEP:
            trees = rollout_lockstep(ctx, rows, uids, should_stop=should_stop)
        else:
            driver = Scheduler(ctx, rows, uids, scheduler, should_stop=should_stop)
            trees = driver.run()
        es = engine.reset_stats()
    finally:
        engine.stats = before
    stats = RolloutStats(prompts=len(rows), times=ctx.times)
    stats.fill(trees, es, ctx.counters, engine.num_slots, engine.kv_bytes_per_token)
    if scheduler.driver is Driver.CONTINUOUS:
        stats.preempted_prompts, stats.page_truncated = driver.preempted, driver.page_truncated
    stats.wall = time.perf_counter() - t_start
    return trees, stats
