"""`benchmarks/rollout.py --parts=paged` (issue 17): the paged KV cache against the slot cache.

Legend: B rows, U live keys, P tokens per page, S shared-prefix keys, H/K/D heads, kv heads,
head dim.

Four measurements, each ours-vs-peer in the same process run, repeats interleaved:

  1. memory: a (2,2,1) rollout of `--scheduler_prompts` `:tiny` prompts through the scheduler
     with the slot cache and with pages of 16 / 32 / 64 tokens; peak K/V bytes held over
     (unique tokens × bytes per token) — 1.0 holds nothing the trees do not need;
  2. one K/V budget (`--paged_budget_mib`), the same rollout with `:tiny` dims and with
     SmolLM2-135M: the slot engine gets budget / (max_len × bytes per token) slots, the paged
     engine that many bytes of pages and sequences to spare; rows in flight (rows per decode
     step) and leaves/s;
  3. the decode step at equal rows (B = 32, U = 512 live keys, `:tiny` dims), paged vs slots,
     the CPU kernel (the default) and the XLA path; the read bandwidth of a jitted sum over
     256 MiB measured in the same run is the ceiling;
  4. cascade attention: 6 rows sharing an S-token prefix with 64 own keys each (SmolLM2's
     9 heads / 3 kv heads / 64 dims, one layer), against per-row attention (the XLA reference
     and the CPU kernel), S = 64 … 2048: the speedup at S = 1024 and the crossover.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import _roofline
import jax
import jax.numpy as jnp
import numpy as np
from _policy import load_policy

from treegrpo_jax.env.actions import STOP_SEQUENCES
from treegrpo_jax.model.cascade_attention import cascade_attention
from treegrpo_jax.model.decode_attention import decode_attention_native, decode_attention_xla
from treegrpo_jax.native import build as native_build
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.sampling import SamplingParams

MAX_LEN = 768  # the scheduler part's context (the `:tiny` workload)
SHAPE = dict(num_trees=2, num_picks=2, num_rounds=1)


def _median_interleaved(cases: dict, repeats: int) -> dict[str, list[float]]:
    """Runs every case once per round, in a rotating order; returns its wall times."""
    walls = {name: [] for name in cases}
    names = list(cases)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            cases[name]()
            walls[name].append(time.perf_counter() - t0)
    return walls


def _engine(policy, tok, table, *, slots, max_len=MAX_LEN, **paged):
    return Engine(
        policy, num_slots=slots, max_len=max_len, eos_ids=tok.eos_ids, stop_table=table, min_rows=8, **paged
    )


def _rollouts(bc, engines: dict, env, rows, agent, *, repeats: int, warmups: int = 2) -> dict:
    """One (2,2,1) rollout per engine per round (after warm-up keys); stats and medians."""
    from treegrpo_jax.rollout.tree_search import TreeSearchConfig, rollout

    shape = TreeSearchConfig(**SHAPE)
    for name, engine in engines.items():
        for warm in range(1000, 1000 + warmups):
            rollout(engine, env, rows, shape, agent, key=jax.random.key(warm))
        print(f"  paged: warmed {name}", flush=True)
    stats = {}

    def case(name):
        def run():
            _, stats[name] = rollout(engines[name], env, rows, shape, agent, key=jax.random.key(bc.seed + 1))

        return run

    walls = _median_interleaved({n: case(n) for n in engines}, repeats)
    out = {}
    for name, st in stats.items():
        wall = float(np.median(walls[name]))
        out[name] = {
            "wall_s": wall,
            "walls_s": walls[name],
            "leaves_per_s": st.leaves / wall,
            "rows_in_flight": st.rows_in_flight,
            "unique_tokens": st.unique_tokens,
            "kv_peak_tokens": st.kv_peak_tokens,
            "kv_peak_bytes": st.kv_peak_bytes,
            "kv_peak_over_unique": st.kv_peak_over_unique,
            "cow_pages": st.cow_pages,
            "preempted_prompts": st.preempted_prompts,
            "decoded_tokens": st.decoded_tokens,
            "leaves": st.leaves,
        }
    return out


def _memory(bc, policy, tok, env, agent, rows, table) -> dict:
    n = len(rows) * 6
    engines = {"slots": _engine(policy, tok, table, slots=n)}
    for p in (16, 32, 64):
        engines[f"paged{p}"] = _engine(policy, tok, table, slots=n, kv_layout="paged", page_size=p)
    return _rollouts(bc, engines, env, rows, agent, repeats=bc.repeats)


def _budget(bc, name, policy, tok, env, agent, rows, table, *, max_len, repeats, budget_mib, warmups=2):
    """Slots vs pages in one K/V budget: the slot engine gets what the budget holds in slots."""
    probe = _engine(policy, tok, table, slots=1, max_len=max_len)
    per_token = probe.kv_bytes_per_token
    budget = budget_mib * 2**20
    slots = budget // (max_len * per_token)
    if slots < 6:
        raise ValueError(f"paged budget {budget_mib} MiB: {slots} slots of {max_len} for {name} < 6")
    pages = budget // (16 * per_token)
    engines = {
        "slots": _engine(policy, tok, table, slots=int(slots), max_len=max_len),
        "paged": _engine(
            policy,
            tok,
            table,
            slots=len(rows) * 6,
            max_len=max_len,
            kv_layout="paged",
            page_size=16,
            num_pages=int(pages),
        ),
    }
    out = _rollouts(bc, engines, env, rows, agent, repeats=repeats, warmups=warmups)
    out["budget_mib"] = budget_mib
    out["slots"]["pool_slots"] = int(slots)
    out["paged"]["pool_pages"] = int(pages)
    out["rows_in_flight_ratio"] = out["paged"]["rows_in_flight"] / out["slots"]["rows_in_flight"]
    out["leaves_per_s_ratio"] = out["paged"]["leaves_per_s"] / out["slots"]["leaves_per_s"]
    print(f"  paged: budget {name} done", flush=True)
    return out


def _decode_step(bc, model, *, batch=32, live=512, steps=16) -> dict:
    """ms per decode step at equal rows and context: slots vs pages, kernel and XLA paths."""
    kernels = ["xla"] + (["native"] if native_build.available() else [])
    engines, slots_of = {}, {}
    for k in kernels:
        for layout in ("slots", "paged"):
            paged = dict(kv_layout="paged", page_size=16) if layout == "paged" else {}
            e = Engine(model, num_slots=batch, max_len=1024, kernels=k, **paged)
            s = e.allocate(batch)
            prefix = list(np.random.default_rng(0).integers(1, model.cfg.vocab_size, live))
            # Every row its own copy of the context (a fork would share the pages, and rows
            # reading the same pages would hit in cache: not the comparison wanted here).
            e.append(dict.fromkeys(s, prefix))
            engines[f"{layout}/{k}"], slots_of[f"{layout}/{k}"] = e, s
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), batch)))
    sampling = SamplingParams.make(batch)
    lengths = {name: e.lengths.copy() for name, e in engines.items()}

    def case(name):
        def run():
            e = engines[name]
            e.decode(slots_of[name], max_new_tokens=steps, sampling=sampling, keys=keys, num_steps=steps)
            # Back to the same context (host lengths, device lengths, pages), so that every
            # call decodes the same span: a benchmark-only rewind through the engine's state.
            e.rewind(slots_of[name], [lengths[name][s] for s in slots_of[name]])

        return run

    cases = {name: case(name) for name in engines}
    for run in cases.values():
        run()
    walls = _median_interleaved(cases, max(bc.repeats, 5))
    ms = {name: 1e3 * float(np.median(w)) / steps for name, w in walls.items()}
    bw = _roofline.read_bandwidth_gbps()
    per_token = engines["slots/xla"].kv_bytes_per_token
    kv_gb = batch * live * per_token / 1e9
    out = {"batch": batch, "live": live, "ms_per_step": ms, "read_bandwidth": bw}
    out["kv_read_fraction_of_bandwidth"] = {n: kv_gb / (m / 1e3) / bw["best_gbps"] for n, m in ms.items()}
    best = "native" if "native" in kernels else "xla"
    out["paged_step_ratio"] = ms[f"slots/{best}"] / ms[f"paged/{best}"]  # ≥ 1: paged as fast
    out["paged_step_ratio_xla"] = ms["slots/xla"] / ms["paged/xla"]
    return out


def _ready(fn, *args):
    out = fn(*args)
    return jax.block_until_ready(out[0] if isinstance(out, tuple) else out)


def _loop(fn, n):
    for _ in range(n):
        fn()


def _cascade(bc, *, rows=6, own=64, heads=9, kv_heads=3, d=64) -> dict:
    """Attention time of 6 rows over an S-token shared prefix + 64 own keys: cascade vs per-row."""
    out = {}
    rng = jax.random.split(jax.random.key(0), 5)
    for s in (64, 128, 256, 512, 1024, 2048):
        q = jax.random.normal(rng[0], (1, rows, heads, d))
        sk = jax.random.normal(rng[1], (1, kv_heads, s, d))
        sv = jax.random.normal(rng[2], (1, kv_heads, s, d))
        ok = jax.random.normal(rng[3], (1, rows, kv_heads, own, d))
        ov = jax.random.normal(rng[4], (1, rows, kv_heads, own, d))
        s_len, o_len = jnp.asarray([s]), jnp.full((1, rows), own)
        # Per row: its prefix + own keys as one slot (what the engine's slot or page layout reads).
        slot_k = jnp.concatenate([jnp.broadcast_to(sk, (rows, kv_heads, s, d)), ok[0]], axis=2)[None]
        slot_v = jnp.concatenate([jnp.broadcast_to(sv, (rows, kv_heads, s, d)), ov[0]], axis=2)[None]
        lens = jnp.full((rows,), s + own, jnp.int32)
        slot_ids = jnp.arange(rows, dtype=jnp.int32)
        cas, xla = jax.jit(cascade_attention), jax.jit(decode_attention_xla)
        fns = {
            "cascade": functools.partial(_ready, cas, q, sk, sv, s_len, ok, ov, o_len),
            "per_row_xla": functools.partial(_ready, xla, q[0], slot_k, slot_v, 0, slot_ids, lens),
        }
        if native_build.available():
            zeros = jnp.zeros((rows, kv_heads, d))
            no_write = jnp.full((rows,), 1 << 30, jnp.int32)
            nat = jax.jit(functools.partial(decode_attention_native, paged=False))
            fns["per_row_native"] = functools.partial(
                _ready, nat, q[0], zeros, zeros, slot_k, slot_v, 0, slot_ids[:, None], no_write, lens
            )
        want = np.asarray(fns["per_row_xla"]())
        np.testing.assert_allclose(np.asarray(cas(q, sk, sv, s_len, ok, ov, o_len))[0], want, atol=1e-5)
        for f in fns.values():
            f()
        inner = 20
        walls = _median_interleaved({n: functools.partial(_loop, f, inner) for n, f in fns.items()}, 7)
        us = {n: 1e6 * float(np.median(w)) / inner for n, w in walls.items()}
        out[s] = {"us": us} | {f"speedup_vs_{n}": us[n] / us["cascade"] for n in us if n != "cascade"}
    best = "per_row_native" if native_build.available() else "per_row_xla"
    cross = next((s for s, r in out.items() if r[f"speedup_vs_{best}"] >= 1.0), None)
    return {
        "rows": rows,
        "own": own,
        "by_shared_len": out,
        "cascade_attention_speedup": out[1024][f"speedup_vs_{best}"],
        "cascade_attention_speedup_vs_xla": out[1024]["speedup_vs_per_row_xla"],
        "crossover_shared_len": cross,
        "baseline": best,
    }


def run_paged(bc, model, cfg) -> dict:
    del cfg
    pol = load_policy(bc, bc.scheduler_prompts)
    policy, tok, env, agent, table, rows = (
        pol.model,
        pol.tokenizer,
        pol.env,
        pol.agent,
        pol.stop_table,
        list(pol.rows),
    )
    out: dict = {"prompts": len(rows), "sections": list(bc.paged_sections)}
    want = set(bc.paged_sections)
    if "cascade" in want:
        out["cascade"] = _cascade(bc)
        print("  paged: cascade done", flush=True)
    if "decode" in want:
        out["decode_step"] = _decode_step(bc, model)
        print("  paged: decode step done", flush=True)
    if "memory" in want:
        out["memory"] = _memory(bc, policy, tok, env, agent, rows, table)
        print("  paged: memory done", flush=True)
    if "budget_tiny" in want:
        out["budget_tiny"] = _budget(
        bc, "tiny", policy, tok, env, agent, rows, table, max_len=MAX_LEN, repeats=bc.repeats,
        budget_mib=bc.paged_budget_mib,
        )  # fmt: skip
    if bc.kv_smollm2 and "budget_smollm2" in want:
        from treegrpo_jax.model import assets
        from treegrpo_jax.model.pretrained import load_pretrained
        from treegrpo_jax.rollout.agent import AgentEnv
        from treegrpo_jax.rollout.stops import make_stop_table, token_bytes

        smol, smol_cfg, smol_tok = load_pretrained(assets.smollm2_gguf_path(), dtype="float32")
        smol_env = dataclasses.replace(env, tokenizer=smol_tok)
        assert isinstance(smol_env, AgentEnv)
        smol_table = make_stop_table(token_bytes(smol_tok), STOP_SEQUENCES, vocab_size=smol_cfg.vocab_size)
        smol_rows = rows[: bc.paged_smollm2_prompts]
        out["budget_smollm2"] = _budget(
            bc, "smollm2", smol, smol_tok, smol_env, agent, smol_rows, smol_table, max_len=1024,
            repeats=bc.paged_smollm2_repeats, budget_mib=bc.paged_budget_mib_smollm2, warmups=1,
        )  # fmt: skip
    get = lambda section, *keys: functools.reduce(  # noqa: E731  (None where a section did not run)
        lambda d, k: d.get(k) if isinstance(d, dict) else None, keys, out.get(section)
    )
    out |= {
        "paged_kv_bytes_over_unique": get("memory", "paged16", "kv_peak_over_unique"),
        "slots_kv_bytes_over_unique": get("memory", "slots", "kv_peak_over_unique"),
        "paged_rows_in_flight_ratio": get("budget_tiny", "rows_in_flight_ratio"),
        "paged_leaves_per_s_ratio_tiny": get("budget_tiny", "leaves_per_s_ratio"),
        "paged_rows_in_flight_ratio_smollm2": get("budget_smollm2", "rows_in_flight_ratio"),
        "paged_leaves_per_s_ratio_smollm2": get("budget_smollm2", "leaves_per_s_ratio"),
        "paged_step_ratio": get("decode_step", "paged_step_ratio"),
        "cascade_attention_speedup": get("cascade", "cascade_attention_speedup"),
    }
    return {"paged": out}


def print_paged(result: dict) -> None:
    r = result.get("paged")
    if not r:
        return
    print("\n== paged KV cache (issue 17) ==")
    print(f"{'cache':>8} {'peak/unique':>11} {'peak MiB':>9} {'CoW pages':>9} {'leaves/s':>9}")
    for name, m in r.get("memory", {}).items():
        print(
            f"{name:>8} {m['kv_peak_over_unique']:>11.2f} {m['kv_peak_bytes'] / 2**20:>9.1f} "
            f"{m['cow_pages']:>9} {m['leaves_per_s']:>9.2f}"
        )
    for key in ("budget_tiny", "budget_smollm2"):
        if key in r:
            b = r[key]
            print(
                f"{key} ({b['budget_mib']} MiB): rows in flight {b['slots']['rows_in_flight']:.1f} → "
                f"{b['paged']['rows_in_flight']:.1f} ({b['rows_in_flight_ratio']:.2f}×), leaves/s "
                f"{b['slots']['leaves_per_s']:.2f} → {b['paged']['leaves_per_s']:.2f} "
                f"({b['leaves_per_s_ratio']:.2f}×), preempted {b['paged']['preempted_prompts']}"
            )
    if "decode_step" not in r or "cascade" not in r:
        return
    d = r["decode_step"]
    bw = d["read_bandwidth"]["best_gbps"]
    print(f"decode step B={d['batch']} U={d['live']} (read ceiling {bw:.1f} GB/s):")
    for name, ms in d["ms_per_step"].items():
        print(
            f"  {name:>12}: {ms:7.2f} ms  K/V read {d['kv_read_fraction_of_bandwidth'][name]:.0%} of ceiling"
        )
    print(
        f"  paged/slots step ratio {d['paged_step_ratio']:.2f} (≥ 0.9 wanted; "
        f"xla {d['paged_step_ratio_xla']:.2f})"
    )
    c = r["cascade"]
    print(f"cascade, {c['rows']} rows + {c['own']} own keys (baseline {c['baseline']}):")
    for s, row in c["by_shared_len"].items():
        us = " ".join(f"{n}={v:.0f}us" for n, v in row["us"].items())
        print(f"  S={s:>5}: {us}")
    print(
        f"  speedup at S=1024: {c['cascade_attention_speedup']:.2f}×; crossover S={c['crossover_shared_len']}"
    )
