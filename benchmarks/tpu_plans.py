"""The paper's run on paper: Qwen2.5-3B and 7B compiled for v5e-8, v6e-8, v5p-8, v4-8 and a
multi-host v5e-16 by the TPU compiler on this CPU host (`treegrpo-compile`, one process per row).

    python benchmarks/tpu_plans.py --out=docs/benchmarks/tpu [--rows=3b_v5e8,...]

Every row is `configs/multihop.py` (512 prompts × (2,2,1) trees, 64-prompt mini-batches, buckets
up to 4,096 tokens) with per-layer remat, attention in 512-query chunks and the weights and Adam
moments sharded over all chips (FSDP: `mesh.shape=1,-1,1`), compiled at its largest bucket with
the engine's programs; `--search` halves `run.prompts_per_step` / `run.rollout_slots` until each
phase fits. Writes one JSON per row and `plans.md` (the table of docs/tpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = [
    "--config=configs/multihop.py",
    "--config.model.remat=layer",
    "--config.mesh.shape=1,-1,1",
    "--config.model.attention_chunk=512",
    "--programs=rl_step T=4096,decode,fork",
    "--search",
]
TOPOLOGIES = {
    "v5e8": "v5e:2x4",
    "v6e8": "v6e:2x4",
    "v5p8": "v5p:2x2x1",
    "v4-8": "v4:2x2x1",
    "v5e16": "v5e:4x4",
}
ROWS = {
    f"{size}_{name}": (f"qwen2.5-{size}", topo) for size in ("3b", "7b") for name, topo in TOPOLOGIES.items()
}


def command(row: str, out: str) -> list[str]:
    model, topology = ROWS[row]
    json_path = os.path.join(out, f"{row}.json")
    return [
        os.path.join("launch", "compile.py"),
        *COMMON,
        f"--topology={topology}",
        f"--config.model.path={model}",
        f"--json={json_path}",
    ]


def summary(out: str) -> str:
    """One line per row: as configured, then the plan the search found (prompts, slots, memory, time)."""
    lines = [
        "| model | topology | devices (hosts) | as configured (512 prompts) | prompts / step that fit "
        "| rollout slots that fit | update GiB / device | rollout GiB / device | bound per RL step (s) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row, (model, topology) in ROWS.items():
        path = os.path.join(out, f"{row}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            r = json.load(f)
        found = r.get("largest_fitting", {})
        plan = found.get("plan", r)
        peak = {p["phase"]: f"{p['peak_bytes'] / 2**30:.1f}" for p in plan["phases"]}
        verdict = "fits" if r["fits"] else "does not fit"
        devices = r["mesh"]["data"] * r["mesh"]["fsdp"] * r["mesh"]["tensor"]
        lines.append(
            f"| {model} | {topology} | {devices} ({r.get('hosts', '?')}) | {verdict} "
            f"| {plan['prompts_per_step']} | {plan['rollout_slots']} | {peak.get('update', '–')} "
            f"| {peak.get('rollout', '–')} | {plan['predicted_step_s']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default=",".join(ROWS))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for row in a.rows.split(","):
        cmd = command(row, a.out)
        print("$ python " + " ".join(cmd), flush=True)
        with open(os.path.join(a.out, f"{row}.log"), "w") as log:
            subprocess.run(
                [sys.executable, *cmd], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False
            )
    table = summary(a.out)
    with open(os.path.join(a.out, "plans.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
