"""Why a step learns or not: how much of it carries a non-zero advantage.

Legend: G leaves of the step, N nodes.

A group z-score is 0 for every member of a group whose rewards are all equal, so in a sparse
regime (few correct leaves) most of a chain-GRPO step can carry no gradient at all; Tree-GRPO's
claim is that its tree and prompt groups leave less of a step silent. These metrics, logged at
every RL step under `mechanism/`, measure that directly from the step's trees, with the run's own
estimator and shared-prefix credit (the same `advantages.compute` the jitted loss calls):

  * `leaves_nonzero`  share of leaves whose advantage A_ℓ is non-zero;
  * `tokens_nonzero`  share of model tokens (each of a tree's tokens once) whose advantage is
    non-zero — a node's advantage is c(n)·Σ A_ℓ over the n leaves below it (`token_weights`:
    the sum the clipped loss sees at ratio 1), and every model token of the node carries it;
  * `equal_tree_groups` / `equal_prompt_groups`  among the groups of ≥ 2 leaves, the share whose
    rewards are all equal: tree groups (leaves of one tree: the intra term) and prompt groups
    (leaves of one prompt: the inter term, and chain GRPO's only group). One-leaf groups are
    left out: the reference gives them A = r, not 0 (`advantages`);
  * `abs_adv_depth{d}`  mean |node advantage| over nodes at depth d = 1 … DEPTHS (1 = the first
    agent step; the last key pools every deeper node); 0 where the step has no such node.

"Non-zero" means |A| > ZERO: z-scores of distinct rewards are far larger (rewards differ by
≥ 0.1 and a group's std is ≤ 0.5), and all-equal groups give exactly 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treegrpo_jax.rl import advantages
from treegrpo_jax.rl.token_weights import Credit, credit_scale
from treegrpo_jax.rollout.tree import Tree

ZERO = 1e-6  # |A| at or below this counts as no signal
DEPTHS = 6  # abs_adv_depth1 … abs_adv_depth6 (6: that depth and deeper)
PREFIX = "mechanism/"


def _equal_share(rewards: np.ndarray, keys: list[tuple]) -> float:
    """Among the groups (rows with the same key) of ≥ 2 rows, the share whose rewards are all equal."""
    groups: dict[tuple, list[float]] = {}
    for key, r in zip(keys, rewards, strict=True):
        groups.setdefault(key, []).append(float(r))
    sized = [g for g in groups.values() if len(g) > 1]
    return float(np.mean([max(g) == min(g) for g in sized])) if sized else 0.0


def mechanism_metrics(
    trees: Sequence[Tree], estimator: str | advantages.Estimator, credit: str | Credit = Credit.SUM
) -> dict[str, float]:
    """The step's mechanism metrics (module docstring), keyed `mechanism/<name>`.

    Args:
      trees: the step's trees; every leaf has its reward.
      estimator: the run's advantage estimator (`rl.estimator`).
      credit: the run's shared-prefix credit rule (`rl.credit`).

    Returns:
      Always the same keys (a multi-process run reduces them as a collective).
    """
    credit = Credit(credit)
    leaf_ref = [(t, leaf) for t in trees for leaf in t.leaves()]  # `rows_from_trees` order
    if not leaf_ref:
        raise ValueError("mechanism_metrics needs at least one leaf")
    reward = np.asarray([leaf.reward for _, leaf in leaf_ref], np.float32)
    prompt = np.asarray([t.prompt_id for t, _ in leaf_ref], np.int32)
    tree_id = np.asarray([t.tree_id for t, _ in leaf_ref], np.int32)
    adv = advantages.compute(reward, tree_id, prompt, np.ones(len(reward), bool), estimator)  # [G]

    tokens = tokens_nonzero = 0
    depth_sum, depth_count = np.zeros(DEPTHS), np.zeros(DEPTHS)
    g = 0
    for tree in trees:
        node_adv = np.zeros(len(tree.nodes))  # Σ A over the leaves below each node
        for leaf in tree.leaves():
            for node in tree.path(leaf.node_id):
                node_adv[node.node_id] += adv[g]
            g += 1
        below = np.asarray(tree.leaves_below(), np.float32)
        node_adv *= np.asarray(credit_scale(below, credit))
        for node in tree.nodes[1:]:  # the root holds the prompt: never trained
            tokens += len(node.tokens)
            tokens_nonzero += len(node.tokens) * int(abs(node_adv[node.node_id]) > ZERO)
            d = min(node.depth, DEPTHS) - 1
            depth_sum[d] += abs(node_adv[node.node_id])
            depth_count[d] += 1
    out = {
        "leaves_nonzero": float(np.mean(np.abs(adv) > ZERO)),
        "tokens_nonzero": tokens_nonzero / max(tokens, 1),
        "equal_tree_groups": _equal_share(reward, list(zip(prompt.tolist(), tree_id.tolist(), strict=True))),
        "equal_prompt_groups": _equal_share(reward, [(p,) for p in prompt.tolist()]),
    }
    for d in range(DEPTHS):
        out[f"abs_adv_depth{d + 1}"] = float(depth_sum[d] / depth_count[d]) if depth_count[d] else 0.0
    return {PREFIX + k: v for k, v in out.items()}
