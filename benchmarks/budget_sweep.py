"""Budget sweep and advantage ablation on the synthetic world (issue 9; the paper's budget table).

Every run starts from ONE cold-start checkpoint (the `:tiny` SFT, trained once into
`OUT/cold_start`) and trains with the same prompts per step and the same number of optimizer
steps; only the rollout shape (chain budget or tree (M, N, L)), the advantage estimator and the
seed change. Each finished run writes `OUT/runs/<name>/result.json` and is skipped when the
sweep is re-run (resumable; a run killed midway resumes from its own checkpoints).

    python benchmarks/budget_sweep.py --out=DIR [--seeds=3] [--steps=10] [--prompts_per_step=4]
        [--eval_prompts=320] [--sft_steps=1500] [--runs=chain_2,tree_2_2_1,...] [--report_only]

The cold start is the `:tiny` SFT cut to `--sft_steps` (1,500 by default). That one stops short of
multi-hop: it answers most 1-hop questions but rarely searches past the second hop (greedy 4-hop EM
~1%), so the sweep measures how well each rollout shape teaches the policy to finish its plan.
Compiled programs are cached under `OUT/xla_cache`: seeds after the first skip most compiles.

Outputs: `OUT/results.json` (one record per run: config, seed, final test EM overall and by hop
count, tool calls per question, the training reward curve, rollout tokens decoded / prefilled,
tool calls, wall time), `OUT/summary.md` (mean ± sd over seeds, laid out like the paper's budget
table) and `OUT/em_vs_cost.png` (final EM against decoded tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "configs")]  # this checkout, not another install

# name -> (config variant of configs/multihop.py, budget label)
# Chains: plain GRPO (the group z-score) as in the paper's baseline, and `chain_*_tree` with the
# Tree-GRPO estimator, which on one-leaf trees adds each leaf's own reward r/(1+1e-6) (intra).
RUNS: dict[str, tuple[str, str]] = {
    "chain_2": ("tree_m=2,tree_n=0,tree_l=0,estimator=grpo", "2"),
    "chain_4": ("tree_m=4,tree_n=0,tree_l=0,estimator=grpo", "4"),
    "chain_8": ("tree_m=8,tree_n=0,tree_l=0,estimator=grpo", "8"),
    "chain_16": ("tree_m=16,tree_n=0,tree_l=0,estimator=grpo", "16"),
    "chain_2_tree": ("tree_m=2,tree_n=0,tree_l=0", "2, Tree-GRPO estimator"),
    "chain_4_tree": ("tree_m=4,tree_n=0,tree_l=0", "4, Tree-GRPO estimator"),
    "chain_8_tree": ("tree_m=8,tree_n=0,tree_l=0", "8, Tree-GRPO estimator"),
    "chain_16_tree": ("tree_m=16,tree_n=0,tree_l=0", "16, Tree-GRPO estimator"),
    "tree_1_2_1": ("tree_m=1,tree_n=2,tree_l=1", "≈2 (3 leaves)"),
    "tree_2_2_1": ("tree_m=2,tree_n=2,tree_l=1", "≈4 (6 leaves)"),
    "tree_4_2_1": ("tree_m=4,tree_n=2,tree_l=1", "≈8 (12 leaves)"),
    "tree_2_6_1": ("tree_m=2,tree_n=6,tree_l=1", "≈8 (14 leaves)"),
    "tree_4_5_1": ("tree_m=4,tree_n=5,tree_l=1", "≈16 (24 leaves)"),
    "tree_2_2_1_intra": ("tree_m=2,tree_n=2,tree_l=1,estimator=intra", "≈4, intra only"),
    "tree_2_2_1_inter": ("tree_m=2,tree_n=2,tree_l=1,estimator=inter", "≈4, inter only"),
}
_HOPS = (1, 2, 3, 4)
# The paper's budget table: per budget (≈ rollouts per prompt), the chain and the tree shapes.
BUDGET_ROWS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("≈2", "chain_2", ("tree_1_2_1",)),
    ("≈4", "chain_4", ("tree_2_2_1",)),
    ("≈8", "chain_8", ("tree_4_2_1", "tree_2_6_1")),
    ("≈16", "chain_16", ("tree_4_5_1",)),
)


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    out: str
    seeds: int = 3
    steps: int = 10
    prompts_per_step: int = 4
    eval_prompts: int = 320
    sft_steps: int = 1500
    runs: tuple[str, ...] = tuple(RUNS)
    base: str = "tiny"  # the config variant every run starts from ("tiny,hard": the harder world)


def base_config(variant: str, base: str = "tiny"):
    """The ConfigDict of one run before the sweep's settings (tests swap in a toy one)."""
    import multihop

    return multihop.get_config(f"{base},{variant}" if variant else base)


def hops(sc: SweepConfig) -> tuple[int, ...]:
    """The hop counts of the sweep's world (1-4, or 1-5 for the harder world)."""
    from treegrpo_jax.train.config import from_config_dict

    return tuple(range(1, len(from_config_dict(base_config("", sc.base)).data.world.questions_per_hop) + 1))


def _config(variant: str, sc: SweepConfig, seed: int, steps: int):
    from treegrpo_jax.train.config import from_config_dict

    c = base_config(variant, sc.base)
    c.run.update(
        seed=seed,
        steps=steps,
        prompts_per_step=sc.prompts_per_step,
        eval_every=steps,
        checkpoint_every=max(1, steps // 2),
        keep_checkpoints=2,
        render_trees=0,
        tensorboard=False,
    )
    c.data.eval_prompts = sc.eval_prompts
    c.sft.steps = sc.sft_steps
    return from_config_dict(c)


def run_config(variant: str, sc: SweepConfig, seed: int) -> dict:
    """How to reproduce one run: the config file and variant, and what the sweep overrides in it."""
    return {
        "config": f"configs/multihop.py:{sc.base},{variant}" if variant else f"configs/multihop.py:{sc.base}",
        "overrides": {
            "run.seed": seed,
            "run.steps": sc.steps,
            "run.prompts_per_step": sc.prompts_per_step,
            "data.eval_prompts": sc.eval_prompts,
            "sft.steps": sc.sft_steps,
        },
        "init": "checkpoint 0 of OUT/cold_start",
    }


def cold_start(sc: SweepConfig) -> str:
    """Trains the shared cold start once (the :tiny SFT + its step-0 evaluation); returns its dir."""
    from treegrpo_jax.train.loop import train_and_evaluate

    wd = os.path.join(sc.out, "cold_start")
    if not os.path.exists(os.path.join(wd, "checkpoints", "0")):
        # One RL step is the smallest run the loop accepts; only checkpoint 0 is reused.
        train_and_evaluate(_config("", sc, seed=0, steps=1), wd)
    return wd


def _seed_workdir(cold: str, wd: str) -> None:
    """A run's workdir holding the cold start's step-0 state only (the loop resumes from it)."""
    if os.path.exists(os.path.join(wd, "checkpoints")):
        return  # started before: resume from its own checkpoints
    os.makedirs(os.path.join(wd, "checkpoints"), exist_ok=True)
    for name in ("world", "tokenizer"):
        shutil.copytree(os.path.join(cold, name), os.path.join(wd, name), dirs_exist_ok=True)
    shutil.copy(os.path.join(cold, "model_config.json"), wd)
    with open(os.path.join(cold, "metrics.jsonl")) as f:
        step0 = [line for line in f if json.loads(line)["step"] == 0]
    with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
        f.writelines(step0)
    shutil.copytree(os.path.join(cold, "checkpoints", "0"), os.path.join(wd, "checkpoints", "0"))
    if os.path.exists(os.path.join(cold, "reference")):  # the frozen KL reference (kl_coef > 0)
        shutil.copytree(os.path.join(cold, "reference"), os.path.join(wd, "reference"))


@contextlib.contextmanager
def _persistent_compile_cache(path: str):
    """Compiled programs cached on disk for the sweep only: runs differ in shapes that repeat
    across seeds, so later seeds load their programs. The setting is undone on the way out (a
    caller in the same process — the test suite — must not go on reading this cache: loading
    some XLA:CPU executables back aborts the process, seen in CI on `train_step`)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {k: getattr(jax.config, k) for k in keys}
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _record(
    name: str, seed: int, variant: str, wd: str, wall: float, *, label: str, hop_counts=_HOPS
) -> dict:
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    train = [r for r in rows if "train/reward_mean" in r]
    evals = [r for r in rows if "eval/em" in r]
    final, start = evals[-1], evals[0]
    total = lambda key: float(sum(r.get(key, 0.0) for r in train))  # noqa: E731
    return {
        "name": name,
        "variant": variant,
        "seed": seed,
        "budget": label,
        "steps": len(train),
        "em": final["eval/em"],
        "em_by_hops": {str(h): final.get(f"eval/em/synthetic_{h}hop") for h in hop_counts},
        "em_cold_start": start["eval/em"],
        "tool_calls_per_question": final.get("eval/tool_calls_mean"),
        "reward_curve": [r["train/reward_mean"] for r in train],
        "train_em_curve": [r["train/em_mean"] for r in train],
        "decoded_tokens": total("rollout/decoded_tokens"),
        "prefilled_tokens": total("rollout/prefilled_tokens"),
        "reprefill_tokens": total("rollout/reprefill_tokens"),
        "tool_calls": total("rollout/tool_calls"),
        "leaves": total("rollout/leaves"),
        "train_wall_s": total("time/step_s"),
        "wall_s": wall,
        "root_picks": total("rollout/root_picks"),
        "picks": total("rollout/picks"),
        "compile_s": total("time/compile_s"),
        "compiles": total("time/compiles"),
        # Means over the run's steps of the mechanism metrics (`rl/mechanism.py`): why it learned.
        "mechanism": {
            k.removeprefix("mechanism/"): statistics.mean(r[k] for r in train if k in r)
            for k in sorted({k for r in train for k in r if k.startswith("mechanism/")})
        },
    }


def run_one(
    sc: SweepConfig, cold: str, name: str, seed: int, runs: dict[str, tuple[str, str]] = RUNS
) -> dict:
    from treegrpo_jax.train.loop import train_and_evaluate

    wd = os.path.join(sc.out, "runs", f"{name}_s{seed}")
    done = os.path.join(wd, "result.json")
    if os.path.exists(done):
        return _read_json(done)
    variant, label = runs[name]
    _seed_workdir(cold, wd)
    t0 = time.perf_counter()
    train_and_evaluate(_config(variant, sc, seed=seed, steps=sc.steps), wd)
    record = _record(name, seed, variant, wd, time.perf_counter() - t0, label=label, hop_counts=hops(sc))
    with open(done + ".tmp", "w") as f:
        json.dump(record, f, indent=2)
    os.replace(done + ".tmp", done)
    return record


def _mean_sd(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.mean(xs):.1f} ± {100 * sd:.1f}"


def _cold_start_eval(sc: SweepConfig) -> dict | None:
    """The cold start's step-0 evaluation (None when the sweep has no cold start yet)."""
    path = os.path.join(sc.out, "cold_start", "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        evals = [r for r in map(json.loads, f) if r["step"] == 0 and "eval/em" in r]
    return evals[0] if evals else None


def summarize(records: list[dict], sc: SweepConfig) -> str:
    """A markdown table, one row per run name, mean ± sd over seeds."""
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)
    cold = records[0]["em_cold_start"] if records else float("nan")
    lines = [
        f"{sc.steps} RL steps × {sc.prompts_per_step} prompts from one cold start "
        f"(greedy EM {100 * cold:.1f}% on {sc.eval_prompts} test questions); mean ± sd over seeds.",
        "",
        "| run | budget | seeds | EM | 1-hop | 2-hop | 3-hop | 4-hop | tool calls / q | decoded tokens | "
        "prefilled tokens | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    start = _cold_start_eval(sc)
    if start:
        hop = " | ".join(f"{100 * start.get(f'eval/em/synthetic_{h}hop', 0.0):.1f}" for h in _HOPS)
        calls = start.get("eval/tool_calls_mean", 0.0)
        em = 100 * start["eval/em"]
        lines.append(f"| cold start | – | – | {em:.1f} | {hop} | {calls:.2f} | – | – | – |")
    for name in [n for n in RUNS if n in by]:
        rs = by[name]
        hop = [_mean_sd([r["em_by_hops"][str(h)] for r in rs]) for h in _HOPS]
        keys = ("decoded_tokens", "prefilled_tokens", "wall_s")
        mean = {k: statistics.mean(r[k] for r in rs) for k in keys}
        calls = statistics.mean(r["tool_calls_per_question"] or 0.0 for r in rs)
        lines.append(
            f"| {name} | {rs[0]['budget']} | {len(rs)} | {_mean_sd([r['em'] for r in rs])} | "
            + " | ".join(hop)
            + f" | {calls:.2f} | {mean['decoded_tokens']:,.0f} | {mean['prefilled_tokens']:,.0f} | "
            f"{mean['wall_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _multihop(r: dict) -> float:
    return statistics.mean(r["em_by_hops"][str(h)] or 0.0 for h in _HOPS[1:])


def budget_table(records: list[dict]) -> str:
    """The paper's layout: one line per budget, chain vs tree, 1-hop and multi-hop (2–4) EM."""
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)

    def cell(name: str) -> str:
        rs = by.get(name)
        if not rs:
            return "– | – | –"
        one = _mean_sd([r["em_by_hops"]["1"] for r in rs])
        return f"{one} | {_mean_sd([_multihop(r) for r in rs])} | {_mean_sd([r['em'] for r in rs])}"

    lines = [
        "| budget | chain | 1-hop | multi-hop | all | tree | 1-hop | multi-hop | all |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, chain, trees in BUDGET_ROWS:
        for tree in trees:
            if chain in by or tree in by:
                lines.append(f"| {label} | {chain} | {cell(chain)} | {tree} | {cell(tree)} |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: str) -> None:
    """Final EM (mean ± sd over seeds) against two costs: rollout tokens decoded, training wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)
    costs = (
        ("decoded_tokens", "rollout tokens decoded over the run (log)"),
        ("train_wall_s", "training wall time, s (log)"),
    )
    for ax, (key, label) in zip(axes, costs, strict=True):
        for i, (name, rs) in enumerate(by.items()):
            ems = [100 * r["em"] for r in rs]
            sd = statistics.stdev(ems) if len(ems) > 1 else 0.0
            # Circles: GRPO chains; diamonds: chains with the tree estimator; squares: trees;
            # triangles: the (2,2,1) advantage ablation.
            style = ("D" if name.endswith("_tree") else "o") if name.startswith("chain") else "s"
            style = "^" if name.endswith(("_intra", "_inter")) else style
            x = statistics.mean(r[key] for r in rs)
            color = plt.cm.tab20(i % 20)  # up to 20 distinct colours (the default cycle has 10)
            ax.errorbar(x, statistics.mean(ems), yerr=sd, fmt=style, color=color, capsize=3, label=name)
        if records:
            ax.axhline(100 * records[0]["em_cold_start"], color="grey", ls="--", lw=1, label="cold start")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test EM after RL (%)")
    axes[1].legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser, runs: dict, *, steps: int, eval_prompts: int) -> None:
    """The options every sweep takes (this one and `rules_sweep.py`)."""
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--prompts_per_step", type=int, default=4)
    p.add_argument("--eval_prompts", type=int, default=eval_prompts)
    p.add_argument("--sft_steps", type=int, default=1500, help="cold-start SFT steps (its strength)")
    p.add_argument("--runs", default=",".join(runs), help="comma-separated names: " + ", ".join(runs))
    p.add_argument("--report_only", action="store_true", help="summarise finished runs, train nothing")


def sweep_config(p: argparse.ArgumentParser, a: argparse.Namespace, runs: dict, **extra) -> SweepConfig:
    names = tuple(n for n in a.runs.split(",") if n)
    unknown = [n for n in names if n not in runs]
    if unknown:
        p.error(f"--runs: unknown {unknown}; known: {list(runs)}")
    return SweepConfig(
        out=a.out,
        seeds=a.seeds,
        steps=a.steps,
        prompts_per_step=a.prompts_per_step,
        eval_prompts=a.eval_prompts,
        sft_steps=a.sft_steps,
        runs=names,
        **extra,
    )


def collect(sc: SweepConfig, runs: dict, *, report_only: bool) -> list[dict]:
    """Trains what is missing (seed-major: every run name gets a first seed before any gets a
    second) and returns every run's record; with `report_only`, only the finished ones."""
    os.makedirs(sc.out, exist_ok=True)
    records = []
    with _persistent_compile_cache(os.path.join(sc.out, "xla_cache")):
        cold = None if report_only else cold_start(sc)
        for seed in range(sc.seeds):
            for name in sc.runs:
                if report_only:
                    path = os.path.join(sc.out, "runs", f"{name}_s{seed}", "result.json")
                    if os.path.exists(path):
                        records.append(_read_json(path))
                else:
                    print(f"=== {name} seed {seed}", flush=True)
                    records.append(run_one(sc, cold, name, seed, runs))
    return records


def write_results(sc: SweepConfig, records: list[dict], table: str) -> None:
    """`results.json` (records + how to reproduce each), `summary.md` and `em_vs_cost.png`."""
    with open(os.path.join(sc.out, "results.json"), "w") as f:
        runs = [r | {"config": run_config(r["variant"], sc, r["seed"])} for r in records]
        json.dump({"config": dataclasses.asdict(sc), "runs": runs}, f, indent=2)
    with open(os.path.join(sc.out, "summary.md"), "w") as f:
        f.write(table)
    if records:
        plot(records, os.path.join(sc.out, "em_vs_cost.png"))
    print(table)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p, RUNS, steps=10, eval_prompts=320)
    a = p.parse_args(argv)
    sc = sweep_config(p, a, RUNS)
    records = collect(sc, RUNS, report_only=a.report_only)
    write_results(sc, records, summarize(records, sc) + "\n" + budget_table(records))


if __name__ == "__main__":
    main()
