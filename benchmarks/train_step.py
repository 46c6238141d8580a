"""RL train-step throughput vs the measured matmul peak, and vectorised vs loop advantages.

    .venv/bin/python benchmarks/train_step.py --out=workdir/bench_train_step.json

Three measurements in one process (so peak and step see the same machine state):
  (a) the matmul peak: a jitted 2048³ f32 matmul, and bf16 inputs with f32 accumulation
      (median of several runs);
  (b) the Tree-GRPO train step (`rl.jit_train_step`, KL on: one extra reference forward) on a
      ~40M-parameter Llama config at sequence 512, median step time after compile; model
      FLOPs = 6·N·tokens (forward + backward of the update) + 2·N·tokens per extra forward
      (reference; `logp_old` of mini-batch 0 is the update's own forward, so with one
      mini-batch there is no separate old pass). N counts matmul parameters (the input
      embedding is a lookup, not a matmul). MFU = model FLOPs/s over the measured f32 peak;
      attention FLOPs are reported separately and not counted in it. A plain LM train step
      (next-token CE + AdamW) of the same model runs as the in-process baseline. Peak, RL step
      and plain step are measured in turn, several rounds, each MFU against the peak measured
      just before it (medians reported), so other jobs' load hits all three alike;
  (c) `rl.advantages.compute` on 10^5 rows (jitted, median) vs a plain NumPy/Python loop.
Prints a table and writes JSON. The CPU is shared with other jobs: numbers are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import causal_mask
from treegrpo_jax.rl import (
    BatchLayout,
    LossConfig,
    OptimConfig,
    PathRow,
    advantages,
    build_batch,
    create_train_state,
    jit_train_step,
)

# ~42M parameters (34M in matmuls): Llama layout, untied head, f32.
BENCH_MODEL = ModelConfig(
    vocab_size=16_384, embed_dim=512, mlp_dim=1408, num_layers=8, num_heads=8, num_kv_heads=8, head_dim=64
)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_peak(n: int, repeats: int) -> dict[str, float]:
    """FLOP/s of a jitted n³ matmul, f32 and bf16-in/f32-accumulate."""
    key = jax.random.key(0)
    a = jax.random.normal(key, (n, n), jnp.float32)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.float32)
    f32 = jax.jit(lambda x, y: x @ y)
    bf16 = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    ab, bb = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    jax.block_until_ready((f32(a, b), bf16(ab, bb)))
    flops = 2 * n**3
    return {
        "f32": flops / _median_time(lambda: f32(a, b), repeats),
        "bf16": flops / _median_time(lambda: bf16(ab, bb), repeats),
    }


def _bench_rows(rows: int, seq: int, vocab: int, rng) -> list[PathRow]:
    """`rows` paths of exactly `seq` tokens: a 64-token prompt, then model tokens; 2 prompts × 2 trees."""
    out = []
    for i in range(rows):
        mask = np.arange(seq) >= 64
        out.append(
            PathRow(
                tokens=rng.integers(0, vocab, seq).astype(np.int32),
                loss_mask=mask,
                sampler_logp=np.where(mask, -rng.random(seq), 0.0).astype(np.float32),
                reward=float(rng.choice([0.0, 0.2, 1.0])),
                prompt_id=i % 2,
                tree_id=(i // 2) % 2,
            )
        )
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def make_rl_step(cfg: ModelConfig, rows: int, seq: int, chunk: int):
    """The compiled RL step on the bench model, as a closure that runs one step; and its facts."""
    model = init_model(cfg, seed=0)
    ref = jax.tree.map(jnp.copy, nnx.state(model))
    optim = OptimConfig(learning_rate=1e-6, warmup_ratio=0.0, total_steps=1000)
    loss_cfg = LossConfig()  # paper defaults: KL β=0.001 (reference forward), entropy 0.001
    state, _ = create_train_state(model, optim)
    rows_ = _bench_rows(rows, seq, cfg.vocab_size, np.random.default_rng(0))
    batch = jax.device_put(build_batch(rows_, BatchLayout(length_buckets=(seq,), row_multiple=rows)))
    step = jit_train_step(None, loss_cfg=loss_cfg, optim_cfg=optim, logprob_chunk=chunk)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch, ref).compile()
    compile_s = time.perf_counter() - t0
    box = {"state": state}

    def run():
        box["state"], metrics = compiled(box["state"], batch, ref)
        return metrics

    run()  # warm-up
    tokens = rows * seq
    n_matmul = cfg.num_params - cfg.vocab_size * cfg.embed_dim  # minus the input-embedding lookup
    extra_forwards = int(loss_cfg.uses_reference)
    # Causal attention, QKᵀ and PV: 2·2·T·D·H per token per layer forward (full T×T, as computed).
    attn_fwd = 4 * seq * cfg.head_dim * cfg.num_heads * cfg.num_layers * tokens
    facts = {
        "num_params": cfg.num_params,
        "matmul_params": n_matmul,
        "tokens_per_step": tokens,
        "compile_s": compile_s,
        "model_flops_per_step": (6 + 2 * extra_forwards) * n_matmul * tokens,
        "attention_flops_per_step": (3 + extra_forwards) * attn_fwd,
    }
    return run, facts


def make_plain_step(cfg: ModelConfig, rows: int, seq: int):
    """A plain LM train step (next-token CE, AdamW) of the same model: the in-process baseline."""
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    tx = optax.adamw(1e-6)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, seq)), jnp.int32)

    @jax.jit
    def step(params, opt_state):
        def loss(p):
            pos = jnp.broadcast_to(jnp.arange(seq), (rows, seq))
            logits = nnx.merge(graphdef, p)(tokens, pos, causal_mask(jnp.ones((rows, seq), bool)))
            logp = jax.nn.log_softmax(logits[:, :-1])
            return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    box = {"state": (params, tx.init(params))}

    def run():
        box["state"] = step(*box["state"])
        return box["state"]

    run()  # compile + warm-up
    return run


def interleaved(cfg: ModelConfig, rows: int, seq: int, steps: int, chunk: int, matmul: int) -> dict:
    """Peak, RL step and plain step measured in turn, `steps` times: each MFU uses the peak
    measured right before it, so contention from other jobs hits all three alike."""
    rl_step, facts = make_rl_step(cfg, rows, seq, chunk)
    plain_step = make_plain_step(cfg, rows, seq)
    plain_flops = 6 * facts["matmul_params"] * facts["tokens_per_step"]
    rl_flops = facts["model_flops_per_step"]
    log = defaultdict(list)
    for _ in range(steps):
        peak = matmul_peak(matmul, repeats=3)["f32"]
        t_rl, t_plain = _timed(rl_step), _timed(plain_step)
        log["peak_f32"].append(peak)
        log["rl_step_s"].append(t_rl)
        log["plain_step_s"].append(t_plain)
        log["mfu"].append(rl_flops / t_rl / peak)
        log["mfu_with_attention"].append((rl_flops + facts["attention_flops_per_step"]) / t_rl / peak)
        log["plain_mfu"].append(plain_flops / t_plain / peak)
        log["rl_vs_plain"].append((t_rl / rl_flops) / (t_plain / plain_flops))
    med = {k: statistics.median(v) for k, v in log.items()}
    return {
        **facts,
        "median": med,
        "all": dict(log),
        "tokens_per_s": facts["tokens_per_step"] / med["rl_step_s"],
    }


def _loop_advantages(rewards, tree_ids, prompt_ids):
    """The reference semantics as a plain loop (intra + inter z-scores)."""

    def zscore(keys):
        groups = defaultdict(list)
        for i, k in enumerate(keys):
            groups[k].append(i)
        out = np.zeros(len(rewards))
        for idx in groups.values():
            r = rewards[idx]
            mean, std = (0.0, 1.0) if len(idx) == 1 else (r.mean(), r.std(ddof=1))
            out[idx] = (r - mean) / (std + 1e-6)
        return out

    return zscore(list(zip(prompt_ids.tolist(), tree_ids.tolist(), strict=True))) + zscore(
        prompt_ids.tolist()
    )


def advantage_speed(num_rows: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    leaves = 6  # M=2, N=2, L=1: 3 leaves per tree, 6 per prompt
    prompt_ids = (np.arange(num_rows) // leaves).astype(np.int32)
    tree_ids = ((np.arange(num_rows) % leaves) // 3).astype(np.int32)
    rewards = rng.choice([0.0, 0.1, 0.2, 0.8, 1.0], num_rows).astype(np.float32)
    mask = np.ones(num_rows, bool)
    args = [jnp.asarray(x) for x in (rewards, tree_ids, prompt_ids, mask)]
    got = np.asarray(advantages.compute(*args, "tree"))
    jitted_s = _median_time(lambda: advantages.compute(*args, "tree"), repeats)
    t0 = time.perf_counter()
    want = _loop_advantages(rewards.astype(np.float64), tree_ids, prompt_ids)
    loop_s = time.perf_counter() - t0
    return {
        "rows": num_rows,
        "jitted_s": jitted_s,
        "loop_s": loop_s,
        "speedup": loop_s / jitted_s,
        "max_abs_diff": float(np.abs(got - want).max()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--rows", type=int, default=8, help="rows (paths) per step")
    parser.add_argument("--seq", type=int, default=512, help="tokens per row")
    parser.add_argument("--steps", type=int, default=3, help="timed rounds (peak, RL step, plain step)")
    parser.add_argument("--chunk", type=int, default=512, help="LM-head sequence chunk (≥ seq: unchunked)")
    parser.add_argument("--matmul", type=int, default=2048, help="matmul size for the peak")
    parser.add_argument("--adv_rows", type=int, default=100_000)
    parser.add_argument("--dtype", default="float32", help="matmul compute dtype (params stay f32)")
    args = parser.parse_args()

    peak = matmul_peak(args.matmul, repeats=7)
    adv = advantage_speed(args.adv_rows, repeats=7)
    cfg = BENCH_MODEL.replace(dtype=args.dtype)
    step = interleaved(cfg, args.rows, args.seq, args.steps, args.chunk, args.matmul)
    med = step["median"]
    result = {
        "device": str(jax.devices()[0].device_kind),
        "matmul_f32_flops_per_s": peak["f32"],
        "matmul_bf16_flops_per_s": peak["bf16"],
        "train_step": step,
        "tokens_per_s": step["tokens_per_s"],
        "mfu_vs_measured_peak": med["mfu"],
        "mfu_with_attention_vs_measured_peak": med["mfu_with_attention"],
        "plain_lm_step_mfu_vs_measured_peak": med["plain_mfu"],
        # RL time per model FLOP over the plain step's: > 1 means the RL step wastes time
        # beyond its counted extra (reference) forward pass.
        "rl_vs_plain_time_per_model_flop": med["rl_vs_plain"],
        "advantages": adv,
        "advantages_speedup_vs_loop": adv["speedup"],
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    table = [
        ("matmul f32 / bf16→f32 peak (GFLOP/s)", f"{peak['f32'] / 1e9:.1f} / {peak['bf16'] / 1e9:.1f}"),
        ("f32 peak before each step (GFLOP/s)", " ".join(f"{x / 1e9:.0f}" for x in step["all"]["peak_f32"])),
        (
            "model params / in matmuls (M)",
            f"{step['num_params'] / 1e6:.1f} / {step['matmul_params'] / 1e6:.1f}",
        ),
        ("step: rows × seq, compute dtype", f"{args.rows} × {args.seq}, {args.dtype}"),
        ("RL step compile (s)", f"{step['compile_s']:.1f}"),
        (
            "RL step time, median (s)",
            f"{med['rl_step_s']:.2f}  {[round(t, 2) for t in step['all']['rl_step_s']]}",
        ),
        ("tokens/s", f"{step['tokens_per_s']:.0f}"),
        (
            "MFU vs measured f32 peak (6N+2N ref)",
            f"{med['mfu']:.3f}  {[round(m, 3) for m in step['all']['mfu']]}",
        ),
        ("  … counting attention too", f"{med['mfu_with_attention']:.3f}"),
        ("plain LM step time, median (s)", f"{med['plain_step_s']:.2f}"),
        (
            "plain LM step MFU (6N)",
            f"{med['plain_mfu']:.3f}  {[round(m, 3) for m in step['all']['plain_mfu']]}",
        ),
        ("RL / plain time per model FLOP", f"{med['rl_vs_plain']:.3f}"),
        (f"advantages, {adv['rows']} rows jitted (ms)", f"{adv['jitted_s'] * 1e3:.2f}"),
        ("advantages, NumPy loop (ms)", f"{adv['loop_s'] * 1e3:.1f}"),
        ("advantages speedup", f"{adv['speedup']:.0f}×  (max |Δ| {adv['max_abs_diff']:.1e})"),
    ]
    width = max(len(k) for k, _ in table)
    for k, v in table:
        print(f"{k:<{width}}  {v}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
