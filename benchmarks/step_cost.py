"""What an RL step costs, tree against chain at its budget, in one process: rollout, update, compiles.

    .venv/bin/python benchmarks/step_cost.py --cold_start=OUT/cold_start --steps=8 \\
        --out=docs/benchmarks/step_cost.json

Every case is a real run of the trainer (`Trainer.rl_step`: the run's config, engine, environment,
batch layout and jitted step) on a copy of one cold start (`budget_sweep.py`'s
`OUT/cold_start`, e.g. the verdict study's), all in this process, their steps interleaved in a
rotating order so load from outside hits every case alike. Cases (configs/multihop.py
`tiny,hard,verdict` + the variant; 4 prompts per step as in the studies):

  chain_4        chain GRPO, 4 chains per prompt (the tree's budget);
  tree_2_2_1     Tree-GRPO (2,2,1), uniform picks (the paper's);
  tree_2_2_1_last  the same, branching from each chain's last step (`verdict.py`'s tree);
  *_noreuse      the same with every new batch shape compiled (no `rl.shapes.ShapeSet`).

Each case's prompts and keys are the same as its run's (`run.seed`), so chain and tree see the
same questions. The first `--warmup` steps of every case are run and left out of the medians
(they compile the programs a run compiles once; the engine's programs are shared by the cases, so
the first case to need one pays for it), and reported apart. Per case: the median and total
step wall, and its split: rollout, update (batch build + jitted step), compiles (count and
seconds, `time/compiles` / `time/compile_s`) and the update without its compiles; and the
tree/chain ratios of the medians. Writes `--out` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import budget_sweep  # noqa: E402  (run configs, seeding a workdir from a cold start)
from _common import environment  # noqa: E402

CASES = {
    "chain_4": budget_sweep.RUNS["chain_4"][0],
    "tree_2_2_1": budget_sweep.RUNS["tree_2_2_1"][0],
    "tree_2_2_1_last": "tree_m=2,tree_n=2,tree_l=1,rule=last",  # the verdict study's tree
}
TIMES = ("time/step_s", "time/rollout_s", "time/update_s", "time/compile_s", "time/compiles")


def _every_shape_class():
    from treegrpo_jax.rl.shapes import ShapeSet, shape_of

    class EveryShape(ShapeSet):
        """Compiles every new batch shape (what a run did before shapes were reused)."""

        def fit(self, batch):
            if shape_of(batch) not in self.shapes:
                self.shapes.append(shape_of(batch))
            return batch

    return EveryShape


def _EveryShape():  # noqa: N802  (a factory: the package is imported after sys.path is set)
    return _every_shape_class()()


def _case_trainer(
    name: str, variant: str, sc, cold: str, seed: int, steps: int, reuse: bool, row_multiple: int = 0
):
    from treegrpo_jax.rl.train_step import jit_train_step
    from treegrpo_jax.train.trainer import Trainer

    wd = os.path.join(sc.out, f"{name}_s{seed}")
    budget_sweep._seed_workdir(cold, wd)
    cfg = budget_sweep._config(variant, sc, seed=seed, steps=steps)
    if row_multiple:
        cfg = dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, row_multiple=row_multiple))
    trainer = Trainer(cfg, wd)
    if not reuse:
        trainer.shapes = _EveryShape()
    run, _ = trainer.start()
    cfg = trainer.cfg
    step_fn = jit_train_step(
        trainer.shardings,
        loss_cfg=cfg.loss,
        optim_cfg=cfg.optim,
        mesh=trainer.mesh,
        layout_kind=trainer.layout.kind,
    )
    return trainer, run, step_fn


def summarize(per_step: dict[str, list[dict]]) -> dict:
    """Per case: medians and totals of the step's times; tree/chain ratios of the median step."""
    out = {}
    for name, steps in per_step.items():
        col = {k: [s[k] for s in steps] for k in TIMES}
        col["update_wo_compile_s"] = [s["time/update_s"] - s["time/compile_s"] for s in steps]
        out[name] = {
            "steps": len(steps),
            "median": {k: statistics.median(v) for k, v in col.items()},
            "total": {k: sum(v) for k, v in col.items()},
            "decoded_tokens": sum(s["rollout/decoded_tokens"] for s in steps),
            "leaves": sum(s["rollout/leaves"] for s in steps),
            "shapes": steps[-1].get("batch/shapes"),
            "slots": sum(s["batch/slots"] for s in steps),
            "real_tokens": sum(s["batch/tokens"] for s in steps),
        }
    ratios = {}
    for tree_name, suffix in itertools.product(("tree_2_2_1", "tree_2_2_1_last"), ("", "_noreuse")):
        tree, chain = out.get(f"{tree_name}{suffix}"), out.get(f"chain_4{suffix}")
        if tree and chain:
            ratios[f"{tree_name}_over_chain_4{suffix}"] = {
                "median_step": tree["median"]["time/step_s"] / chain["median"]["time/step_s"],
                "total_step": tree["total"]["time/step_s"] / chain["total"]["time/step_s"],
                "median_rollout": tree["median"]["time/rollout_s"] / chain["median"]["time/rollout_s"],
                "median_update_wo_compile": tree["median"]["update_wo_compile_s"]
                / chain["median"]["update_wo_compile_s"],
                "decoded_tokens": tree["decoded_tokens"] / chain["decoded_tokens"],
                "slots": tree["slots"] / chain["slots"],
                "real_tokens": tree["real_tokens"] / chain["real_tokens"],
            }
    for name in CASES:
        a, b = out.get(name), out.get(f"{name}_noreuse")
        if a and b:
            ratios[f"{name}_reuse_over_noreuse_total_step"] = (
                a["total"]["time/step_s"] / b["total"]["time/step_s"]
            )
    return {"cases": out, "ratios": ratios}


def table(summary: dict) -> str:
    lines = [
        "| case | steps | step s (median / total) | rollout s | update s (w/o compiles) "
        "| compiles (n / s, total) | shapes | decoded tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in summary["cases"].items():
        m, t = c["median"], c["total"]
        lines.append(
            f"| {name} | {c['steps']} | {m['time/step_s']:.2f} / {t['time/step_s']:.1f} "
            f"| {m['time/rollout_s']:.2f} | {m['time/update_s']:.2f} ({m['update_wo_compile_s']:.2f}) "
            f"| {t['time/compiles']:.0f} / "
            f"{t['time/compile_s']:.1f} | {c['shapes'] or '–'} | {c['decoded_tokens']:,.0f} |"
        )
    for k, v in summary["ratios"].items():
        lines.append(f"\n{k}: {json.dumps(v)}" if isinstance(v, dict) else f"\n{k}: {v:.3f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cold_start", required=True, help="a cold-start workdir (OUT/cold_start of a study)")
    ap.add_argument(
        "--base", default="tiny,hard,verdict", help="the config variant the cold start was made with"
    )
    ap.add_argument("--steps", type=int, default=8, help="measured steps per case")
    ap.add_argument("--warmup", type=int, default=4, help="steps per case before the measured ones")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts_per_step", type=int, default=4)
    ap.add_argument("--noreuse", action="store_true", help="also run every case without shape reuse")
    ap.add_argument("--row_multiple", type=int, default=0, help="override rl.row_multiple (0: the config's)")
    ap.add_argument("--out", default="workdir/bench_step_cost.json")
    a = ap.parse_args(argv)

    import jax

    scratch = tempfile.mkdtemp(prefix="step_cost_")
    sc = budget_sweep.SweepConfig(
        out=scratch, prompts_per_step=a.prompts_per_step, eval_prompts=0, base=a.base
    )
    runs = {}
    for name, reuse in itertools.product(a.cases.split(","), (True, False) if a.noreuse else (True,)):
        case = name if reuse else f"{name}_noreuse"
        runs[case] = _case_trainer(
            case,
            CASES[name],
            sc,
            a.cold_start,
            a.seed,
            a.warmup + a.steps,
            reuse=reuse,
            row_multiple=a.row_multiple,
        )
    per_step: dict[str, list[dict]] = {name: [] for name in runs}
    warmup: dict[str, list[dict]] = {name: [] for name in runs}
    names = list(runs)
    keys = {name: jax.random.key(a.seed) for name in names}
    t0 = time.perf_counter()
    for k in range(a.warmup + a.steps):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            trainer, run, step_fn = runs[name]
            run, metrics, _ = trainer.rl_step(run, step_fn, keys[name])
            runs[name] = (trainer, run, step_fn)
            (warmup if k < a.warmup else per_step)[name].append(metrics)
            m = metrics
            print(
                f"step {k + 1} {name}: {m['time/step_s']:.2f} s (rollout {m['time/rollout_s']:.2f}, "
                f"update {metrics['time/update_s']:.2f}, compile {metrics['time/compile_s']:.2f} in "
                f"{metrics['time/compiles']:.0f})",
                flush=True,
            )
    summary = summarize(per_step)
    summary["warmup"] = {
        n: {k: sum(s[k] for s in v) for k in ("time/step_s", "time/compile_s", "time/compiles")}
        for n, v in warmup.items()
    }
    print(table(summary))
    print("warm-up (not in the table):", json.dumps(summary["warmup"]))
    record = {
        "command": "python benchmarks/step_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(),
        "wall_s": time.perf_counter() - t0,
        "per_step": {
            n: [
                {k: s[k] for k in (*TIMES, "rollout/decoded_tokens", "batch/slots", "batch/tokens")}
                for s in v
            ]
            for n, v in per_step.items()
        },
        **summary,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
