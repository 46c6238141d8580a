"""The paper's three claims tested in the paper's regime, with the mechanism beside each verdict.

Tree-GRPO (Ji et al.) claims, on multi-hop QA: (1) a tree at a budget of ≈4 rollouts per prompt
beats chain GRPO at 16; (2) at a budget of ≈2 chains barely learn while the tree (1,2,1) does;
(3) at (2,2,1) the intra-tree estimator alone collapses (inter alone 33.8, their sum 36.8). The
paper starts RL from a model that rarely answers right, so most chain groups carry no signal;
`verdict.py` ran from a strong cold start (35% EM). This study runs both regimes on the
`tiny,hard,verdict` world (1,500 test questions), every run from ONE cold start per regime and
paired by seed (a seed fixes the prompts and their order), branch points picked uniformly:

  sparse  the cold start cut to `SPARSE_SFT_STEPS` SFT steps: sampled EM at the rollout
          temperature ≤ 15% (the first RL steps' `train/em_mean`); every cell;
  strong  the verdict study's cold start (1,500 SFT steps): the budget-2 pair and the uniform
          tree, to set beside `docs/benchmarks/verdict/`.

    python benchmarks/paper_regime.py --regime=sparse --out=DIR [--seeds=6] [--steps=60] \\
        [--runs=chain_2,tree_1_2_1,...] [--report_only]

Runs resume and are skipped once done (`budget_sweep.py`'s machinery): the study runs in parts,
and two processes can split the runs (`--runs=`) once the cold start exists. Outputs under OUT:
`results.json` (every run: EM by hop count, decoded tokens, wall, compiles, the means of its
mechanism metrics), `summary.md` (the per-run table with the mechanism, then each claim's paired
verdict with its power), `claims.json` and `frontier.png` (multi-hop EM against decoded tokens and
against wall seconds: the frontier a user picks from).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import budget_sweep  # noqa: E402  (the sweep machinery; it puts this checkout on sys.path)
import rules_sweep  # noqa: E402  (multihop_em)
import verdict  # noqa: E402  (paired comparisons with their power)

BASE = "tiny,hard,verdict"
SPARSE_SFT_STEPS = 900
RUNS: dict[str, tuple[str, str]] = {
    name: budget_sweep.RUNS[name]
    for name in (
        "chain_2",
        "tree_1_2_1",
        "chain_4",
        "tree_2_2_1",
        "chain_16",
        "tree_2_2_1_intra",
        "tree_2_2_1_inter",
    )
}
REGIMES: dict[str, tuple[int, tuple[str, ...]]] = {
    "sparse": (SPARSE_SFT_STEPS, tuple(RUNS)),
    "strong": (1500, ("chain_2", "tree_1_2_1", "tree_2_2_1")),
}
# (claim, a, b, the paper's multi-hop EM of a and b: Tables 3-4, Qwen2.5-3B)
CLAIMS = (
    ("quarter budget: tree (2,2,1) at ≈4 vs chain GRPO at 16", "tree_2_2_1", "chain_16", (36.8, 33.9)),
    ("tree (2,2,1) at ≈4 vs chain GRPO at 4", "tree_2_2_1", "chain_4", (36.8, 31.8)),
    ("budget 2: tree (1,2,1) vs chain GRPO at 2", "tree_1_2_1", "chain_2", (31.6, 14.9)),
    ("intra-only vs intra + inter at (2,2,1)", "tree_2_2_1_intra", "tree_2_2_1", (None, 36.8)),
    ("inter-only vs intra + inter at (2,2,1)", "tree_2_2_1_inter", "tree_2_2_1", (33.8, 36.8)),
)
MECHANISM = ("leaves_nonzero", "tokens_nonzero", "equal_tree_groups", "equal_prompt_groups")


def _pm(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.mean(xs):.1f} ± {100 * sd:.1f}"


def _mean(rs: list[dict], f) -> float | None:
    xs = [f(r) for r in rs]
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def run_table(records: list[dict], sc: budget_sweep.SweepConfig) -> str:
    """One row per run name: EM, multi-hop EM, sampled EM early in RL, cost, and the mechanism."""
    by = rules_sweep._by_name(records)
    start = budget_sweep._cold_start_eval(sc)
    lines = [
        f"World `{sc.base}`, cold start of {sc.sft_steps} SFT steps; {sc.steps} RL steps × "
        f"{sc.prompts_per_step} prompts; greedy EM on {sc.eval_prompts} test questions; "
        "mean ± sd over seeds. Mechanism columns: means over the run's steps (`rl/mechanism.py`).",
        "",
        "| run | rollout | seeds | EM | multi-hop | sampled EM, steps 1–5 | tool calls / q "
        "| decoded tokens | train wall (s) | compiles (s) | leaves A≠0 | tokens A≠0 | equal tree groups "
        "| equal prompt groups |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if start:
        hops = budget_sweep.hops(sc)
        multi = statistics.mean(start.get(f"eval/em/synthetic_{h}hop", 0.0) for h in hops[1:])
        lines.append(
            f"| cold start | – | – | {100 * start['eval/em']:.1f} | {100 * multi:.1f} | – | "
            f"{start.get('eval/tool_calls_mean', 0.0):.2f} | – | – | – | – | – | – | – |"
        )
    for name in [n for n in RUNS if n in by]:
        rs = by[name]
        mech = [
            f"{100 * v:.0f}%"
            if (v := _mean(rs, lambda r, k=k: r.get("mechanism", {}).get(k))) is not None
            else "–"
            for k in MECHANISM
        ]
        lines.append(
            f"| {name} | {rs[0]['budget']} | {len(rs)} | {_pm([r['em'] for r in rs])} | "
            f"{_pm([rules_sweep.multihop_em(r) for r in rs])} | "
            f"{_pm([statistics.mean(r['train_em_curve'][:5]) for r in rs])} | "
            f"{_mean(rs, lambda r: r['tool_calls_per_question']) or 0.0:.2f} | "
            f"{_mean(rs, lambda r: r['decoded_tokens']):,.0f} | "
            f"{_mean(rs, lambda r: r['train_wall_s']):.0f} | "
            f"{_mean(rs, lambda r: r.get('compile_s')) or 0.0:.0f} | " + " | ".join(mech) + " |"
        )
    return "\n".join(lines) + "\n"


def claims(records: list[dict]) -> dict:
    """Each claim whose two runs exist: the paired comparison on multi-hop EM and on all questions."""
    by = rules_sweep._by_name(records)
    out = {}
    for label, a, b, paper in CLAIMS:
        if a in by and b in by:
            out[label] = {"a": a, "b": b, "paper": paper} | {
                m: verdict.paired(by[a], by[b], f) for m, f in verdict._metrics()
            }
    return out


def claims_table(c: dict) -> str:
    lines = [
        "| claim (a vs b), paired by seed | paper (a / b) | seeds | multi-hop: mean d ± sd (z) "
        "| verdict (≥ 2 sd) | detectable at 80% power | power vs +5 points |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, x in c.items():
        m = x["multi-hop"]
        pa, pb = x["paper"]
        paper = f"{pa if pa is not None else 'collapses'} / {pb}"
        v = {"a better": f"{x['a']} better", "b better": f"{x['b']} better"}.get(m["verdict"], m["verdict"])
        power = (
            f"{100 * m['detectable_at_80pct_power']:.1f} points | {100 * m['power_vs_paper_gap']:.0f}%"
            if "mean" in m
            else "– | –"
        )
        lines.append(f"| {label} | {paper} | {m['n']} | {verdict._cell(m)} | {v} | {power} |")
    return "\n".join(lines) + "\n"


def plot_frontier(records: list[dict], path: str) -> None:
    """Multi-hop EM against decoded tokens and against train wall seconds, one point per run name
    (mean over seeds, bars ± sd)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = rules_sweep._by_name(records)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (key, xlabel) in zip(
        axes,
        (("decoded_tokens", "decoded tokens per run"), ("train_wall_s", "train wall per run (s)")),
        strict=True,
    ):
        for name in [n for n in RUNS if n in by]:
            rs = by[name]
            ys = [100 * rules_sweep.multihop_em(r) for r in rs]
            x = statistics.mean(r[key] for r in rs)
            sd = statistics.stdev(ys) if len(ys) > 1 else 0.0
            marker = "s" if name.startswith("chain") else "o"
            ax.errorbar(x, statistics.mean(ys), yerr=sd, fmt=marker, capsize=3, label=name)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test EM after RL, multi-hop (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sampled_em(sc: budget_sweep.SweepConfig, prompts: int = 64, seed: int = 0) -> dict:
    """The cold start's EM when sampled as RL samples it (the run's temperature and top-p): chain
    GRPO@4 rollouts on `prompts` train questions (4·prompts leaves), without any update."""
    import jax

    from treegrpo_jax.rollout.tree_search import rollout
    from treegrpo_jax.train.evaluate import leaf_metrics
    from treegrpo_jax.train.trainer import Trainer

    cold = budget_sweep.cold_start(sc)
    wd = os.path.join(sc.out, "runs", f"sampled_em_s{seed}")
    budget_sweep._seed_workdir(cold, wd)
    cfg = budget_sweep._config(budget_sweep.RUNS["chain_4"][0], sc, seed=seed, steps=1)
    trainer = Trainer(cfg, wd)
    trainer.start()
    rows = list(trainer.data.train[:prompts])
    trees, _ = rollout(
        trainer.engine,
        trainer.env,
        rows,
        cfg.tree,
        cfg.agent,
        key=jax.random.key(seed),
        prompt_uids=list(range(len(rows))),
        scheduler=cfg.rollout,
    )
    m = leaf_metrics(trees, "sampled")
    n = sum(len(t.leaves()) for t in trees)
    em = m["sampled/em_mean"]
    out = {
        "sft_steps": sc.sft_steps,
        "prompts": len(rows),
        "leaves": n,
        "em": em,
        "binomial_sd": (em * (1 - em) / n) ** 0.5,
        "temperature": cfg.agent.temperature,
        "reward_mean": m["sampled/reward_mean"],
        "tool_calls_mean": m["sampled/tool_calls_mean"],
    }
    print(json.dumps(out))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    budget_sweep.add_arguments(p, RUNS, steps=60, eval_prompts=1500)
    p.add_argument("--regime", choices=tuple(REGIMES), required=True)
    p.add_argument("--base", default=BASE, help="config variant every run starts from")
    p.add_argument("--calibrate", action="store_true", help="only the cold start and its sampled EM")
    p.set_defaults(seeds=6, runs="", sft_steps=0)
    a = p.parse_args(argv)
    sft_steps, runs = REGIMES[a.regime]
    a.sft_steps = a.sft_steps or sft_steps  # --sft_steps tries another cold start (calibration)
    a.runs = a.runs or ",".join(runs)
    sc = budget_sweep.sweep_config(p, a, RUNS, base=a.base)
    if a.calibrate:
        os.makedirs(sc.out, exist_ok=True)
        with open(os.path.join(sc.out, "sampled_em.json"), "w") as f:
            json.dump(sampled_em(sc), f, indent=2)
        return
    records = budget_sweep.collect(sc, RUNS, report_only=a.report_only)
    c = claims(records)
    budget_sweep.write_results(sc, records, run_table(records, sc) + "\n" + claims_table(c))
    with open(os.path.join(sc.out, "claims.json"), "w") as f:
        json.dump(c, f, indent=2)
    if records:
        plot_frontier(records, os.path.join(sc.out, "frontier.png"))


if __name__ == "__main__":
    main()
