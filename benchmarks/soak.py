"""Soak: one training process for hundreds of RL steps — does anything it holds keep growing?

    .venv/bin/python benchmarks/soak.py --steps=500 --out=docs/benchmarks/soak.json

Runs the real command, `launch/train.py --config=configs/resilience.py` (`:tiny` at toy sizes,
in-process BM25), for `--steps` Tree-GRPO steps in one process, with an evaluation every
`--eval_every` steps and a checkpoint every `--checkpoint_every` (rotation on), so the long-lived
parts of a run all take part: rollouts over changing tree shapes, train steps over their length
buckets, evaluation, Orbax saves, metric writers, plots. Every step logs the process's own
`process/*` metrics (`treegrpo_jax/train/process_stats.py`: resident memory, live threads, open
files, memory mappings, executables compiled so far); this script also samples the child from
outside every second (`/proc/PID`), which catches what happens between steps.

Growth of a metric = (its median over the last `--window` steps) ÷ (its median over the first
`--window` steps after the warm-up) − 1; the largest value and the slope are reported beside it.
**Target: ≤ 5 % for every metric after the first 50 steps, and no crash.** Writes the
figures as JSON, a PNG of each metric against the step, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from treegrpo_jax.testing.preemption import TrainCommand, log_tail  # noqa: E402
from treegrpo_jax.train.metrics import read_metrics  # noqa: E402

METRICS = (
    "process/rss_mb",
    "process/threads",
    "process/open_files",
    "process/memory_maps",
    "process/compiled_programs",
)


def _proc_sample(pid: int) -> dict[str, float] | None:
    """RSS (MB), threads, open files and mappings of process `pid` now (None once it is gone)."""
    base = pathlib.Path(f"/proc/{pid}")
    try:
        status = dict(line.split(":", 1) for line in (base / "status").read_text().splitlines())
        with open(base / "maps", "rb") as f:
            maps = sum(1 for _ in f)
        return {
            "process/rss_mb": int(status["VmRSS"].split()[0]) / 1024,
            "process/threads": float(status["Threads"]),
            "process/open_files": float(len(list((base / "fd").iterdir()))),
            "process/memory_maps": float(maps),
        }
    except (OSError, KeyError, ValueError):
        return None


def _watch(proc: subprocess.Popen, samples: list, every_s: float) -> None:
    t0 = time.monotonic()
    while proc.poll() is None:
        got = _proc_sample(proc.pid)
        if got:
            samples.append({"t": time.monotonic() - t0, **got})
        time.sleep(every_s)


def growth(rows: list[dict], key: str, warmup: int, window: int) -> dict:
    """Steady-state growth of `key`: the median over the last `window` steps ÷ the median over the
    first `window` steps after the warm-up − 1 (medians: a step's transient, e.g. plotting at an
    evaluation, is not a leak; a leak moves the median). Also the largest value after the warm-up
    and the least-squares slope per 100 steps."""
    series = [(r["step"], r[key]) for r in rows if key in r and r["step"] > warmup]
    if len(series) < 2:
        return {"first": None, "last": None, "growth": None}
    values = np.asarray([v for _, v in series], np.float64)
    steps = np.asarray([s for s, _ in series], np.float64)
    first, last = float(np.median(values[:window])), float(np.median(values[-window:]))
    return {
        "first": first,
        "last": last,
        "max_after": float(values.max()),
        "slope_per_100_steps": float(np.polyfit(steps, values, 1)[0] * 100),
        "growth": last / first - 1 if first else 0.0,
    }


def _plot(rows: list[dict], outside: list[dict], path: pathlib.Path, warmup: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.2))
    for ax, key in zip(axes, METRICS, strict=True):
        steps = [r["step"] for r in rows if key in r]
        ax.plot(steps, [r[key] for r in rows if key in r], lw=1.2)
        ax.axvline(warmup, color="grey", ls=":", lw=1)
        ax.set_title(key.removeprefix("process/"), fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        lo, hi = ax.get_ylim()
        ax.set_ylim(0, max(hi, 1.0) * 1.05)
    fig.suptitle("soak: one training process (configs/resilience.py), sampled after every step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--config", default="configs/resilience.py", help="the run's --config")
    p.add_argument("--set", action="append", default=[], help="extra --config.KEY=VALUE overrides")
    p.add_argument("--warmup", type=int, default=50, help="growth is measured after this step")
    p.add_argument("--window", type=int, default=50, help="steps per median (first and last)")
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--checkpoint_every", type=int, default=25)
    p.add_argument("--workdir", default="", help="default: a temporary directory")
    p.add_argument("--out", default="docs/benchmarks/soak.json")
    p.add_argument("--target", type=float, default=0.05)
    args = p.parse_args(argv)

    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="soak_"))
    cmd = TrainCommand(
        config=args.config,
        overrides=(
            *args.set,
            f"--config.run.steps={args.steps}",
            f"--config.run.eval_every={args.eval_every}",
            f"--config.run.checkpoint_every={args.checkpoint_every}",
            "--config.run.keep_checkpoints=2",
        ),
    )
    t0 = time.monotonic()
    proc = cmd.start(workdir, "soak")
    outside: list[dict] = []
    watcher = threading.Thread(target=_watch, args=(proc, outside, 1.0), daemon=True)
    watcher.start()
    last_report = 0
    while proc.poll() is None:
        time.sleep(5)
        rows = [r for r in read_metrics(workdir / "metrics.jsonl") if "process/rss_mb" in r]
        if rows and rows[-1]["step"] >= last_report + 25:
            last_report = rows[-1]["step"]
            r = rows[-1]
            print(
                f"  step {r['step']}: rss {r['process/rss_mb']:.0f} MB, threads {r['process/threads']:.0f}, "
                f"files {r['process/open_files']:.0f}, maps {r['process/memory_maps']:.0f}, "
                f"programs {r['process/compiled_programs']:.0f} ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    watcher.join(timeout=5)
    wall = time.monotonic() - t0
    rows = [r for r in read_metrics(workdir / "metrics.jsonl") if "process/rss_mb" in r]
    steps_done = rows[-1]["step"] if rows else 0
    per_metric = {
        key.removeprefix("process/"): growth(rows, key, args.warmup, args.window) for key in METRICS
    }
    worst = max((m["growth"] for m in per_metric.values() if m["growth"] is not None), default=None)
    outside_peak_rss = max((s["process/rss_mb"] for s in outside), default=None)
    out = {
        "command": " ".join(cmd.argv(workdir)[1:]),
        "steps_requested": args.steps,
        "steps_done": steps_done,
        "returncode": proc.returncode,
        "crashed": proc.returncode != 0,
        "wall_s": round(wall, 1),
        "seconds_per_step": round(wall / max(1, steps_done), 3),
        "warmup_step": args.warmup,
        "growth": per_metric,
        "worst_growth_after_warmup": worst,
        "target": args.target,
        "met": proc.returncode == 0
        and steps_done == args.steps
        and worst is not None
        and worst <= args.target,
        "outside_samples": len(outside),
        "outside_peak_rss_mb": outside_peak_rss,
        "per_step": [{k: r[k] for k in ("step", *METRICS) if k in r} for r in rows],
    }
    out_path = REPO / args.out if not pathlib.Path(args.out).is_absolute() else pathlib.Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    png = out_path.with_suffix(".png")
    if rows:
        _plot(rows, outside, png, args.warmup)
    print(f"\nsoak: {steps_done}/{args.steps} steps in {wall:.0f} s, exit code {proc.returncode}")
    print(f"{'metric':<18} {'first ' + str(args.window):>10} {'last ' + str(args.window):>10} {'max':>9} "
          f"{'per 100 steps':>14} {'growth':>8}")  # fmt: skip
    for name, m in per_metric.items():
        if m["growth"] is None:
            continue
        print(
            f"{name:<18} {m['first']:>10.1f} {m['last']:>10.1f} {m['max_after']:>9.1f} "
            f"{m['slope_per_100_steps']:>+14.2f} {100 * m['growth']:>7.2f}%"
        )
    verdict = "met" if out["met"] else "NOT met"
    print(f"target ≤ {100 * args.target:.0f}% after step {args.warmup}, no crash: {verdict}")
    print(f"wrote {out_path} and {png}")
    if proc.returncode != 0:
        print(f"the run failed:\n{log_tail(workdir, 'soak')}")
    return 0 if out["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
