"""Rollout trees: nodes are whole agent steps; the root is the prompt.

A node holds one model-generated span (reasoning + one action, `tokens`, with the
sampler's `logprobs`) and, when the environment answered (search results, or the
"invalid action" feedback), the observation tokens appended after it (`obs_tokens`).
A root-to-leaf path is therefore

    prompt_tokens + Σ_nodes (tokens + obs_tokens)

with the loss mask on `tokens` only. Token ids are exactly as sampled / tokenized:
history is never re-rendered from text.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator


class StepKind(enum.StrEnum):
    ROOT = "root"  # the prompt
    SEARCH = "search"
    ANSWER = "answer"
    INVALID = "invalid"  # no parsable action: feedback observation, the trajectory goes on
    TRUNCATED = "truncated"  # context cap, room ≤ min_step_room, or out of pages: a leaf, no answer


# Kinds that always end a trajectory. Others can too (`Node.is_leaf` is the test): a forced
# final-answer step that fails to answer stays INVALID, and a SEARCH / INVALID node whose
# observation does not fit the context keeps its kind.
LEAF_KINDS = frozenset({StepKind.ANSWER, StepKind.TRUNCATED})


@dataclasses.dataclass(kw_only=True)
class Node:
    """One agent step (or the root)."""

    node_id: int
    parent: int  # -1 for the root
    depth: int  # root 0
    kind: StepKind
    tokens: list[int] = dataclasses.field(default_factory=list)  # model-generated (loss mask 1)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # sampler log-probs of `tokens`
    entropies: list[float] = dataclasses.field(default_factory=list)  # sampler entropy at each token
    obs_tokens: list[int] = dataclasses.field(default_factory=list)  # environment (loss mask 0)
    text: str = ""  # decoded `tokens`, for parsing / display only
    query: str | None = None  # the search query, for SEARCH
    answer: str | None = None  # the answer text, for ANSWER
    tool_calls: int = 0  # searches on the path root→this node, this node included
    is_leaf: bool = False
    reward: float | None = None  # training reward, set on leaves
    em: float | None = None  # evaluation exact match of the leaf's answer
    children: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(kw_only=True)
class Tree:
    """One tree of one prompt. Node 0 is the root; `nodes[i].node_id == i`."""

    prompt_id: int
    tree_id: int
    prompt_tokens: list[int]
    nodes: list[Node]

    @property
    def root(self) -> Node:
        return self.nodes[0]

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if n.is_leaf]

    def expandable(self) -> list[Node]:
        """Root and all non-leaf nodes: where a new branch may start."""
        return [n for n in self.nodes if not n.is_leaf]

    def leaves_below(self) -> list[int]:
        """Per node id, the leaves of this tree in its subtree (the root: all of them)."""
        below = [0] * len(self.nodes)
        for node in sorted(self.nodes, key=lambda n: -n.depth):  # children before parents
            below[node.node_id] += int(node.is_leaf)
            if node.parent >= 0:
                below[node.parent] += below[node.node_id]
        return below

    def path(self, node_id: int) -> list[Node]:
        """Nodes from the root's first child down to `node_id` (the root itself excluded)."""
        out = []
        while node_id > 0:
            node = self.nodes[node_id]
            out.append(node)
            node_id = node.parent
        return out[::-1]

    def path_tokens(self, node_id: int) -> tuple[list[int], list[int], list[float]]:
        """(tokens, loss mask, sampler log-probs) of the root→node path; prompt included."""
        tokens, mask, logp = (
            list(self.prompt_tokens),
            [0] * len(self.prompt_tokens),
            [0.0] * len(self.prompt_tokens),
        )
        for node in self.path(node_id):
            tokens += node.tokens + node.obs_tokens
            mask += [1] * len(node.tokens) + [0] * len(node.obs_tokens)
            logp += list(node.logprobs) + [0.0] * len(node.obs_tokens)
        return tokens, mask, logp

    def leaf_paths(self) -> Iterator[tuple[Node, list[int], list[int], list[float]]]:
        for leaf in self.leaves():
            yield (leaf, *self.path_tokens(leaf.node_id))

    def unique_tokens(self) -> int:
        """Tokens stored once per tree (prompt + every node): what a prefix-sharing engine holds."""
        return len(self.prompt_tokens) + sum(len(n.tokens) + len(n.obs_tokens) for n in self.nodes)
