"""A picture of a rollout tree: nodes labelled with their action, leaves coloured by reward.

Training trees also carry each leaf's advantage (`advantages`, node id → A) and mark the nodes
a branch was forked from (more than one child: the expansion picks) with a thick blue border.

Layout is the classic tidy one: leaves take consecutive x slots in depth-first order and
every inner node sits above the middle of its children; depth goes down the y axis.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

from treegrpo_jax.rollout.tree import StepKind, Tree  # noqa: E402


def _label(node, advantage: float | None = None) -> str:
    if node.kind == StepKind.ROOT:
        return "prompt"
    if node.kind == StepKind.SEARCH:
        return "search:\n" + textwrap.shorten(node.query or "", 28, placeholder="…")
    scored = node.is_leaf and node.reward is not None
    score = (f"\nr={node.reward:.1f}" if scored else "") + (
        f" A={advantage:+.2f}" if advantage is not None else ""
    )
    if node.kind == StepKind.ANSWER:
        return "answer:\n" + textwrap.shorten(node.answer or "", 24, placeholder="…") + score
    return node.kind.value + score


def _positions(tree: Tree) -> dict[int, tuple[float, float]]:
    pos: dict[int, tuple[float, float]] = {}
    next_x = [0.0]

    def place(node_id: int) -> float:
        node = tree.nodes[node_id]
        if not node.children:
            x = next_x[0]
            next_x[0] += 1.0
        else:
            xs = [place(c) for c in node.children]
            x = (min(xs) + max(xs)) / 2
        pos[node_id] = (x, -float(node.depth))
        return x

    place(0)
    return pos


def render_tree(tree: Tree, path: str, *, title: str | None = None) -> None:
    """Writes a PNG or SVG (by `path`'s suffix) of one tree."""
    render_trees([tree], path, titles=[title] if title else None)


def render_trees(
    trees: Sequence[Tree],
    path: str,
    *,
    titles: Sequence[str] | None = None,
    advantages: Sequence[Mapping[int, float]] | None = None,
) -> None:
    """Writes the trees side by side into one PNG or SVG (e.g. the M trees of a prompt);
    `advantages[i]` labels tree i's leaves (node id → advantage)."""
    widths = [max(1, sum(1 for n in t.nodes if not n.children)) for t in trees]
    depth = max(max(n.depth for n in t.nodes) for t in trees)
    fig, axes = plt.subplots(
        1,
        len(trees),
        figsize=(max(4.0, 1.9 * sum(widths)), 1.5 * (depth + 1) + 0.8),
        squeeze=False,
        gridspec_kw={"width_ratios": widths},
    )
    cmap = plt.get_cmap("RdYlGn")
    for i, (ax, tree) in enumerate(zip(axes[0], trees, strict=True)):
        pos = _positions(tree)
        for node in tree.nodes[1:]:
            (x0, y0), (x1, y1) = pos[node.parent], pos[node.node_id]
            ax.plot([x0, x1], [y0, y1], color="0.6", lw=1, zorder=1)
        for node in tree.nodes:
            x, y = pos[node.node_id]
            scored = node.is_leaf and node.reward is not None
            face = cmap(node.reward) if scored else "white"
            ink = "white" if scored and abs(node.reward - 0.5) > 0.3 else "black"  # readable on dark ends
            picked = len(node.children) > 1  # a branch was forked here
            advantage = advantages[i].get(node.node_id) if advantages else None
            ax.text(
                x,
                y,
                _label(node, advantage),
                ha="center",
                va="center",
                fontsize=7,
                zorder=2,
                color=ink,
                bbox={
                    "boxstyle": "round,pad=0.3",
                    "fc": face,
                    "ec": "tab:blue" if picked else "0.3",
                    "lw": 2.5 if picked else 1.0,
                },
            )
        ax.set_xlim(-0.7, widths[i] - 0.3)
        ax.set_ylim(-depth - 0.6, 0.6)
        ax.axis("off")
        ax.set_title(titles[i] if titles else f"prompt {tree.prompt_id} · tree {tree.tree_id}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
