"""RL train-step throughput vs the measured matmul peak; vectorised vs loop advantages; packed vs paths.

    .venv/bin/python benchmarks/train_step.py --out=workdir/bench_train_step.json
    .venv/bin/python benchmarks/train_step.py --parts=packed --out=/tmp/packed.json   # ~4 min here

Parts (`--parts`, comma-separated; default all), in one process (so peak and step see the
same machine state):
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
  (c) `rl.advantages.compute` on 10^5 rows (jitted, median) vs a plain NumPy/Python loop;
  (d) `packed`: the same jitted train step on the same real rollout trees in both layouts —
      one row per root-to-leaf path vs each tree's unique tokens once (`rl.packed`) — for
      tree shapes (2,2,1) and (4,5,1) grown by `rollout.tree_search.rollout` on the synthetic
      world (BM25, a BPE tokenizer trained on the world, the `:tiny` agent limits, the `:tiny`
      policy's dimensions with random weights: its invalid actions get feedback observations,
      so paths run the full turn budget), with the `:tiny` loss (no KL: no reference forward).
      Packed rows attend block-sparse (`packed.key_blocks`). Both layouts get the fewest
      micro-batches whose attention scores fit `--pair_budget`. Timed interleaved (paths,
      packed, paths, ...) after compiling, medians; speedup = paths / packed step time,
      reported next to the ratio of path tokens to unique tokens (JSON keys
      `packed_vs_paths_speedup_{221,451}`, `path_to_unique_token_ratio_{221,451}`).
Parts (a)+(b) are `mfu`, (c) `advantages`, (d) `packed`. Prints tables and writes JSON. The
CPU is shared with other jobs: numbers are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import median_time
from flax import nnx

from treegrpo_jax.env.actions import STOP_SEQUENCES
from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import causal_mask
from treegrpo_jax.rl import (
    BatchLayout,
    LossConfig,
    OptimConfig,
    PathRow,
    advantages,
    batch_from_trees,
    build_batch,
    create_train_state,
    jit_train_step,
    rows_from_trees,
)

# ~42M parameters (34M in matmuls): Llama layout, untied head, f32.
BENCH_MODEL = ModelConfig(
    vocab_size=16_384, embed_dim=512, mlp_dim=1408, num_layers=8, num_heads=8, num_kv_heads=8, head_dim=64
)


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
        "f32": flops / median_time(lambda: f32(a, b), repeats),
        "bf16": flops / median_time(lambda: bf16(ab, bb), repeats),
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
    jitted_s = median_time(lambda: advantages.compute(*args, "tree"), repeats)
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


# ------------------------------------------------------------------- packed vs paths
# The `:tiny` policy's dimensions (configs/multihop.py), on a BPE vocabulary of 1024.
PACKED_MODEL = dict(embed_dim=128, mlp_dim=384, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
TREE_SHAPES = {"221": (2, 2, 1), "451": (4, 5, 1)}
PACKED_BUCKETS = (256, 384, 512, 768, 1024, 2048, 4096)  # :tiny's, and room for whole (4,5,1) trees


def rollout_trees(shapes: dict[str, tuple[int, int, int]], prompts: dict[str, int], seed: int):
    """Real rollout trees of each shape on the synthetic world, and the model that grew them."""
    from treegrpo_jax.data.synthetic_world import WorldConfig, build_world
    from treegrpo_jax.env.bm25 import BM25Retriever
    from treegrpo_jax.env.observation import ObservationConfig
    from treegrpo_jax.env.prompt import PromptConfig
    from treegrpo_jax.model.bpe_train import train_bpe_tokenizer
    from treegrpo_jax.rollout.agent import AgentConfig, AgentEnv
    from treegrpo_jax.rollout.engine import Engine
    from treegrpo_jax.rollout.stops import make_stop_table, token_bytes
    from treegrpo_jax.rollout.tree_search import TreeSearchConfig, rollout

    world = build_world(WorldConfig(seed=seed))
    retriever = BM25Retriever.from_texts([r["contents"] for r in world.corpus_rows()])
    tok = train_bpe_tokenizer(list(world.passages) + [r.question for r in world.train], vocab_size=1024)
    cfg = ModelConfig(vocab_size=tok.vocab_size, **PACKED_MODEL)
    model = init_model(cfg, seed=seed)
    env = AgentEnv(
        tokenizer=tok,
        retriever=retriever,
        prompt=PromptConfig.from_template("search_agent_terse"),
        observation=ObservationConfig(passage_tokens=56, max_tokens=72),
    )
    agent = AgentConfig(max_tool_calls=4, max_turns=5, max_step_tokens=48, top_k=1)  # the :tiny limits
    table = make_stop_table(token_bytes(tok), STOP_SEQUENCES, vocab_size=cfg.vocab_size)
    trees = {}
    for name, (m, n, rounds) in shapes.items():
        shape = TreeSearchConfig(num_trees=m, num_picks=n, num_rounds=rounds)
        rows = list(world.train[: prompts[name]])
        engine = Engine(
            model,
            num_slots=len(rows) * shape.leaves_per_prompt,
            max_len=1024,
            eos_ids=tok.eos_ids,
            stop_table=table,
            min_rows=8,
        )
        trees[name], _ = rollout(engine, env, rows, shape, agent, key=jax.random.key(seed))
    # A random policy never answers, so every reward would be 0 (zero advantages and gradients):
    # draw leaf rewards from the reward levels instead, so the loss and its gradient are real.
    rng = np.random.default_rng(seed)
    for tree in (t for ts in trees.values() for t in ts):
        for leaf in tree.leaves():
            leaf.reward = float(rng.choice([0.0, 0.1, 0.2, 0.8, 1.0]))
    return model, trees


def _attention_pairs(batch) -> int:
    """Query-key pairs one micro-batch scores: rows · T · keys per query (T dense, J·C block-sparse)."""
    b, t = batch.tokens.shape[-2:]
    blocks = getattr(batch, "key_blocks", None)
    keys = t if blocks is None else blocks.shape[-1] * (t // blocks.shape[-2])
    return b * t * keys


def _layout_for(trees, kind: str, pair_budget: int) -> BatchLayout:
    """Micro-batches whose attention scores fit `pair_budget` query-key pairs (the same memory
    bound for both layouts); of those, the split with the fewest padded tokens, then the fewest
    micro-batches (each layout at its best)."""
    best = None
    for n_micro in range(1, 65):
        layout = BatchLayout(
            num_microbatches=n_micro, length_buckets=PACKED_BUCKETS, row_multiple=1, kind=kind
        )
        batch = batch_from_trees(trees, layout)
        if _attention_pairs(batch) <= pair_budget or batch.tokens.shape[-2] == 1:
            cells = batch.tokens.size
            if best is None or cells < best[0]:
                best = (cells, layout)
            if batch.tokens.shape[-2] == 1:
                break
    return best[1]


def packed_vs_paths(shape_name: str, model, trees, steps: int, chunk: int, pair_budget: int) -> dict:
    rows = rows_from_trees(trees)
    path_tokens = sum(len(r.tokens) for r in rows)
    unique_tokens = sum(t.unique_tokens() for t in trees)
    optim = OptimConfig(learning_rate=1e-6, warmup_ratio=0.0, total_steps=1000)
    loss_cfg = LossConfig(kl_coef=0.0, entropy_coef=0.0)  # the :tiny loss (no reference forward)
    ref = None
    graphdef, params = nnx.split(model)
    runs, facts = {}, {}
    for kind in ("paths", "packed"):
        layout = _layout_for(trees, kind, pair_budget)
        batch = jax.device_put(batch_from_trees(trees, layout))
        state = create_train_state(nnx.merge(graphdef, jax.tree.map(jnp.copy, params)), optim)[0]
        step = jit_train_step(None, loss_cfg=loss_cfg, optim_cfg=optim, logprob_chunk=chunk)
        t0 = time.perf_counter()
        compiled = step.lower(state, batch, ref).compile()
        n_mini, n_micro, b, t = batch.tokens.shape
        facts[kind] = {
            "compile_s": time.perf_counter() - t0,
            "shape": [n_mini, n_micro, b, t],
            "padded_tokens": n_mini * n_micro * b * t,
            "attention_pairs": n_mini * n_micro * _attention_pairs(batch),
        }
        box = {"state": state}

        def run(compiled=compiled, batch=batch, box=box):
            box["state"], metrics = compiled(box["state"], batch, ref)
            return metrics

        runs[kind] = run
    log = defaultdict(list)
    for i in range(steps):
        for kind, run in runs.items():
            t0 = time.perf_counter()
            metrics = jax.device_get(run())
            log[kind].append(time.perf_counter() - t0)
            if i == 0:  # the first step of each layout starts from the same params
                facts[kind]["metrics"] = {k: float(v) for k, v in metrics.items()}
    med = {kind: statistics.median(v) for kind, v in log.items()}
    leaves = len(rows)
    return {
        "shape": shape_name,
        "prompts": len({t.prompt_id for t in trees}),
        "trees": len(trees),
        "leaves": leaves,
        "path_tokens": path_tokens,
        "unique_tokens": unique_tokens,
        "path_to_unique_token_ratio": path_tokens / unique_tokens,
        "padded_token_ratio": facts["paths"]["padded_tokens"] / facts["packed"]["padded_tokens"],
        "median_step_s": med,
        "all_step_s": dict(log),
        "speedup": med["paths"] / med["packed"],
        "layouts": facts,
        # The loss is the same function of the same params in both layouts (first step).
        "loss_paths_vs_packed": [facts["paths"]["metrics"]["loss"], facts["packed"]["metrics"]["loss"]],
    }


def run_packed(args) -> dict:
    prompts = {"221": args.packed_prompts_221, "451": args.packed_prompts_451}
    t0 = time.perf_counter()
    model, trees = rollout_trees(TREE_SHAPES, prompts, seed=0)
    rollout_s = time.perf_counter() - t0
    print(f"[packed] world, tokenizer and rollouts: {rollout_s:.0f} s", file=sys.stderr, flush=True)
    out = {"rollout_s": rollout_s, "model": PACKED_MODEL}
    for name in TREE_SHAPES:
        r = packed_vs_paths(name, model, trees[name], args.packed_steps, args.chunk, args.pair_budget)
        print(f"[packed] ({','.join(name)}): {r['median_step_s']}", file=sys.stderr, flush=True)
        out[name] = r
        out[f"packed_vs_paths_speedup_{name}"] = r["speedup"]
        out[f"path_to_unique_token_ratio_{name}"] = r["path_to_unique_token_ratio"]
    return out


def packed_table(res: dict) -> list[tuple[str, str]]:
    table = []
    for name in TREE_SHAPES:
        r = res[name]
        lay = r["layouts"]
        table += [
            (
                f"({','.join(name)}) trees: prompts / trees / leaves",
                f"{r['prompts']} / {r['trees']} / {r['leaves']}",
            ),
            (
                "  path tokens / unique tokens (ratio)",
                f"{r['path_tokens']} / {r['unique_tokens']} ({r['path_to_unique_token_ratio']:.2f}×)",
            ),
            (
                "  batch [n_mini, n_micro, b, T] paths / packed",
                f"{lay['paths']['shape']} / {lay['packed']['shape']}",
            ),
            (
                "  padded tokens paths / packed (ratio)",
                f"{lay['paths']['padded_tokens']} / {lay['packed']['padded_tokens']} "
                f"({r['padded_token_ratio']:.2f}×)",
            ),
            (
                "  step median (s) paths / packed",
                f"{r['median_step_s']['paths']:.2f} / {r['median_step_s']['packed']:.2f}",
            ),
            (
                "  speedup packed vs paths",
                f"{r['speedup']:.2f}×  (target ≥ {0.8 * r['path_to_unique_token_ratio']:.2f}×)",
            ),
            (
                "  loss paths / packed",
                f"{r['loss_paths_vs_packed'][0]:.7g} / {r['loss_paths_vs_packed'][1]:.7g}",
            ),
        ]
    return table


PARTS = ("mfu", "advantages", "packed")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument("--rows", type=int, default=8, help="mfu: rows (paths) per step")
    parser.add_argument("--seq", type=int, default=512, help="mfu: tokens per row")
    parser.add_argument("--steps", type=int, default=3, help="mfu: timed rounds (peak, RL step, plain step)")
    parser.add_argument("--chunk", type=int, default=512, help="LM-head sequence chunk (≥ seq: unchunked)")
    parser.add_argument("--matmul", type=int, default=2048, help="matmul size for the peak")
    parser.add_argument("--adv_rows", type=int, default=100_000)
    parser.add_argument("--dtype", default="float32", help="mfu: matmul compute dtype (params stay f32)")
    parser.add_argument("--packed_steps", type=int, default=2, help="packed: timed steps per layout")
    parser.add_argument("--packed_prompts_221", type=int, default=2, help="packed: prompts of (2,2,1) trees")
    parser.add_argument("--packed_prompts_451", type=int, default=1, help="packed: prompts of (4,5,1) trees")
    parser.add_argument(
        "--pair_budget",
        type=int,
        default=2**23,
        help="packed: dense attention pairs (rows·T²) per micro-batch, bounds memory in both layouts",
    )
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; known: {list(PARTS)}")

    result: dict = {"device": str(jax.devices()[0].device_kind)}
    table: list[tuple[str, str]] = []
    if "mfu" in parts:
        peak = matmul_peak(args.matmul, repeats=7)
        cfg = BENCH_MODEL.replace(dtype=args.dtype)
        step = interleaved(cfg, args.rows, args.seq, args.steps, args.chunk, args.matmul)
        med = step["median"]
        result.update(
            matmul_f32_flops_per_s=peak["f32"],
            matmul_bf16_flops_per_s=peak["bf16"],
            train_step=step,
            tokens_per_s=step["tokens_per_s"],
            mfu_vs_measured_peak=med["mfu"],
            mfu_with_attention_vs_measured_peak=med["mfu_with_attention"],
            plain_lm_step_mfu_vs_measured_peak=med["plain_mfu"],
            # RL time per model FLOP over the plain step's: > 1 means the RL step wastes time
            # beyond its counted extra (reference) forward pass.
            rl_vs_plain_time_per_model_flop=med["rl_vs_plain"],
        )
        table += [
            ("matmul f32 / bf16→f32 peak (GFLOP/s)", f"{peak['f32'] / 1e9:.1f} / {peak['bf16'] / 1e9:.1f}"),
            (
                "f32 peak before each step (GFLOP/s)",
                " ".join(f"{x / 1e9:.0f}" for x in step["all"]["peak_f32"]),
            ),
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
        ]
    if "advantages" in parts:
        adv = advantage_speed(args.adv_rows, repeats=7)
        result.update(advantages=adv, advantages_speedup_vs_loop=adv["speedup"])
        table += [
            (f"advantages, {adv['rows']} rows jitted (ms)", f"{adv['jitted_s'] * 1e3:.2f}"),
            ("advantages, NumPy loop (ms)", f"{adv['loop_s'] * 1e3:.1f}"),
            ("advantages speedup", f"{adv['speedup']:.0f}×  (max |Δ| {adv['max_abs_diff']:.1e})"),
        ]
    if "packed" in parts:
        packed = run_packed(args)
        result["packed"] = packed
        result.update({k: v for k, v in packed.items() if k.startswith(("packed_vs", "path_to"))})
        table += packed_table(packed)
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    width = max(len(k) for k, _ in table)
    for k, v in table:
        print(f"{k:<{width}}  {v}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
