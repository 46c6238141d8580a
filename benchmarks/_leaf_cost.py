"""`rollout.py --parts=leaf_cost` (issue 26): what a leaf costs, tree against chain, in seconds.

On the policy of `_policy.py` (pass `make demo`'s `--policy_workdir=workdir/tiny` and its
`--policy_step`) and its first `--scheduler_prompts` train questions, one engine of 6 slots
per prompt, in-process BM25: tree (2,2,1) and chain 6 (6 leaves per prompt each), each through
the scheduler (its defaults, and without each of its knobs) and the lock-step loop; both
drivers also with searches over HTTP, `--latency_ms` added to each by the chaos proxy. Two
warm-up keys per case compile the shape buckets; then `--repeats` rounds, every case
interleaved in a rotating order within a round (load on the shared machine hits all alike),
each round its own key. Medians throughout.

Keys: `tree_vs_chain_wall_per_leaf` beside `tree_vs_chain_decoded_per_leaf` (the token
saving the wall should show), `scheduler_speedup_vs_lockstep` (tree) and its chain twin,
the same three over HTTP (`..._http`), `tree_leaves_per_s`, `chain_leaves_per_s`,
`tree_vs_chain_gap` (the tree's excess over its token share, split into measured parts),
`prefill_fraction_of_rollout` (tree, scheduler:
seconds in appends over the wall), the whole phase split per case (decode, append, fork,
host, retrieval wait), and the decode step at the small dims of `_roofline.py` (embed 128,
4 heads, 2 KV heads, 4 layers; 128 rows × 256 live of a 1,024 pool, greedy, CPU kernel, f32
K/V) as a fraction of the read-bandwidth roofline measured in the same run
(`decode_fraction_of_roofline_small_b128`) and of the larger of the bandwidth and matmul
floors (`decode_fraction_of_max_bound_small_b128`).
"""

from __future__ import annotations

import dataclasses

import _roofline
import jax
import numpy as np
from _policy import SHAPES, engine_for, load_policy
from _scheduler import _http_retriever

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder

PHASES = ("decode", "append", "fork", "host", "retrieval_wait")


def _cases():
    from treegrpo_jax.rollout.scheduler import Driver, SchedulerConfig

    drivers = {
        "scheduler": SchedulerConfig(),
        "lockstep": SchedulerConfig(driver=Driver.LOCKSTEP),
        # The early-exit knob's previous default: a call returns once half its rows ended.
        "scheduler_exit0.5": SchedulerConfig(exit_fraction=0.5),
        # Without waiting for searches about to land (the default before `retrieval_sync`).
        "scheduler_nosync": SchedulerConfig(retrieval_sync=0.0),
        # Rows that ended ride along to the call's end (the engine before `shrink_to`).
        "scheduler_noshrink": SchedulerConfig(),
    }
    cases = {(shape, d): (SHAPES[shape], sched) for shape in SHAPES for d, sched in drivers.items()}
    # The same two drivers with searches over HTTP, `--latency_ms` added to each by the chaos
    # proxy: the latency the scheduler is built to hide (in-process BM25 answers in ~1 ms).
    for shape in SHAPES:
        for d in ("scheduler", "lockstep"):
            cases[(shape, f"{d}_http")] = (SHAPES[shape], drivers[d])
    return cases


def _summary(stats: list, walls: list[float]) -> dict:
    """Medians over the rounds of one case (token counts differ by key, so they are medians too)."""
    med = lambda f: float(np.median([f(s) for s in stats]))  # noqa: E731
    wall = float(np.median(walls))
    leaves = med(lambda s: s.leaves)
    return {
        "walls_s": walls,
        "wall_s": wall,
        "leaves": leaves,
        "leaves_per_s": float(np.median([s.leaves / w for s, w in zip(stats, walls, strict=True)])),
        "wall_per_leaf_s": float(np.median([w / s.leaves for s, w in zip(stats, walls, strict=True)])),
        "decoded_per_leaf": med(lambda s: s.decoded_tokens / s.leaves),
        "prefilled_per_leaf": med(lambda s: s.prefilled_tokens / s.leaves),
        "decode_calls": med(lambda s: s.decode_calls),
        "decode_steps": med(lambda s: s.decode_steps),
        "append_calls": med(lambda s: s.append_calls),
        "fork_calls": med(lambda s: s.fork_calls),
        "rows_per_step": med(lambda s: s.rows_in_flight),
        "waste_fraction": med(lambda s: s.waste_fraction),
        "row_steps_per_leaf": med(lambda s: s.row_steps / s.leaves),
        **{f"time_{p}_s": med(lambda s, p=p: getattr(s.times, p)) for p in PHASES},
        **{
            f"fraction_{p}": float(
                np.median([getattr(s.times, p) / w for s, w in zip(stats, walls, strict=True)])
            )
            for p in PHASES
        },
    }


def _gap(runs: dict, tree: str = "tree/scheduler", chain: str = "chain/scheduler") -> dict:
    """Where the tree's wall per leaf exceeds `r` × the chain's (r: their decoded-token ratio),
    in ms per leaf, split exactly into measured parts: decode as row-steps per leaf × seconds
    per row-step — the tree computing more row-steps than r × the chain's (`decode_row_steps`),
    and each of its row-steps costing more (`decode_cost_per_row_step`: fewer rows to share a
    step's weight reads and a call's fixed cost, longer contexts) — then forks, appends, host
    work, retrieval waits and the wall no phase timed (`other`)."""
    t, c = runs[tree], runs[chain]
    r = t["decoded_per_leaf"] / c["decoded_per_leaf"]
    ms_leaf = lambda q, key: 1e3 * q[key] / q["leaves"]  # noqa: E731
    cost = lambda q: q["time_decode_s"] / (q["row_steps_per_leaf"] * q["leaves"])  # noqa: E731
    parts = {
        "decode_row_steps": 1e3 * cost(c) * (t["row_steps_per_leaf"] - r * c["row_steps_per_leaf"]),
        "decode_cost_per_row_step": 1e3 * t["row_steps_per_leaf"] * (cost(t) - cost(c)),
    }
    for phase in PHASES[1:]:
        parts[phase] = ms_leaf(t, f"time_{phase}_s") - r * ms_leaf(c, f"time_{phase}_s")
    untimed = lambda q: 1e3 * (q["wall_s"] - sum(q[f"time_{p}_s"] for p in PHASES)) / q["leaves"]  # noqa: E731
    parts["other"] = untimed(t) - r * untimed(c)
    return {
        "decoded_ratio": r,
        # wall_s / leaves, the quantity split above (a median of walls over a median of leaves,
        # within a hair of the median of per-round ratios that `wall_per_leaf_s` is)
        "excess_ms_per_leaf": 1e3 * (t["wall_s"] / t["leaves"] - r * c["wall_s"] / c["leaves"]),
        "parts_ms_per_leaf": parts,
        "chain_ms_per_leaf": 1e3 * c["wall_s"] / c["leaves"],
        "row_steps_ratio": t["row_steps_per_leaf"] / c["row_steps_per_leaf"],
        "cost_per_row_step_us": {"tree": 1e6 * cost(t), "chain": 1e6 * cost(c)},
    }


def _small_decode(bc) -> dict:
    """The decode step at the small dims against this machine's ceilings, measured around it."""
    before, gflops = _roofline.read_bandwidth_gbps(), _roofline.matmul_gflops()
    cfg = ModelConfig(**_roofline.TINY_DIMS, tie_embeddings=True)
    model = init_model(cfg, seed=bc.seed)
    case = _roofline.Case(128, 256, False, "native", "float32")
    ms = _roofline._time_cases(model, [case], steps=_roofline.STEPS, pool_len=_roofline.POOL_LEN,
                               repeats=bc.repeats)[case]  # fmt: skip
    ceilings = _roofline._ceilings(before, _roofline.read_bandwidth_gbps(), gflops)
    row = _roofline._row(cfg, case, ms, ceilings, _roofline.STEPS)
    # The step's own GEMMs alone (128 rows × 128-wide weights), best of several: the compute
    # floor at these shapes, which the 1024³ rate above overstates several times.
    shaped, flops = _roofline.step_matmul_ms(cfg, batch=case.batch)
    return row | {
        "ceilings": ceilings,
        "step_matmul_ms": shaped,
        "step_matmul_gflops": flops / shaped / 1e6,
        "fraction_of_step_matmuls": shaped / ms,
        "fraction_of_shaped_bound": (row["roofline_ms"] + shaped) / ms,
    }


def run_leaf_cost(bc, model: Decoder, cfg: ModelConfig) -> dict:
    """Tree vs chain, scheduler vs lock-step, per leaf in seconds (see the module docstring)."""
    del model, cfg
    pol = load_policy(bc, bc.scheduler_prompts)
    rows = list(pol.rows)
    engine = engine_for(pol, len(rows))
    cases = _cases()
    with _http_retriever(list(pol.corpus), bc.latency_ms / 1000) as http:
        return _measure(bc, pol, rows, engine, cases, dataclasses.replace(pol.env, retriever=http))


def _measure(bc, pol, rows, engine, cases, http_env) -> dict:
    from treegrpo_jax.rollout.tree_search import rollout

    shrink_to = engine.shrink_to

    def run(case, key):
        shape, sched = cases[case]
        engine.shrink_to = 0 if case[1].endswith("noshrink") else shrink_to
        env = http_env if case[1].endswith("_http") else pol.env
        return rollout(engine, env, rows, shape, pol.agent, key=key, scheduler=sched)[1]

    for case in cases:
        for warm in (1000, 1001):
            run(case, jax.random.key(warm))
    print("  leaf_cost: compiled", flush=True)
    stats: dict = {c: [] for c in cases}
    names = list(cases)
    for r in range(bc.repeats):
        for case in names[r % len(names) :] + names[: r % len(names)]:
            stats[case].append(run(case, jax.random.key(bc.seed + 1 + r)))
    runs = {c: _summary(s, [x.wall for x in s]) for c, s in stats.items()}
    named = {"/".join(c): v for c, v in runs.items()}
    small = _small_decode(bc)
    get = lambda shape, drv, k: runs[(shape, drv)][k]  # noqa: E731
    tree_vs_chain = lambda k, drv="scheduler": get("tree", drv, k) / get("chain", drv, k)  # noqa: E731
    speedup = lambda shape, over="": (  # noqa: E731
        get(shape, f"scheduler{over}", "leaves_per_s") / get(shape, f"lockstep{over}", "leaves_per_s")
    )
    return {
        "tree_vs_chain_wall_per_leaf": tree_vs_chain("wall_per_leaf_s"),
        "tree_vs_chain_decoded_per_leaf": tree_vs_chain("decoded_per_leaf"),
        "scheduler_speedup_vs_lockstep": speedup("tree"),
        "chain_scheduler_speedup_vs_lockstep": speedup("chain"),
        "scheduler_speedup_vs_lockstep_http": speedup("tree", "_http"),
        "chain_scheduler_speedup_vs_lockstep_http": speedup("chain", "_http"),
        "tree_vs_chain_wall_per_leaf_http": tree_vs_chain("wall_per_leaf_s", "scheduler_http"),
        "tree_leaves_per_s": get("tree", "scheduler", "leaves_per_s"),
        "chain_leaves_per_s": get("chain", "scheduler", "leaves_per_s"),
        "prefill_fraction_of_rollout": get("tree", "scheduler", "fraction_append"),
        "decode_fraction_of_roofline_small_b128": small["fraction_of_roofline"],
        "decode_fraction_of_max_bound_small_b128": small["fraction_of_max_bound"],
        "decode_fraction_of_shaped_bound_small_b128": small["fraction_of_shaped_bound"],
        "leaf_cost": {
            "policy": pol.name,
            "prompts": len(rows),
            "repeats": bc.repeats,
            "http_latency_ms": bc.latency_ms,
            "runs": named,
            "small_decode": small,
            "tree_vs_chain_gap": _gap(named),
            "tree_vs_chain_gap_lockstep": _gap(named, "tree/lockstep", "chain/lockstep"),
        },
    }


def print_leaf_cost(result: dict) -> None:
    if "leaf_cost" not in result:
        return
    r = result["leaf_cost"]
    print(f"\nWhat a leaf costs: {r['prompts']} prompts × 6 leaves, {r['policy']}, BM25, "
          f"median of {r['repeats']} interleaved rounds")  # fmt: skip
    head = ("case", "leaves/s", "ms/leaf", "tok/leaf", "dec calls", "steps", "rows/step", "appends",
            "decode", "append", "fork", "host")  # fmt: skip
    print(f"{head[0]:26}" + "".join(f"{h:>10}" for h in head[1:]))
    for name, q in r["runs"].items():
        print(f"{name:26}{q['leaves_per_s']:10.1f}{1e3 * q['wall_per_leaf_s']:10.2f}"
              f"{q['decoded_per_leaf']:10.1f}{q['decode_calls']:10.0f}{q['decode_steps']:10.0f}"
              f"{q['rows_per_step']:10.1f}{q['append_calls']:10.0f}"
              + "".join(f"{q[f'fraction_{p}']:10.0%}" for p in PHASES[:4]))  # fmt: skip
    s = r["small_decode"]
    print(f"small-dims decode step (B=128, U=256): {s['ms_per_step']:.2f} ms; memory floor "
          f"{s['roofline_ms']:.2f} ms at {s['ceilings']['best_gbps']:.1f} GB/s, matmul floor "
          f"{s['flop_ms']:.2f} ms at {s['ceilings']['matmul_gflops']:.0f} GFLOP/s; the step's own "
          f"matmuls alone {s['step_matmul_ms']:.2f} ms")  # fmt: skip
    for name in ("tree_vs_chain_gap", "tree_vs_chain_gap_lockstep"):
        g = r[name]
        parts = ", ".join(f"{k} {v:+.3f}" for k, v in g["parts_ms_per_leaf"].items())
        us = g["cost_per_row_step_us"]
        print(f"{name}: tree − {g['decoded_ratio']:.3f} × chain = {g['excess_ms_per_leaf']:+.3f} ms per leaf "
              f"(chain {g['chain_ms_per_leaf']:.2f}; row-steps ratio {g['row_steps_ratio']:.3f}, µs per "
              f"row-step {us['tree']:.1f} vs {us['chain']:.1f}): {parts}")  # fmt: skip
    for key in ("tree_vs_chain_wall_per_leaf", "tree_vs_chain_decoded_per_leaf",
                "scheduler_speedup_vs_lockstep", "chain_scheduler_speedup_vs_lockstep",
                "tree_leaves_per_s", "chain_leaves_per_s",
                "prefill_fraction_of_rollout", "decode_fraction_of_roofline_small_b128",
                "decode_fraction_of_max_bound_small_b128",
                "decode_fraction_of_shaped_bound_small_b128"):  # fmt: skip
        print(f"{key}: {result[key]:.3f}")
