"""Where one RL step of a pretrained model goes, by phase, against this machine's ceilings (issue 27).

    .venv/bin/python benchmarks/rl_step_phases.py --config=configs/multihop.py:smollm2,cpu \\
        --policy_workdir=workdir/smollm2_cpu --out=docs/benchmarks/rl_step_phases.json   # ~15 min

In one process: the f32 matmul rate (a jitted 1024³ dot) and the read bandwidth (a jitted sum),
then one step's rollout through the run's own Trainer (its config, engine, environment; the
policy restored from `--policy_workdir`'s latest checkpoint, else the model as loaded), then for
each layout (packed trees, path rows) × remat (none, layer) on those same trees:
  forward  the log-prob pass over every row of the step (what the old-policy and KL-reference
           passes cost each),
  update   the whole jitted train step (advantages, old log-probs, forward + backward, AdamW),
each compiled first (seconds reported apart: a new shape compiles again) and timed `--repeats`
times (median). FLOP figures count the weight matmuls only (2·params·tokens forward, 3× that
for forward + backward, +1 forward with remat) over the padded token slots the program computes,
so `of_peak` = those FLOPs / the matmul rate / time; attention and the softmax come on top.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median_time  # noqa: E402
from _roofline import matmul_gflops, read_bandwidth_gbps  # noqa: E402

from treegrpo_jax.model.config import Remat  # noqa: E402
from treegrpo_jax.rl.batch import LayoutKind  # noqa: E402
from treegrpo_jax.rl.step_inputs import prepare  # noqa: E402
from treegrpo_jax.rl.train_state import create_train_state  # noqa: E402
from treegrpo_jax.rl.train_step import _forward_all, jit_train_step  # noqa: E402
from treegrpo_jax.rollout.tree_search import rollout  # noqa: E402
from treegrpo_jax.train import multihost  # noqa: E402
from treegrpo_jax.train.checkpoint import CheckpointConfig, Checkpointer  # noqa: E402
from treegrpo_jax.train.config import from_config_dict  # noqa: E402
from treegrpo_jax.train.trainer import Trainer  # noqa: E402


def load_config(spec: str, overrides: list[str]):
    """`configs/x.py:variants` plus `key.sub=value` overrides (values parsed as Python literals)."""
    import ast
    import importlib.util

    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("bench_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    c = module.get_config(arg or None)
    for item in overrides:
        key, _, raw = item.partition("=")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        *parents, leaf = key.split(".")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = value
    return from_config_dict(c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/multihop.py:smollm2,cpu")
    ap.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    ap.add_argument("--policy_workdir", default="", help="restore its latest checkpoint as the policy")
    ap.add_argument("--layouts", default="paths,packed")
    ap.add_argument("--remats", default="layer,none")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="workdir/bench_rl_step_phases.json")
    args = ap.parse_args()

    gflops = matmul_gflops()
    bandwidth = read_bandwidth_gbps()["best_gbps"]
    cfg = load_config(args.config, args.set)
    cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=0))  # no cold start here
    workdir = tempfile.mkdtemp(prefix="rl_step_phases_")
    trainer = Trainer(cfg, workdir)
    state, shardings = create_train_state(trainer.model, cfg.optim, mesh=trainer.mesh)
    if args.policy_workdir:
        ckpt = Checkpointer(args.policy_workdir, CheckpointConfig())
        step = ckpt.latest_step()
        state, _, _ = ckpt.restore(step, abstract_state=state, with_reference=False)
        ckpt.close()
        print(f"policy: {args.policy_workdir} step {step}")
    trainer.engine = trainer._make_engine(state)
    rows = next(trainer.loader)

    t0 = time.perf_counter()
    trees, stats = rollout(
        trainer.engine,
        trainer.env,
        rows,
        cfg.tree,
        cfg.agent,
        key=jax.random.key(cfg.run.seed),
        prompt_uids=list(range(len(rows))),
        scheduler=cfg.rollout,
    )
    rollout_s = time.perf_counter() - t0
    rstats = stats.as_dict()
    trainer.engine = None  # its K/V pool (slots × context × layers) is not part of an update's memory
    gc.collect()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n_params = trainer.model_cfg.num_params
    print(
        f"rollout: {rollout_s:.1f} s for {len(rows)} prompts ({sum(len(t.leaves()) for t in trees)} leaves, "
        f"{rstats['decoded_tokens']:.0f} decoded tokens; decode {rstats['time_decode']:.1f} s)"
    )

    def write() -> None:  # after every case: a long run killed midway keeps what it measured
        out = dict(
            config=args.config,
            overrides=args.set,
            policy_workdir=args.policy_workdir,
            matmul_gflops=gflops,
            read_gbps=bandwidth,
            num_params=n_params,
            prompts=len(rows),
            rollout_s=rollout_s,
            rollout=rstats,
            passes=results,
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))

    results = []
    remats = [Remat(r) for r in args.remats.split(",")]
    for kind in [LayoutKind(k) for k in args.layouts.split(",")]:
        layout = dataclasses.replace(trainer.layout, kind=kind)
        batch = multihost.step_batch(trees, layout, trainer.mesh, 0)
        slots = int(np.prod(batch.tokens.shape))
        real = int(np.asarray(batch.valid if kind == LayoutKind.PATHS else batch.segment > 0).sum())
        print(f"{kind.value}: batch {list(batch.tokens.shape)} ({real} tokens in {slots} slots)", flush=True)
        for remat in remats:
            trainer.model.cfg = dataclasses.replace(trainer.model_cfg, remat=remat)
            st, _ = create_train_state(trainer.model, cfg.optim, mesh=trainer.mesh)
            st = st.replace(params=jax.tree.map(lambda x: x.copy(), state.params))
            graphdef = st.graphdef
            fwd = jax.jit(lambda p, b, gd=graphdef: _forward_all(gd, p, prepare(b, cfg.loss).rows, None))
            t0 = time.perf_counter()
            fwd_c = fwd.lower(st.params, batch).compile()
            fwd_compile = time.perf_counter() - t0
            fwd_s = median_time(lambda c=fwd_c, p=st.params, b=batch: c(p, b), args.repeats)
            print(f"  remat={remat.value}: forward {fwd_s:.1f} s (compile {fwd_compile:.0f} s)", flush=True)

            step = jit_train_step(shardings, loss_cfg=cfg.loss, optim_cfg=cfg.optim, mesh=trainer.mesh)
            t0 = time.perf_counter()
            step_c = step.lower(st, batch, None).compile()
            step_compile = time.perf_counter() - t0
            box = {"state": st}
            temp = step_c.memory_analysis().temp_size_in_bytes
            if temp + 4 * n_params * 4 > 0.9 * ram:  # XLA's own plan says it cannot fit: do not run it
                print(f"  remat={remat.value}: update needs {temp / 2**30:.1f} GiB of temporaries; not run")
                results.append(dict(layout=kind.value, remat=remat.value, planned_temp_gib=temp / 2**30))
                write()
                continue

            def update(c=step_c, box=box, b=batch):
                box["state"], m = c(box["state"], b, None)
                return m

            try:
                update_s = median_time(update, args.repeats)
            except jax.errors.JaxRuntimeError as e:  # remat=none can ask for more than the machine has
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                print(f"{kind.value:7s} remat={remat.value:5s} update: out of memory ({str(e)[:120]})")
                results.append(dict(layout=kind.value, remat=remat.value, error=str(e)[:300]))
                write()
                continue
            passes = 3 + (1 if remat != Remat.NONE else 0) + (1 if batch.tokens.shape[0] > 1 else 0)
            row = dict(
                layout=kind.value,
                remat=remat.value,
                batch_shape=list(batch.tokens.shape),
                token_slots=slots,
                real_tokens=real,
                forward_s=fwd_s,
                forward_compile_s=fwd_compile,
                forward_of_peak=2 * n_params * slots / fwd_s / 1e9 / gflops,
                update_s=update_s,
                update_compile_s=step_compile,
                update_passes=passes,
                update_of_peak=passes * 2 * n_params * slots / update_s / 1e9 / gflops,
                peak_temp_gib=step_c.memory_analysis().temp_size_in_bytes / 2**30,
            )
            results.append(row)
            write()
            print(
                f"{kind.value:7s} remat={remat.value:5s} {row['batch_shape']} forward {fwd_s:6.1f} s "
                f"({row['forward_of_peak']:.2f} of peak) update {update_s:6.1f} s "
                f"({row['update_of_peak']:.2f}; compile {step_compile:.0f} s, "
                f"temp {row['peak_temp_gib']:.1f} GiB)"
            )
    print(f"ceilings: matmul {gflops:.0f} GFLOP/s, read {bandwidth:.1f} GB/s; wrote {args.out}")


if __name__ == "__main__":
    main()
