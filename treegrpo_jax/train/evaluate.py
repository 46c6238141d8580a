"""Greedy evaluation: one chain per question, pure EM per data source."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import jax
import numpy as np

from treegrpo_jax.data.rows import QARow
from treegrpo_jax.rollout.agent import AgentConfig, AgentEnv
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.tree import Tree
from treegrpo_jax.rollout.tree_search import SchedulerConfig, TreeSearchConfig, rollout

CHAIN = TreeSearchConfig(num_trees=1, num_picks=0, num_rounds=0)


def leaf_metrics(trees: Sequence[Tree], prefix: str) -> dict[str, float]:
    """Means over all leaves: reward, EM, tool calls and generated tokens per trajectory."""
    rewards, ems, calls, lengths = [], [], [], []
    for tree in trees:
        for leaf in tree.leaves():
            rewards.append(leaf.reward)
            ems.append(leaf.em)
            calls.append(leaf.tool_calls)
            lengths.append(sum(len(n.tokens) for n in tree.path(leaf.node_id)))
    return {
        f"{prefix}/reward_mean": float(np.mean(rewards)),
        f"{prefix}/em_mean": float(np.mean(ems)),
        f"{prefix}/tool_calls_mean": float(np.mean(calls)),
        f"{prefix}/response_tokens_mean": float(np.mean(lengths)),
    }


def evaluate(
    engine: Engine,
    env: AgentEnv,
    rows: Sequence[QARow],
    agent: AgentConfig,
    *,
    seed: int = 0,
    scheduler: SchedulerConfig | None = None,
    should_stop=None,
    progress=None,
) -> tuple[dict[str, float], list[Tree]]:
    """EM overall and per `data_source`, tool calls per question and response length.

    `progress` is `rollout`'s (the questions answered so far, scored: e.g. `progress.LeafBar`)."""
    trees, stats = rollout(
        engine,
        env,
        rows,
        CHAIN,
        agent,
        key=jax.random.key(seed),
        greedy=True,
        scheduler=scheduler,
        should_stop=should_stop,
        progress=progress,
    )
    metrics = leaf_metrics(trees, "eval")
    metrics["eval/em"] = metrics.pop("eval/em_mean")
    for source, (em_sum, count) in sorted(em_by_source(rows, trees).items()):
        metrics[f"eval/em/{source}"] = em_sum / count
    metrics["eval/wall_s"] = stats.wall
    return metrics, trees


def em_by_source(rows: Sequence[QARow], trees: Sequence[Tree]) -> dict[str, tuple[float, int]]:
    """(EM sum, questions) per `data_source`: sums, so hosts holding different row counts combine
    exactly (`multihost.evaluate_sharded`). One chain per question: its leaf's EM."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for row, tree in zip(rows, trees, strict=True):
        out[row.data_source][0] += tree.leaves()[0].em
        out[row.data_source][1] += 1
    return {source: (em_sum, int(n)) for source, (em_sum, n) in out.items()}


def format_table(metrics: dict[str, float]) -> str:
    """A plain-text table of EM per data source."""
    lines = [f"{'data source':<24} {'EM':>7}", "-" * 32]
    for key, value in sorted(metrics.items()):
        if key.startswith("eval/em/"):
            lines.append(f"{key[len('eval/em/') :]:<24} {100 * value:>6.1f}")
    lines.append(f"{'all':<24} {100 * metrics['eval/em']:>6.1f}")
    lines.append(
        f"tool calls / question {metrics['eval/tool_calls_mean']:.2f}; "
        f"response tokens {metrics['eval/response_tokens_mean']:.0f}"
    )
    return "\n".join(lines)
