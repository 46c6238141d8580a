"""Branching rules: where a round's N new branches of a tree start (config `tree.rule`).

Every rule keeps the tree's shape — N picks per tree per round, with replacement, among the
root and the non-leaf nodes, so G = M·(1 + N·L) — and only weighs the candidates:

  * `uniform` — the paper (Tree-GRPO): every candidate alike.
  * `entropy` — ARPO's signal at node granularity: a candidate weighs exp(H̄ / τ), H̄ the mean
    entropy of the policy over the first `rule_tokens` tokens it generated right after the node
    (its children's first tokens: after a search, that is the reaction to the tool result). The
    entropies are the sampler's own (`sampling.sample` records them with the log-probs), so
    the rule costs no forward pass. τ = `rule_temperature`; τ → ∞ is uniform.
  * `last` — the leaves' parents only: the steps where the policy chose to answer (or ran out
    of room). Why: the trees of this project's cold start fail by answering too early (0.9
    searches per question, 4-hop EM 1%, BENCHMARKS.md §1), and a uniform pick lands on the root
    — a fresh chain that shares nothing — for 1 candidate in (1 + searches on the chain), about
    half the picks; branching at the answer decision asks the question RL has to learn
    ("search again or answer?") with the whole evidence so far as the shared prefix.

A rule is `weights(tree, candidates, cfg) -> probabilities or None` (None: uniform, drawn
exactly as the paper's rule is). `register_rule` adds one; the pick itself (the seeded
generator, docs/DESIGN.md §1) stays in `search_state.RolloutContext.pick`, so every rule is
deterministic per rollout key, prompt, tree and round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from treegrpo_jax.rollout.tree import Node, Tree


@runtime_checkable  # the tests check signatures at run time (jaxtyping + beartype)
class RuleParams(Protocol):
    """What a rule reads from its config (`search_state.TreeSearchConfig` is one): the rule's
    fields only, so this module needs nothing from the search that calls it."""

    @property
    def rule(self) -> str: ...
    @property
    def rule_tokens(self) -> int: ...
    @property
    def rule_temperature(self) -> float: ...


Rule = Callable[[Tree, Sequence[Node], RuleParams], np.ndarray | None]

UNIFORM, ENTROPY, LAST = "uniform", "entropy", "last"


def _uniform(tree: Tree, candidates: Sequence[Node], cfg: RuleParams) -> None:
    del tree, candidates, cfg
    return None


def next_token_entropy(tree: Tree, node: Node, k: int) -> float:
    """Mean sampler entropy over the first `k` tokens generated after `node` (each child's first
    k; 0.0 when none were recorded, e.g. greedy or hand-built trees)."""
    values = [h for c in node.children for h in tree.nodes[c].entropies[:k]]
    return float(np.mean(values)) if values else 0.0


def _entropy(tree: Tree, candidates: Sequence[Node], cfg: RuleParams) -> np.ndarray:
    h = np.asarray([next_token_entropy(tree, n, cfg.rule_tokens) for n in candidates], np.float64)
    z = (h - h.max()) / cfg.rule_temperature
    w = np.exp(z)
    return w / w.sum()


def _last(tree: Tree, candidates: Sequence[Node], cfg: RuleParams) -> np.ndarray | None:
    del cfg
    w = np.asarray([any(tree.nodes[c].is_leaf for c in n.children) for n in candidates], np.float64)
    return w / w.sum() if w.sum() > 0 else None  # no leaf yet (cannot happen after a round): uniform


_RULES: dict[str, Rule] = {UNIFORM: _uniform, ENTROPY: _entropy, LAST: _last}


def register_rule(name: str, rule: Rule) -> None:
    """Adds a branching rule under `name` (then `tree.rule=name` selects it)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"register_rule: name must be a non-empty string, got {name!r}")
    if name in _RULES:
        raise ValueError(f"register_rule: {name!r} is taken; rules: {sorted(_RULES)}")
    _RULES[name] = rule


def rule_names() -> list[str]:
    return sorted(_RULES)


def check_rule(name: str) -> str:
    if name not in _RULES:
        raise ValueError(f"TreeSearchConfig.rule={name!r}; known rules: {rule_names()}")
    return name


def pick_weights(tree: Tree, candidates: Sequence[Node], cfg: RuleParams) -> np.ndarray | None:
    """The rule's probabilities over `candidates` (None: uniform); checked to be a distribution."""
    w = _RULES[check_rule(cfg.rule)](tree, candidates, cfg)
    if w is None:
        return None
    w = np.asarray(w, np.float64)
    if w.shape != (len(candidates),) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(
            f"branching rule {cfg.rule!r} returned {w!r} for {len(candidates)} candidates: "
            "want one finite, non-negative weight each, not all zero"
        )
    return w / w.sum()
