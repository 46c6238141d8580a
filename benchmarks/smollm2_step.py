"""Where a real model's RL step goes on this CPU: SmolLM2-135M, f32 vs bf16 compute.

    .venv/bin/python benchmarks/smollm2_step.py --out=docs/benchmarks/smollm2_step.json   # ~10 min

For each compute dtype (parameters stay f32; K/V f32), in one process, timed interleaved
(f32, bf16, f32, ...) after compiling, medians:
  decode   one rollout decode step of the engine (CPU kernels), `--batch` rows at `--live`
           tokens of context, `--steps` steps per call;
  logprob  the log-prob pass of `--rows` × `--seq` tokens (`rl.token_logprobs`, the old/ref pass);
  update   the Tree-GRPO train step on the same rows (`rl.jit_train_step`, the `:smollm2,smoke`
           loss: no KL reference), forward + backward + AdamW.
Compile seconds are the first call's. Whether bf16 is fast on a CPU depends on its bf16 dot
units (`avx512_bf16` / `amx_bf16`; JSON `cpu_bf16_flags`): without them XLA:CPU converts around
every dot. Ceilings measured in the same run: the f32 and bf16 matmul
rate (a jitted 1024³ dot) and the read bandwidth of a jitted reduction; each figure is stated as a
fraction of them (decode: bytes per step / bandwidth; passes: 2·N·tokens (×3 for the update) / rate).
The peer of each bf16 figure is the f32 one; JSON `bf16_over_f32` holds the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _roofline import matmul_gflops, read_bandwidth_gbps  # noqa: E402

from treegrpo_jax.model.pretrained import load_pretrained  # noqa: E402
from treegrpo_jax.rl import BatchLayout, LossConfig, OptimConfig, build_batch  # noqa: E402
from treegrpo_jax.rl.logprobs import token_logprobs  # noqa: E402
from treegrpo_jax.rl.train_state import create_train_state  # noqa: E402
from treegrpo_jax.rl.train_step import jit_train_step  # noqa: E402
from treegrpo_jax.rollout.engine import Engine  # noqa: E402
from treegrpo_jax.rollout.sampling import SamplingParams  # noqa: E402
from treegrpo_jax.testing.forest import random_path_rows  # noqa: E402
from treegrpo_jax.train.setup import cpu_bf16_flags  # noqa: E402

DTYPES = ("float32", "bfloat16")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def make_parts(dtype: str, args) -> tuple[dict, dict]:
    """Zero-argument runners per part (each returns what to block on), and compile seconds."""
    model, cfg, _ = load_pretrained("smollm2", dtype=dtype)
    runners, compile_s = {}, {}

    engine = Engine(model, num_slots=args.batch + 1, max_len=args.live + args.steps + 8, kv_dtype="float32")
    slots = engine.allocate(args.batch + 1)
    rows, source = slots[:-1], slots[-1]
    engine.append({source: np.random.default_rng(0).integers(1, cfg.vocab_size, args.live).tolist()})
    sampling = SamplingParams.make(args.batch, temperature=0.0)
    keys = jax.random.split(jax.random.key(0), args.batch)

    def decode():
        engine.fork([source] * args.batch, rows)
        jax.block_until_ready(engine.cache)
        t0 = time.perf_counter()
        engine.decode(rows, max_new_tokens=args.steps, sampling=sampling, keys=keys, num_steps=args.steps)
        return time.perf_counter() - t0

    batch = jax.device_put(
        build_batch(
            random_path_rows(args.rows, args.seq, cfg.vocab_size, prompt_len=64),
            BatchLayout(length_buckets=(args.seq,)),
        )
    )
    tokens = jnp.asarray(batch.tokens).reshape(-1, args.seq)
    positions = jnp.broadcast_to(jnp.arange(args.seq), tokens.shape)
    valid = jnp.ones(tokens.shape, bool)

    optim = OptimConfig(learning_rate=1e-6, warmup_ratio=0.0, total_steps=1000)
    loss_cfg = LossConfig(kl_coef=0.0, entropy_coef=0.0)
    state, _ = create_train_state(model, optim)
    step = jit_train_step(None, loss_cfg=loss_cfg, optim_cfg=optim)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch, None).compile()
    compile_s["update"] = time.perf_counter() - t0
    box = {"state": state}

    def update():
        # The step donates the state: the engine and the log-prob pass read the new params.
        box["state"], metrics = compiled(box["state"], batch, None)
        engine.set_params(box["state"].params)
        return metrics

    graphdef = state.graphdef
    logp = jax.jit(lambda params, t, p, v: token_logprobs(nnx.merge(graphdef, params), t, p, v)[0])
    t0 = time.perf_counter()
    logp(box["state"].params, tokens, positions, valid).block_until_ready()
    compile_s["logprob"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    decode()
    compile_s["decode"] = time.perf_counter() - t0
    update()  # warm-up
    runners["decode"] = decode
    runners["logprob"] = lambda: _timed(lambda: logp(box["state"].params, tokens, positions, valid))
    runners["update"] = lambda: _timed(update)
    return runners, compile_s | {"num_params": cfg.num_params, "cfg": cfg}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--live", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="workdir/bench_smollm2_step.json")
    args = ap.parse_args()

    ceil_f32, ceil_bf16, bw = matmul_gflops(), matmul_gflops(dtype=jnp.bfloat16), read_bandwidth_gbps()
    read = bw["best_gbps"]
    print(f"ceilings: f32 {ceil_f32:.0f} GFLOP/s, bf16 {ceil_bf16:.0f} GFLOP/s, read {read:.1f} GB/s")
    parts, facts = {}, {}
    for dtype in DTYPES:
        parts[dtype], facts[dtype] = make_parts(dtype, args)
        compiled = {k: round(facts[dtype][k], 1) for k in ("decode", "logprob", "update")}
        print(f"  {dtype}: compile / first-call seconds {compiled}", flush=True)
    seconds = {d: {p: [] for p in parts[d]} for d in DTYPES}
    for r in range(args.repeats):
        for dtype in DTYPES if r % 2 == 0 else DTYPES[::-1]:
            for part, run in parts[dtype].items():
                seconds[dtype][part].append(run())
        print(f"  repeat {r + 1}/{args.repeats} done", flush=True)

    cfg = facts["float32"]["cfg"]
    n_matmul = cfg.num_params - cfg.vocab_size * cfg.embed_dim * (0 if cfg.tie_embeddings else 1)
    tokens = args.rows * args.seq
    weight_bytes = cfg.num_params * 4
    kv_bytes = cfg.num_layers * 2 * args.batch * cfg.num_kv_heads * cfg.head_dim * 4 * args.live
    ceilings = {"f32_gflops": ceil_f32, "bf16_gflops": ceil_bf16, "read_gbps": read}
    rows, result = [], {"args": vars(args), "cpu_bf16_flags": cpu_bf16_flags(), "ceilings": ceilings}
    for dtype in DTYPES:
        med = {p: statistics.median(s) for p, s in seconds[dtype].items()}
        ceiling = ceil_f32 if dtype == "float32" else ceil_bf16
        decode_ms = 1e3 * med["decode"] / args.steps
        entry = {
            "decode_ms_per_step": decode_ms,
            "decode_tokens_per_s": args.batch / (decode_ms / 1e3),
            "decode_of_read_ceiling": (weight_bytes + kv_bytes) / (decode_ms / 1e3) / (read * 1e9),
            "logprob_s": med["logprob"],
            "logprob_of_matmul_ceiling": 2 * n_matmul * tokens / med["logprob"] / (ceiling * 1e9),
            "update_s": med["update"],
            "update_of_matmul_ceiling": 6 * n_matmul * tokens / med["update"] / (ceiling * 1e9),
            "compile_s": {p: facts[dtype][p] for p in ("decode", "logprob", "update")},
            "all_s": {p: s for p, s in seconds[dtype].items()},
        }
        result[dtype] = entry
        rows.append((dtype, entry))
    result["bf16_over_f32"] = {
        k: result["bfloat16"][k] / result["float32"][k]
        for k in ("decode_ms_per_step", "logprob_s", "update_s")
    }
    print(f"\nSmolLM2-135M on {jax.devices()[0].device_kind}: decode batch {args.batch} at {args.live} "
          f"live tokens; passes on {args.rows}×{args.seq} tokens (medians of {args.repeats})")  # fmt: skip
    print(f"{'compute':<10}{'decode ms/step':>16}{'% read':>8}{'logprob s':>11}{'% peak':>8}{'update s':>10}"
          f"{'% peak':>8}{'compile d/l/u s':>18}")  # fmt: skip
    for dtype, e in rows:
        c = e["compile_s"]
        print(f"{dtype:<10}{e['decode_ms_per_step']:>16.0f}{100 * e['decode_of_read_ceiling']:>7.0f}%"
              f"{e['logprob_s']:>11.2f}{100 * e['logprob_of_matmul_ceiling']:>7.0f}%{e['update_s']:>10.2f}"
              f"{100 * e['update_of_matmul_ceiling']:>7.0f}%"
              f"{c['decode']:>8.0f}/{c['logprob']:.0f}/{c['update']:.0f}")  # fmt: skip
    ratios = result["bf16_over_f32"]
    print("bf16 / f32 time: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
