"""Branching rules, shared-prefix credit and the budgets at ≥ 30 updates on the harder world (issue 20).

The machinery is `budget_sweep.py`'s (one shared cold start, resumable runs, a record per run);
this file holds the catalogue and the report. Every run trains from ONE cold start of
`configs/multihop.py:tiny,hard` (5-hop questions, namesake distractor passages) for `--steps`
RL steps of `--prompts_per_step` prompts (2 optimizer updates each); only the rollout shape,
the branching rule (`tree.rule`), the credit rule (`rl.credit`), the estimator and the seed
change.

    python benchmarks/rules_sweep.py --out=DIR [--seeds=3] [--steps=30] [--runs=...] [--report_only]

Outputs: `OUT/results.json` (per run: config and how to reproduce it, final EM overall and by
hop count, tool calls per question, reward curve, decoded / prefilled tokens, root picks, wall
time), `OUT/summary.md` (mean ± sd over seeds; the comparisons with the sd of their difference)
and `OUT/em_vs_cost.png`.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import budget_sweep  # noqa: E402  (the sweep machinery; it puts this checkout on sys.path)

# name -> (config variant on top of `tiny,hard`, label)
RULE_RUNS: dict[str, tuple[str, str]] = {
    "chain_4": ("tree_m=4,tree_n=0,tree_l=0,estimator=grpo", "4 (GRPO)"),
    "chain_16": ("tree_m=16,tree_n=0,tree_l=0,estimator=grpo", "16 (GRPO)"),
    "tree_2_2_1": ("tree_m=2,tree_n=2,tree_l=1", "≈4, uniform, sum"),
    "tree_2_2_1_entropy": ("tree_m=2,tree_n=2,tree_l=1,rule=entropy", "≈4, entropy"),
    "tree_2_2_1_last": ("tree_m=2,tree_n=2,tree_l=1,rule=last", "≈4, last"),
    "tree_2_2_1_mean": ("tree_m=2,tree_n=2,tree_l=1,credit=mean", "≈4, credit mean"),
    "tree_2_2_1_sqrt": ("tree_m=2,tree_n=2,tree_l=1,credit=sqrt", "≈4, credit sqrt"),
    "tree_4_2_1": ("tree_m=4,tree_n=2,tree_l=1", "≈8, uniform"),
    "tree_4_2_1_entropy": ("tree_m=4,tree_n=2,tree_l=1,rule=entropy", "≈8, entropy"),
    "tree_4_2_1_last": ("tree_m=4,tree_n=2,tree_l=1,rule=last", "≈8, last"),
}
# (question, a, b): is a better than b beyond noise?
COMPARISONS = (
    ("tree (2,2,1) at ≈4 vs chain GRPO at 16", "tree_2_2_1", "chain_16"),
    ("tree (2,2,1) at ≈4 vs chain GRPO at 4", "tree_2_2_1", "chain_4"),
    ("tree (4,2,1) at ≈8 vs chain GRPO at 16", "tree_4_2_1", "chain_16"),
    ("chain GRPO at 16 vs at 4", "chain_16", "chain_4"),
    ("(2,2,1): entropy vs uniform picks", "tree_2_2_1_entropy", "tree_2_2_1"),
    ("(2,2,1): last vs uniform picks", "tree_2_2_1_last", "tree_2_2_1"),
    ("(4,2,1): entropy vs uniform picks", "tree_4_2_1_entropy", "tree_4_2_1"),
    ("(4,2,1): last vs uniform picks", "tree_4_2_1_last", "tree_4_2_1"),
    ("(2,2,1): credit mean vs sum", "tree_2_2_1_mean", "tree_2_2_1"),
    ("(2,2,1): credit sqrt vs sum", "tree_2_2_1_sqrt", "tree_2_2_1"),
)
RULE_GROUPS = (
    ("branching rule at (2,2,1)", ("tree_2_2_1", "tree_2_2_1_entropy", "tree_2_2_1_last")),
    ("branching rule at (4,2,1)", ("tree_4_2_1", "tree_4_2_1_entropy", "tree_4_2_1_last")),
    ("credit rule at (2,2,1)", ("tree_2_2_1", "tree_2_2_1_mean", "tree_2_2_1_sqrt")),
)
BASE = "tiny,hard"


def _by_name(records: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)
    return by


def multihop_em(r: dict) -> float:
    """Mean EM over the multi-hop question kinds (2 hops and more), as the paper's multi-hop column."""
    return statistics.mean(v or 0.0 for h, v in r["em_by_hops"].items() if int(h) > 1)


def difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """mean(a) − mean(b) and the sd of that difference (independent seeds: √(s_a²/n_a + s_b²/n_b))."""
    var = lambda xs: statistics.variance(xs) if len(xs) > 1 else 0.0  # noqa: E731
    return statistics.mean(a) - statistics.mean(b), (var(a) / len(a) + var(b) / len(b)) ** 0.5


def _pm(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.mean(xs):.1f} ± {100 * sd:.1f}"


def summarize(records: list[dict], sc: budget_sweep.SweepConfig, hop_counts: tuple[int, ...]) -> str:
    by = _by_name(records)
    start = budget_sweep._cold_start_eval(sc)
    hop_cols = " | ".join(f"{h}-hop" for h in hop_counts)
    lines = [
        f"World `{sc.base}`; {sc.steps} RL steps × {sc.prompts_per_step} prompts (2 updates each) from one "
        f"cold start; greedy EM on {sc.eval_prompts} test questions; mean ± sd over seeds.",
        "",
        f"| run | rollout | seeds | EM | multi-hop | {hop_cols} | tool calls / q | root picks "
        "| decoded tokens | wall (s) |",
        "|---|---|---|---|---|" + "---|" * len(hop_counts) + "---|---|---|---|",
    ]
    if start:
        hop = " | ".join(f"{100 * start.get(f'eval/em/synthetic_{h}hop', 0.0):.1f}" for h in hop_counts)
        multi = statistics.mean(start.get(f"eval/em/synthetic_{h}hop", 0.0) for h in hop_counts[1:])
        lines.append(
            f"| cold start | – | – | {100 * start['eval/em']:.1f} | {100 * multi:.1f} | {hop} | "
            f"{start.get('eval/tool_calls_mean', 0.0):.2f} | – | – | – |"
        )
    for name in [n for n in RULE_RUNS if n in by]:
        rs = by[name]
        hop = " | ".join(_pm([r["em_by_hops"][str(h)] or 0.0 for r in rs]) for h in hop_counts)
        picks = sum(r.get("picks", 0.0) for r in rs)
        root = f"{100 * sum(r.get('root_picks', 0.0) for r in rs) / picks:.0f}%" if picks else "–"
        calls = statistics.mean(r["tool_calls_per_question"] or 0.0 for r in rs)
        lines.append(
            f"| {name} | {rs[0]['budget']} | {len(rs)} | {_pm([r['em'] for r in rs])} | "
            f"{_pm([multihop_em(r) for r in rs])} | {hop} | {calls:.2f} | {root} | "
            f"{statistics.mean(r['decoded_tokens'] for r in rs):,.0f} | "
            f"{statistics.mean(r['wall_s'] for r in rs):.0f} |"
        )
    return "\n".join(lines) + "\n"


def comparisons(records: list[dict]) -> str:
    """Each comparison on multi-hop EM and on all questions: difference, its sd, and the verdict."""
    by = _by_name(records)
    lines = [
        "| comparison | multi-hop: diff ± sd (z) | all: diff ± sd (z) | beyond noise (≥ 2 sd, multi-hop)? |",
        "|---|---|---|---|",
    ]
    for label, a, b in COMPARISONS:
        if a not in by or b not in by:
            continue
        cells, verdict = [], "–"
        if min(len(by[a]), len(by[b])) < 2:  # no spread to compare against yet
            cells = [
                f"{100 * difference([m(r) for r in by[a]], [m(r) for r in by[b]])[0]:+.1f} (1 seed)"
                for m in (multihop_em, lambda r: r["em"])
            ]
            lines.append(f"| {label} | {cells[0]} | {cells[1]} | needs ≥ 2 seeds each |")
            continue
        for metric in (multihop_em, lambda r: r["em"]):
            d, sd = difference([metric(r) for r in by[a]], [metric(r) for r in by[b]])
            z = d / sd if sd > 0 else math.copysign(math.inf, d) if d else 0.0
            cells.append(f"{100 * d:+.1f} ± {100 * sd:.1f} ({z:+.1f})")
            if verdict == "–":
                verdict = "yes, better" if z >= 2 else ("yes, worse" if z <= -2 else "no")
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {verdict} |")
    lines += ["", "| group | ranking by multi-hop EM (mean ± sd) |", "|---|---|"]
    for label, names in RULE_GROUPS:
        have = [n for n in names if n in by]
        ranked = sorted(have, key=lambda n: -statistics.mean(multihop_em(r) for r in by[n]))
        cell = " > ".join(f"{n} {_pm([multihop_em(r) for r in by[n]])}" for n in ranked)
        lines.append(f"| {label} | {cell or '–'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    budget_sweep.add_arguments(p, RULE_RUNS, steps=30, eval_prompts=300)
    p.add_argument("--base", default=BASE, help="config variant every run starts from")
    a = p.parse_args(argv)
    sc = budget_sweep.sweep_config(p, a, RULE_RUNS, base=a.base)
    records = budget_sweep.collect(sc, RULE_RUNS, report_only=a.report_only)
    table = summarize(records, sc, budget_sweep.hops(sc)) + "\n" + comparisons(records)
    budget_sweep.write_results(sc, records, table)


if __name__ == "__main__":
    main()
