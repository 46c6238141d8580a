"""Decode against the machine's own ceiling (issue 15): `rollout.py --parts=roofline,smollm2`.

Legend: B rows, U live tokens per row, T pool length per slot, L layers, K kv heads, D head
dim, N decode steps per call.

In one process: first the read bandwidth of this machine (a jitted sum over 256 MiB of f32,
best of several: the ceiling), then the Engine's decode step on `:tiny` dims (random
weights, f32 compute) at B in {32, 128} and U in {256, 768} of a T=1024 pool, greedy and
sampled (temperature 0.7, top-p 0.95), with the CPU kernels (f32 and bf16 K/V) and with the
XLA path they replace. A step must at least read the weights and every row's live K/V once:
fraction of the roofline = (weight bytes + live K/V bytes) / bandwidth / step time. The
bandwidth is measured before and after the cases and the higher figure is the ceiling (this
shared VM's reads vary by run, 28-50 GB/s seen). The weight matmuls' FLOPs at the f32 matmul
rate measured in the same run give the compute floor, reported beside it (`flop_ms`): at a
large batch of a bigger model (SmolLM2 at 64 rows) that one binds first.
`smollm2` does the same for the offline SmolLM2-135M (GGUF, f32 weights) at B in {1, 8, 64}.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.sampling import SamplingParams

TINY_DIMS = dict(
    vocab_size=4096, embed_dim=128, mlp_dim=384, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32
)
POOL_LEN = 1024
STEPS = 32  # decode steps per timed call
SAMPLED = dict(temperature=0.7, top_p=0.95)


@dataclasses.dataclass(frozen=True)
class Case:
    """One decode configuration; `impl` is the Engine's kernels, `kv` its stored K/V dtype."""

    batch: int
    live: int
    sampled: bool
    impl: str  # "native" | "xla"
    kv: str  # "float32" | "bfloat16"

    @property
    def name(self) -> str:
        mode = "sampled" if self.sampled else "greedy"
        return f"b{self.batch}_u{self.live}_{mode}_{self.impl}_{self.kv}"


def read_bandwidth_gbps(mib: int = 256, repeats: int = 15) -> dict:
    """GB/s of a jitted f32 sum over `mib` MiB (far above the last-level cache): best and median."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    total = jax.jit(lambda a: a.sum())
    total(x).block_until_ready()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        seconds.append(time.perf_counter() - t0)
    return {
        "array_mib": mib,
        "best_gbps": x.nbytes / min(seconds) / 1e9,
        "median_gbps": x.nbytes / float(np.median(seconds)) / 1e9,
    }


def step_bytes(cfg: ModelConfig, *, batch: int, live: float, kv_itemsize: int) -> dict:
    """Bytes one decode step must read at least: the weights once, each row's live K and V once."""
    weights = cfg.num_params * jnp.dtype(cfg.jnp_param_dtype).itemsize
    kv = cfg.num_layers * 2 * batch * cfg.num_kv_heads * cfg.head_dim * kv_itemsize * live
    return {"weight_bytes": int(weights), "live_kv_bytes": int(kv)}


def _measure(model: Decoder, case: Case, *, steps: int, pool_len: int, seed: int = 0):
    """A zero-argument callable: fork a `live`-token prefix to `batch` rows, decode `steps` steps;
    returns the seconds of the decode alone."""
    engine = Engine(model, num_slots=case.batch + 1, max_len=pool_len, kernels=case.impl, kv_dtype=case.kv)
    slots = engine.allocate(case.batch + 1)
    rows, source = slots[:-1], slots[-1]
    rng = np.random.default_rng(seed)
    engine.append({source: rng.integers(1, model.cfg.vocab_size, case.live).tolist()})
    kw = SAMPLED if case.sampled else dict(temperature=0.0)
    sampling = SamplingParams.make(case.batch, **kw)
    keys = jax.random.split(jax.random.key(seed), case.batch)

    def measure() -> float:
        engine.fork([source] * case.batch, rows)
        jax.block_until_ready(engine.cache)
        t0 = time.perf_counter()
        out = engine.decode(rows, max_new_tokens=steps, sampling=sampling, keys=keys, num_steps=steps)
        seconds = time.perf_counter() - t0
        # Random weights never emit EOS, and no stop strings are set: every row runs all steps.
        assert int(out.num_tokens.min()) == steps, out.num_tokens
        return seconds

    return measure


def _time_cases(model: Decoder, cases: list[Case], *, steps: int, pool_len: int, repeats: int) -> dict:
    """Median ms/step per case; the cases of one group are timed interleaved (shared noise)."""
    measures = {c: _measure(model, c, steps=steps, pool_len=pool_len) for c in cases}
    for m in measures.values():
        m()  # compile
    seconds: dict[Case, list[float]] = {c: [] for c in cases}
    for r in range(repeats):
        order = cases[r % len(cases) :] + cases[: r % len(cases)]
        for c in order:
            seconds[c].append(measures[c]())
    return {c: 1e3 * float(np.median(s)) / steps for c, s in seconds.items()}


def _best_seconds(fn, x, repeats: int) -> float:
    """Best wall time of `fn(x)` over `repeats` calls, after one call that compiles it."""
    fn(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(n: int = 1024, repeats: int = 7, dtype=jnp.float32) -> float:
    """Best GEMM rate of this CPU now (the compute ceiling), f32 accumulation for any `dtype`."""
    mm = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    return 2 * n**3 / _best_seconds(mm, jnp.ones((n, n), dtype), repeats) / 1e9


def step_matmul_ms(
    cfg: ModelConfig, *, batch: int, steps: int = STEPS, repeats: int = 7
) -> tuple[float, float]:
    """(best ms per step, FLOPs per step) of the decode step's weight matmuls alone, at its shapes.

    `batch` rows through every layer's q/k/v/o, gate/up/down and the LM head, `steps` times in one
    jitted scan (as a decode call runs them), each step's hidden state depending on the last. No
    attention, norms or sampling: what this CPU's GEMMs cost at B×E, E×(H·D), ... — a ceiling at
    the decode's shapes, where a 1024³ GEMM's rate is out of reach for 128-wide operands.
    """
    e, m, v = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size
    hd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [(e, hd), (e, kd), (e, kd), (hd, e), (e, m), (e, m), (m, e)]
    key = jax.random.key(0)
    ws = [
        [
            jax.random.normal(jax.random.fold_in(key, 10 * layer + i), s, jnp.float32) / np.sqrt(s[0])
            for i, s in enumerate(shapes)
        ]  # fmt: skip
        for layer in range(cfg.num_layers)
    ]
    head = jax.random.normal(jax.random.fold_in(key, 999), (v, e), jnp.float32) / np.sqrt(e)

    def one(h, _):
        for wq, wk, wv, wo, wg, wu, wd in ws:
            q, k, val = h @ wq, h @ wk, h @ wv
            h = h + (q + jnp.tile(k + val, hd // kd)) @ wo  # keeps k and v live
            h = h + (jax.nn.silu(h @ wg) * (h @ wu)) @ wd
        logits = h @ head.T
        return h + 1e-3 * logits[:, :e], None

    flops = 2 * batch * (cfg.num_layers * sum(a * b for a, b in shapes) + v * e)
    run = jax.jit(lambda h: jax.lax.scan(one, h, None, length=steps)[0])
    best = _best_seconds(run, jnp.ones((batch, e), jnp.float32), repeats)
    return 1e3 * best / steps, flops


def _ceilings(before: dict, after: dict, gflops: float) -> dict:
    return {"before": before, "after": after, "best_gbps": max(before["best_gbps"], after["best_gbps"]),
            "matmul_gflops": gflops}  # fmt: skip


def _row(cfg: ModelConfig, case: Case, ms: float, ceilings: dict, steps: int) -> dict:
    live = case.live + (steps + 1) / 2  # mean live keys over the call
    b = step_bytes(cfg, batch=case.batch, live=live, kv_itemsize=jnp.dtype(case.kv).itemsize)
    floor_ms = 1e3 * (b["weight_bytes"] + b["live_kv_bytes"]) / (ceilings["best_gbps"] * 1e9)
    flop_ms = 1e3 * 2 * cfg.num_params * case.batch / (ceilings["matmul_gflops"] * 1e9)
    return {
        "case": case.name,
        **dataclasses.asdict(case),
        "ms_per_step": ms,
        "tokens_per_s": case.batch / (ms / 1e3),
        **b,
        "roofline_ms": floor_ms,
        "fraction_of_roofline": floor_ms / ms,
        "flop_ms": flop_ms,
        "fraction_of_max_bound": max(floor_ms, flop_ms) / ms,
    }


def run_roofline(bc, model, cfg) -> dict:
    """The `:tiny`-dims decode step against the measured read bandwidth (see module docstring)."""
    del model, cfg
    before, gflops = read_bandwidth_gbps(), matmul_gflops()
    tiny_cfg = ModelConfig(**TINY_DIMS, tie_embeddings=True)
    tiny = init_model(tiny_cfg, seed=bc.seed)
    timed_cases = []
    for batch in (32, 128):
        for live in (256, 768):
            cases = [
                Case(batch, live, sampled, impl, kv)
                for sampled in (False, True)
                for impl, kv in (("native", "float32"), ("native", "bfloat16"), ("xla", "float32"))
                # The XLA path's sampled step sorts the vocabulary (~80 ms at B=128): once is enough.
                if not (impl == "xla" and sampled and live != 256)
            ]
            timed = _time_cases(tiny, cases, steps=STEPS, pool_len=POOL_LEN, repeats=bc.repeats)
            timed_cases += timed.items()
            print(f"  roofline: batch {batch}, live {live} done", flush=True)
    bandwidth = _ceilings(before, read_bandwidth_gbps(), gflops)
    rows = [_row(tiny_cfg, case, ms, bandwidth, STEPS) for case, ms in timed_cases]
    by = {r["case"]: r for r in rows}

    def frac(b, u=256, mode="greedy", impl="native", kv="float32"):
        return by[f"b{b}_u{u}_{mode}_{impl}_{kv}"]

    return {
        "decode_fraction_of_roofline_b128": frac(128)["fraction_of_roofline"],
        "decode_fraction_of_roofline_b32": frac(32)["fraction_of_roofline"],
        "sampled_over_greedy_step": frac(128, mode="sampled")["ms_per_step"] / frac(128)["ms_per_step"],
        "native_over_xla_speedup_b128": frac(128, impl="xla")["ms_per_step"] / frac(128)["ms_per_step"],
        "roofline": {"bandwidth": bandwidth, "steps_per_call": STEPS, "pool_len": POOL_LEN, "rows": rows},
    }


def run_smollm2(bc, model, cfg) -> dict:
    """SmolLM2-135M (GGUF, f32 weights): decode at batch 1 / 8 / 64, 512 live tokens, f32 and bf16 K/V."""
    del model, cfg
    from treegrpo_jax.model import assets
    from treegrpo_jax.model.pretrained import load_pretrained

    before, gflops = read_bandwidth_gbps(), matmul_gflops()
    smol, smol_cfg, _ = load_pretrained(assets.smollm2_gguf_path(), dtype="float32")
    steps, live = 16, 512
    timed_cases = []
    for batch in (1, 8, 64):
        cases = [Case(batch, live, False, "native", kv) for kv in ("float32", "bfloat16")]
        timed_cases += _time_cases(smol, cases, steps=steps, pool_len=1024, repeats=bc.repeats).items()
        print(f"  smollm2: batch {batch} done", flush=True)
    bandwidth = _ceilings(before, read_bandwidth_gbps(), gflops)
    rows = [_row(smol_cfg, case, ms, bandwidth, steps) for case, ms in timed_cases]
    return {"smollm2_decode": {"bandwidth": bandwidth, "steps_per_call": steps, "rows": rows}}


def print_roofline(result: dict) -> None:
    for key, title in (("roofline", ":tiny dims, random weights"), ("smollm2_decode", "SmolLM2-135M, f32")):
        if key not in result:
            continue
        r = result[key]
        bw = r["bandwidth"]
        print(f"\nDecode vs the memory roofline ({title}; read bandwidth {bw['best_gbps']:.1f} GB/s "
              f"(best of {bw['before']['best_gbps']:.1f} before / {bw['after']['best_gbps']:.1f} after, "
              f"sum over {bw['before']['array_mib']} MiB); "
              f"f32 matmul {bw['matmul_gflops']:.0f} GFLOP/s)")  # fmt: skip
        head = ("batch", "live", "mode", "path", "KV", "ms/step", "tok/s", "MB read", "mem ms", "flop ms",
                "of roof")  # fmt: skip
        print(" ".join(f"{h:>9}" for h in head))
        for q in r["rows"]:
            mb = (q["weight_bytes"] + q["live_kv_bytes"]) / 1e6
            print(f"{q['batch']:>9} {q['live']:>9} {'sampled' if q['sampled'] else 'greedy':>9} "
                  f"{q['impl']:>9} {q['kv']:>9} {q['ms_per_step']:9.2f} {q['tokens_per_s']:9.0f} "
                  f"{mb:9.1f} {q['roofline_ms']:9.2f} {q['flop_ms']:9.2f} "
                  f"{q['fraction_of_roofline']:9.1%}")  # fmt: skip
    for key in ("decode_fraction_of_roofline_b128", "decode_fraction_of_roofline_b32",
                "sampled_over_greedy_step", "native_over_xla_speedup_b128"):  # fmt: skip
        if key in result:
            print(f"{key}: {result[key]:.3f}")
