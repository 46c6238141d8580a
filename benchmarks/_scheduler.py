"""`rollout.py --parts=scheduler`: the continuous-batching scheduler against the lock-step loop
on tree and chain, in-process BM25 and HTTP behind the chaos proxy; its knobs; SIGTERM → exit."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import time

import jax
import numpy as np
from _policy import SHAPES, engine_for, load_policy

from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder


@contextlib.contextmanager
def _http_retriever(texts: list[str], latency_s: float):
    """Our HTTP retrieval server (BM25 over `texts`) behind the chaos proxy adding `latency_s`."""
    import threading

    from treegrpo_jax.env.bm25 import BM25Retriever
    from treegrpo_jax.env.http_client import HttpRetriever, HttpRetrieverConfig
    from treegrpo_jax.env.retrieval_server import ServerConfig, make_server
    from treegrpo_jax.testing.chaos_proxy import ChaosConfig, ChaosProxy, Fault

    server = make_server(BM25Retriever.from_texts(texts), ServerConfig(port=0))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    try:
        with ChaosProxy(url, ChaosConfig(rates=((Fault.LATENCY, 1.0),), latency_s=latency_s)) as proxy:
            yield HttpRetriever(HttpRetrieverConfig(url=proxy.url, timeout_s=10.0))
    finally:
        server.shutdown()


def _rollout_row(stats, wall: float) -> dict:
    return stats.as_dict() | {
        "wall_s": wall,
        "leaves_per_s": stats.leaves / wall,
        "decoded_tok_per_s": stats.decoded_tokens / wall,
        "wall_per_leaf_s": wall / stats.leaves,
        "decoded_per_leaf": stats.decoded_tokens / stats.leaves,
    }


def run_scheduler(bc, model: Decoder, cfg: ModelConfig) -> dict:
    """Continuous-batching scheduler vs the lock-step loop on tree (2,2,1) and chain 6.

    Same engine, policy, prompts and key for both drivers; in-process BM25, then the HTTP
    retriever behind the chaos proxy adding `--latency_ms` per request. Then the knobs
    (quantum, early exit, admission into a pool that holds a quarter of the prompts) on the
    tree/BM25 workload, and the time from SIGTERM to exit of a `:tiny` run.
    """
    del model, cfg
    from treegrpo_jax.rollout.scheduler import Driver, SchedulerConfig
    from treegrpo_jax.rollout.tree_search import rollout

    pol = load_policy(bc, bc.scheduler_prompts)
    env, agent, rows, shapes = pol.env, pol.agent, list(pol.rows), SHAPES
    drivers = {"lockstep": SchedulerConfig(driver=Driver.LOCKSTEP), "scheduler": SchedulerConfig()}
    engine = engine_for(pol, len(rows))

    def measure(cases: dict, envs: dict) -> dict:
        # Compile the shape buckets first: two keys each, so the timed runs meet few new shapes.
        for (shape, _, ret), sched in list(cases.items()) * 2:
            warm = jax.random.key(1000 + len(shapes[shape].__repr__()) + hash(ret) % 7)
            rollout(engine, envs[ret], rows, shapes[shape], agent, key=warm, scheduler=sched)
        walls, stats = {c: [] for c in cases}, {}
        for r in range(bc.repeats):
            for case, sched in cases.items():  # interleaved: machine load hits every case alike
                shape, _, ret = case
                t0 = time.perf_counter()
                _, stats[case] = rollout(
                    engine,
                    envs[ret],
                    rows,
                    shapes[shape],
                    agent,
                    key=jax.random.key(bc.seed + 1 + r),
                    scheduler=sched,
                )
                walls[case].append(time.perf_counter() - t0)
        return {c: _rollout_row(stats[c], float(np.median(walls[c]))) | {"walls_s": walls[c]} for c in cases}

    texts = list(pol.corpus)
    out: dict = {"prompts": len(rows), "latency_ms": bc.latency_ms}
    with _http_retriever(texts, bc.latency_ms / 1000) as http:
        envs = {"bm25": env, "http": dataclasses.replace(env, retriever=http)}
        cases = {(s, d, r): drivers[d] for s in shapes for d in drivers for r in envs}
        res = measure(cases, envs)
    out["runs"] = {"/".join(k): v for k, v in res.items()}

    def get(shape, drv, ret, key):
        return res[(shape, drv, ret)][key]

    speed = get("tree", "scheduler", "bm25", "leaves_per_s") / get("tree", "lockstep", "bm25", "leaves_per_s")
    slow = {d: get("tree", d, "http", "wall_s") / get("tree", d, "bm25", "wall_s") - 1.0 for d in drivers}
    out |= {
        "scheduler_speedup_vs_lockstep": speed,
        "chain_scheduler_speedup_vs_lockstep": get("chain", "scheduler", "bm25", "leaves_per_s")
        / get("chain", "lockstep", "bm25", "leaves_per_s"),
        "tree_vs_chain_wall_per_leaf": get("tree", "scheduler", "bm25", "wall_per_leaf_s")
        / get("chain", "scheduler", "bm25", "wall_per_leaf_s"),
        "tree_vs_chain_decoded_per_leaf": get("tree", "scheduler", "bm25", "decoded_per_leaf")
        / get("chain", "scheduler", "bm25", "decoded_per_leaf"),
        "lockstep_tree_vs_chain_wall_per_leaf": get("tree", "lockstep", "bm25", "wall_per_leaf_s")
        / get("chain", "lockstep", "bm25", "wall_per_leaf_s"),
        "latency_slowdown_scheduler": slow["scheduler"],
        "latency_slowdown_lockstep": slow["lockstep"],
        "occupancy": get("tree", "scheduler", "bm25", "occupancy"),
        "waste_fraction": get("tree", "scheduler", "bm25", "waste_fraction"),
        "lockstep_occupancy": get("tree", "lockstep", "bm25", "occupancy"),
        "lockstep_waste_fraction": get("tree", "lockstep", "bm25", "waste_fraction"),
    }
    small = engine_for(pol, len(rows) // 4)
    out["knobs"] = _scheduler_knobs(bc, {None: engine, "small": small}, env, rows, shapes["tree"], agent)
    out["sigterm"] = _sigterm_exit(bc)
    out["sigterm_exit_s"] = max((v["exit_s"] for v in out["sigterm"].values()), default=None)
    return {"scheduler": out}


def _scheduler_knobs(bc, engines, env, rows, shape, agent) -> dict:
    """Leaves/s of the tree/BM25 workload per quantum, early exit and admission rule."""
    from treegrpo_jax.rollout.scheduler import SchedulerConfig
    from treegrpo_jax.rollout.tree_search import rollout

    cases = {
        f"quantum={q},exit={e}": (SchedulerConfig(quantum=q, exit_fraction=e), None)
        for q in (8, 16, 32)
        for e in (0.25, 1.0)
    }
    # Admission: a pool of a quarter of the prompts' slots, so prompts queue and join as trees
    # finish: one at a time (every join a prefill), four, or a quarter of them (wave-like).
    for a in (1, 4, len(rows) // 4):
        cases[f"pool/4,admit={a}"] = (SchedulerConfig(admit_prompts=a), "small")
    for sched, pool in cases.values():
        for warm in (0, 1000):
            rollout(engines[pool], env, rows, shape, agent, key=jax.random.key(warm), scheduler=sched)
    walls: dict[str, list[float]] = {c: [] for c in cases}
    leaves = {}
    for r in range(bc.repeats):
        for name, (sched, pool) in cases.items():
            t0 = time.perf_counter()
            key = jax.random.key(bc.seed + 1 + r)
            _, st = rollout(engines[pool], env, rows, shape, agent, key=key, scheduler=sched)
            walls[name].append(time.perf_counter() - t0)
            leaves[name] = st.leaves
    return {
        name: {"leaves_per_s": leaves[name] / float(np.median(w)), "walls_s": w} for name, w in walls.items()
    }


def _sigterm_exit(bc) -> dict:
    """Seconds from SIGTERM to exit of `launch/train.py` (a short `:tiny` run), during a rollout
    and during an evaluation; the exit code and whether the resumable state was saved."""
    import signal
    import subprocess
    import tempfile

    if not bc.sigterm:
        return {}
    repo = pathlib.Path(__file__).resolve().parents[1]
    out = {}
    # Sizes: a short cold start, then steps long enough to land in; eval_every picks the phase.
    for phase, eval_every, trigger_step in (("rollout", 100, 1), ("evaluation", 2, 2)):
        with tempfile.TemporaryDirectory() as workdir:
            cmd = [
                sys.executable,
                str(repo / "launch" / "train.py"),
                "--config=configs/multihop.py:tiny",
                f"--workdir={workdir}",
                "--config.sft.steps=20",
                "--config.run.steps=4",
                "--config.run.prompts_per_step=16",
                f"--config.run.eval_every={eval_every}",
                "--config.data.eval_prompts=320",
                "--config.run.tensorboard=False",
            ]
            proc = subprocess.Popen(
                cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            metrics = pathlib.Path(workdir) / "metrics.jsonl"
            deadline = time.time() + 900
            while time.time() < deadline and proc.poll() is None:
                if metrics.exists() and any(
                    json.loads(line).get("step") == trigger_step and "train/reward_mean" in line
                    for line in metrics.read_text().splitlines()
                ):
                    break
                time.sleep(0.05)
            t0 = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            log, _ = proc.communicate(timeout=300)
            exit_s = time.perf_counter() - t0
            saved = sorted(os.listdir(pathlib.Path(workdir) / "checkpoints"))
            out[phase] = {
                "exit_s": exit_s,
                "returncode": proc.returncode,
                "checkpoints": saved,
                "said": [line for line in log.splitlines() if line.startswith("SIGTERM")][-1:],
            }
    return out


def print_scheduler(result: dict) -> None:
    if "scheduler" not in result:
        return
    r = result["scheduler"]
    print(f"\nScheduler vs lock-step, {r['prompts']} prompts, 6 leaves each (median walls; HTTP: "
          f"+{r['latency_ms']:.0f} ms per search through the chaos proxy)")  # fmt: skip
    head = ("workload", "leaves/s", "tok/s", "occupancy", "waste", "ret. wait s", "wall s")
    print(f"{head[0]:28}" + "".join(f"{h:>12}" for h in head[1:]))
    for name, row in r["runs"].items():
        print(f"{name:28}{row['leaves_per_s']:12.1f}{row['decoded_tok_per_s']:12.0f}"
              f"{row['occupancy']:12.2f}{row['waste_fraction']:12.2f}"
              f"{row['time_retrieval_wait']:12.2f}{row['wall_s']:12.2f}")  # fmt: skip
    for key in ("scheduler_speedup_vs_lockstep", "chain_scheduler_speedup_vs_lockstep",
                "tree_vs_chain_wall_per_leaf", "tree_vs_chain_decoded_per_leaf",
                "lockstep_tree_vs_chain_wall_per_leaf", "latency_slowdown_scheduler",
                "latency_slowdown_lockstep", "sigterm_exit_s"):  # fmt: skip
        value = r.get(key)
        print(f"{key}: {'n/a' if value is None else f'{value:.3f}'}")
    print("knobs (tree, BM25): " + ", ".join(f"{k} {v['leaves_per_s']:.1f}/s" for k, v in r["knobs"].items()))
    for phase, v in r["sigterm"].items():
        print(f"SIGTERM during {phase}: exit {v['returncode']} after {v['exit_s']:.1f} s, "
              f"checkpoints {v['checkpoints']}, said {v['said']}")  # fmt: skip
