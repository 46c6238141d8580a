"""`rollout.py --parts=tree`: tree (2,2,1) vs chain 6 on one engine, token counts and wall."""

from __future__ import annotations

import jax
import numpy as np
from _policy import SHAPES, engine_for, load_policy

from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder


def run_tree(bc, model: Decoder, cfg: ModelConfig) -> dict:
    """Tree (2,2,1) vs chain with the same 6 leaves per prompt on the synthetic world.

    Policy: see `_policy.py`. Both runs use the same engine, prompts and limits;
    the tree prefills each prompt once and each observation once, and starts its branches by
    cache copy.
    """
    del model, cfg
    from treegrpo_jax.rollout.tree_search import rollout

    pol = load_policy(bc, bc.tree_prompts)
    env, agent, rows, shapes = pol.env, pol.agent, pol.rows, SHAPES
    out: dict = {"tree": {"prompts": len(rows), "policy": pol.name}}
    engines = {}
    for name, shape in shapes.items():
        engines[name] = engine_for(pol, len(rows))
        rollout(engines[name], env, rows, shape, agent, key=jax.random.key(bc.seed))  # compile
    walls: dict[str, list[float]] = {name: [] for name in shapes}
    stats = {}
    for r in range(bc.repeats):
        for name, shape in shapes.items():  # interleaved: load on the machine hits both alike
            key = jax.random.key(bc.seed + 1 + r)
            _, stats[name] = rollout(engines[name], env, rows, shape, agent, key=key)
            walls[name].append(stats[name].wall)
    for name in shapes:
        out["tree"][name] = stats[name].as_dict() | {
            "wall_median_s": float(np.median(walls[name])),
            "wall_per_leaf_s": float(np.median(walls[name])) / stats[name].leaves,
        }
    t, c = out["tree"]["tree"], out["tree"]["chain"]
    return {
        "tree_vs_chain_wall_per_leaf": t["wall_per_leaf_s"] / c["wall_per_leaf_s"],
        "tree_prefilled_tokens": t["prefilled_tokens"],
        "tree_reprefill_tokens": t["reprefill_tokens"],
        "tree_tool_calls": t["tool_calls"],
        "chain_tool_calls": c["tool_calls"],
        "chain_prefilled_tokens": c["prefilled_tokens"],
        "tree": out["tree"],
    }


def print_tree(result: dict) -> None:
    if "tree" not in result:
        return
    t, c = result["tree"]["tree"], result["tree"]["chain"]
    print(
        f"\nTree (2,2,1) vs chain (6,0,0), {result['tree']['prompts']} prompts, 6 leaves each "
        f"({result['tree']['policy']})"
    )
    print(
        f"{'':8} {'decoded':>9} {'prefilled':>10} {'re-prefill':>11} {'forked':>8} {'tool calls':>11} "
        f"{'wall/leaf ms':>13}"
    )
    for name, r in (("tree", t), ("chain", c)):
        print(
            f"{name:8} {r['decoded_tokens']:>9} {r['prefilled_tokens']:>10} {r['reprefill_tokens']:>11} "
            f"{r['forked_tokens']:>8} {r['tool_calls']:>11} {1000 * r['wall_per_leaf_s']:>13.1f}"
        )
    print(f"tree/chain wall per leaf: {result['tree_vs_chain_wall_per_leaf']:.2f}")
