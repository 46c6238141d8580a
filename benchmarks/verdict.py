"""Tree vs chain, with a verdict (issue 28 item 2): tree (2,2,1) against chain GRPO at 4 and 16.

The paper's headline is that a tree at a budget of ≈4 rollouts per prompt beats chains at 16.
`rules_sweep.py` (BENCHMARKS.md §8) could not tell: 3 seeds, 300 test questions, independent
seeds. This study is built to separate a few points:
- **1,500 test questions** (`configs/multihop.py:tiny,hard,verdict`: the harder world at 900
  questions per hop count, a third of each to test), so one run's binomial sd is ~1.3 points;
- **paired seeds**: every run starts from ONE cold start, and a seed fixes the train prompts and
  their order, so tree and chain with the same seed see the same prompts from the same weights;
  the comparison is the mean of the per-seed differences, with the sd of that mean
  (sd(d) / √n), which removes what the seeds share;
- ≥ 6 seeds, 30 RL steps × 4 prompts × 2 optimizer updates = 60 updates per run;
- the tree uses `tree.rule=last`, the branching rule that ranked first in §8 (none separated there).

    python benchmarks/verdict.py --out=DIR [--seeds=6] [--runs=chain_4,chain_16,tree_2_2_1_last]

Runs resume and are skipped once done (`budget_sweep.py`'s machinery), so two processes can split
the runs between them (`--runs=chain_16` in one, `--runs=chain_4,tree_2_2_1_last` in the other,
started once the cold start exists) and a final `--report_only` writes the report. Outputs under
OUT: `results.json`, `summary.md` (the per-run table of `rules_sweep.py`, then the paired
comparisons with their power), `verdict.json` (the comparisons as numbers) and `paired.png` (EM
per seed, each seed's runs joined).

"Separates" means |mean difference| ≥ 2 sd of that mean. The power figures are normal
approximations from the measured sd of the paired differences: the smallest true difference the
study would call at 80% power, `(2 + 0.84) × sd_mean`, and the power against the paper's +5 points.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import budget_sweep  # noqa: E402  (the sweep machinery; it puts this checkout on sys.path)
import rules_sweep  # noqa: E402  (the run catalogue and its per-run table)

RUNS = {name: rules_sweep.RULE_RUNS[name] for name in ("chain_4", "chain_16", "tree_2_2_1_last")}
PAIRS = (
    ("tree (2,2,1) `last` at ≈4 vs chain GRPO at 16", "tree_2_2_1_last", "chain_16"),
    ("tree (2,2,1) `last` at ≈4 vs chain GRPO at 4", "tree_2_2_1_last", "chain_4"),
    ("chain GRPO at 16 vs at 4", "chain_16", "chain_4"),
)
BASE = "tiny,hard,verdict"
PAPER_GAP = 0.05  # the paper's multi-hop gain of Tree-GRPO over chains (36.8 vs 31.8 EM), as a fraction
Z_CALL = 2.0  # the criterion: a difference of at least 2 sd
Z_POWER = 0.8416  # the normal quantile of 0.8: 80% power


def paired(a: list[dict], b: list[dict], metric) -> dict:
    """The paired comparison of two runs over the seeds both have.

    d_s = metric(a_s) − metric(b_s); returns the seeds, the differences, their mean, the sd of the
    mean (sd(d) / √n), z, the verdict, the smallest difference detectable at 80% power, the power
    against `PAPER_GAP`, and, for scale, the sd the same runs give when read as independent seeds.
    """
    by_a, by_b = {r["seed"]: r for r in a}, {r["seed"]: r for r in b}
    seeds = sorted(set(by_a) & set(by_b))
    d = [metric(by_a[s]) - metric(by_b[s]) for s in seeds]
    out: dict = {"seeds": seeds, "differences": d, "n": len(d)}
    if len(d) < 2:
        return out | {"verdict": "needs ≥ 2 paired seeds"}
    mean, sd_mean = statistics.mean(d), statistics.stdev(d) / len(d) ** 0.5
    z = mean / sd_mean if sd_mean > 0 else float("inf") if mean else 0.0
    nd = statistics.NormalDist()
    verdict = "a better" if z >= Z_CALL else "b better" if z <= -Z_CALL else "does not separate"
    return out | {
        "mean": mean,
        "sd_mean": sd_mean,
        "z": z,
        "verdict": verdict,
        "detectable_at_80pct_power": (Z_CALL + Z_POWER) * sd_mean,
        "power_vs_paper_gap": nd.cdf(PAPER_GAP / sd_mean - Z_CALL) if sd_mean > 0 else 1.0,
        "sd_mean_unpaired": unpaired_sd([metric(by_a[s]) for s in seeds], [metric(by_b[s]) for s in seeds]),
    }


def unpaired_sd(a: list[float], b: list[float]) -> float:
    """The sd of mean(a) − mean(b) when the seeds are read as independent (§8's formula)."""
    return rules_sweep.difference(a, b)[1]


def _metrics():
    return (("multi-hop", rules_sweep.multihop_em), ("all", lambda r: r["em"]))


def verdicts(records: list[dict]) -> dict:
    by = rules_sweep._by_name(records)
    out = {}
    for label, a, b in PAIRS:
        if a in by and b in by:
            out[label] = {"a": a, "b": b} | {m: paired(by[a], by[b], f) for m, f in _metrics()}
    return out


def _cell(c: dict) -> str:
    if "mean" not in c:
        return c["verdict"]
    return f"{100 * c['mean']:+.1f} ± {100 * c['sd_mean']:.1f} ({c['z']:+.1f})"


def verdict_table(v: dict) -> str:
    lines = [
        "| comparison (a vs b), paired by seed | seeds | multi-hop: mean d ± sd (z) | all: mean d ± sd (z) "
        "| verdict (multi-hop, ≥ 2 sd) | detectable at 80% power | power vs +5 points | sd if unpaired |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, c in v.items():
        m = c["multi-hop"]
        verdict = {"a better": f"{c['a']} better", "b better": f"{c['b']} better"}.get(
            m["verdict"], m["verdict"]
        )
        extra = (
            f"{100 * m['detectable_at_80pct_power']:.1f} points | {100 * m['power_vs_paper_gap']:.0f}% | "
            f"{100 * m['sd_mean_unpaired']:.1f}"
            if "mean" in m
            else "– | – | –"
        )
        lines.append(f"| {label} | {m['n']} | {_cell(m)} | {_cell(c['all'])} | {verdict} | {extra} |")
    return "\n".join(lines) + "\n"


def plot_paired(records: list[dict], path: str) -> None:
    """Multi-hop EM per run, one line per seed joining that seed's runs (pairing made visible)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in RUNS if any(r["name"] == n for r in records)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (label, metric) in zip(axes, _metrics(), strict=True):
        seeds = sorted({r["seed"] for r in records})
        for s in seeds:
            pts = [
                (i, metric(r))
                for i, n in enumerate(names)
                for r in records
                if r["name"] == n and r["seed"] == s
            ]
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], "o-", alpha=0.6, label=f"seed {s}")
        for i, n in enumerate(names):
            ys = [100 * metric(r) for r in records if r["name"] == n]
            ax.plot([i - 0.15, i + 0.15], [statistics.mean(ys)] * 2, "k-", lw=3)
        if records:
            cold = records[0]["em_cold_start"] if label == "all" else None
            if cold is not None:
                ax.axhline(100 * cold, color="grey", ls="--", lw=1, label="cold start")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(f"test EM after RL, {label} (%)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    budget_sweep.add_arguments(p, RUNS, steps=30, eval_prompts=1500)
    p.add_argument("--base", default=BASE, help="config variant every run starts from")
    p.set_defaults(seeds=6)
    a = p.parse_args(argv)
    sc = budget_sweep.sweep_config(p, a, RUNS, base=a.base)
    records = budget_sweep.collect(sc, RUNS, report_only=a.report_only)
    v = verdicts(records)
    table = rules_sweep.summarize(records, sc, budget_sweep.hops(sc)) + "\n" + verdict_table(v)
    budget_sweep.write_results(sc, records, table)
    with open(os.path.join(sc.out, "verdict.json"), "w") as f:
        json.dump(v, f, indent=2)
    if records:
        plot_paired(records, os.path.join(sc.out, "paired.png"))


if __name__ == "__main__":
    main()
