"""The prepared GPU check: exactness in bf16, decode against the HBM roofline and `transformers`,
train-step MFU, and `:smollm2` EM before / after RL — one command, ≤ 8 min on one H200.

    python benchmarks/gpu_check.py --out=docs/benchmarks/gpu_check.json          # on the GPU
    python benchmarks/gpu_check.py --smoke --out=/tmp/gpu_check_smoke.json        # any backend, toy sizes

Parts (`--parts`, comma-separated, in this order; each writes the JSON when it ends, so a run cut
short keeps what it measured; a part that fails records its error and the next one runs):

  exact    bf16 compute, stated tolerances (JSON `exact.*.tol`, each check PASS / FAIL):
           cached decode vs a full forward (log-probs of greedy tokens); a forked branch vs the
           same prefix prefilled afresh; the Pallas decode kernels (slots, pages) vs XLA; the cuDNN
           causal attention vs XLA (GPU only); the packed vs the paths train-step loss on the same
           trees; sharded vs one device (only with ≥ 2 devices).
  decode   a Qwen2.5-1.5B-shaped random bf16 model at batch 64 and 256 with 2k tokens of context:
           our engine (`kernels=auto`: the Pallas slot kernel on GPU; bf16 K/V), ms per step and
           tokens/s, as a fraction of the HBM roofline (weights + live K/V bytes per step ÷ the read
           bandwidth of a jitted reduction measured in the same run), and against `transformers`
           + torch `generate` (greedy, KV cache, bf16, same weights through `save_hf`).
  mfu      the Tree-GRPO train step (paths layout: cuDNN causal attention; KL off) on the same
           model, model FLOPs (6·N·tokens) per second over the bf16 matmul peak measured in the
           same run (an 8192³ dot).
  smollm2  `configs/multihop.py:smollm2` shrunk to fit `--smollm2_minutes`: greedy EM on the
           test questions after the cold start (step 0) and after the RL steps.

Targets on an H200 (issue 18): decode ≥ 50 % of the roofline at batch 256 and ≥ 3× transformers;
train step ≥ 35 % MFU. `--smoke` runs every part at toy sizes (a 2-layer model, batch 4/8, 256
tokens; smollm2 as `:smollm2,smoke`), so CI checks this script on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.causal_attention import CausalMask, causal_attention
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decode_attention import decode_attention_xla
from treegrpo_jax.model.decoder import causal_mask
from treegrpo_jax.model.paged_kernels import paged_attention_pallas, paged_attention_xla, platform_for_backend
from treegrpo_jax.model.slot_kernels import slot_attention_pallas
from treegrpo_jax.rl import BatchLayout, LossConfig, OptimConfig, build_batch, create_train_state
from treegrpo_jax.rl.layouts import batch_from_trees
from treegrpo_jax.rl.train_step import jit_train_step
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.sampling import SamplingParams
from treegrpo_jax.testing.forest import random_forest, random_path_rows

# Qwen2.5-1.5B's shape (config.json of Qwen/Qwen2.5-1.5B-Instruct).
QWEN25_1_5B = dict(
    vocab_size=151936,
    embed_dim=1536,
    mlp_dim=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    qkv_bias=True,
    tie_embeddings=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
)
TOY = dict(vocab_size=512, embed_dim=64, mlp_dim=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


@dataclasses.dataclass(frozen=True)
class Sizes:
    model: dict
    batches: tuple[int, ...]
    context: int  # live tokens per row when decoding
    decode_steps: int
    repeats: int
    train_rows: int
    train_seq: int
    peak_n: int  # matmul size of the peak measurement
    bandwidth_mib: int
    exact_len: int  # prompt tokens in the exactness checks


FULL = Sizes(QWEN25_1_5B, (64, 256), 2048, 32, 3, 8, 2048, 8192, 4096, 512)
SMOKE = Sizes(TOY, (4, 8), 256, 8, 2, 4, 128, 512, 64, 48)


# ------------------------------------------------------------------ ceilings
def _best(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(mib: int) -> float:
    """Bytes/s of a jitted sum over `mib` MiB of bf16 (far beyond any cache): the read ceiling."""
    x = jnp.ones((mib * 2**20 // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    return x.nbytes / _best(lambda: total(x), 10)


def matmul_peak(n: int) -> float:
    """FLOP/s of a jitted n³ bf16 matmul with f32 accumulation (random data)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    return 2 * n**3 / _best(lambda: mm(a), 10)


# --------------------------------------------------------------------- exact
def _check(name: str, diff: float, tol: float, **extra) -> dict:
    ok = bool(diff <= tol)
    print(f"  {'PASS' if ok else 'FAIL'} {name}: max |diff| {diff:.3g} (tol {tol:g})", flush=True)
    return {"max_abs_diff": float(diff), "tol": tol, "pass": ok, **extra}


def _full_logprobs(model, seq: list[int]) -> np.ndarray:
    tokens = jnp.asarray([seq], jnp.int32)
    t = tokens.shape[1]
    logits = model(tokens, jnp.arange(t)[None], causal_mask(jnp.ones((1, t), bool)))
    return np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))


def part_exact(sizes: Sizes, args) -> dict:
    out = {}
    cfg = ModelConfig(**sizes.model, dtype="bfloat16", param_dtype="bfloat16")
    model = init_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, cfg.vocab_size, sizes.exact_len).tolist()
    n_new = 16
    # bf16 logits move by ~2^-8 of their size between two summation orders; log-probs of a
    # random model's near-uniform distribution are ~ -log V, so a few 1e-2 is rounding, not error.
    tol = 0.1

    # (1) cached decode vs full forward
    engine = Engine(model, num_slots=4, max_len=sizes.exact_len + 64, kv_dtype="bfloat16")
    (slot,) = engine.allocate(1)
    engine.append({slot: prompt})
    res = engine.decode(
        [slot],
        max_new_tokens=n_new,
        sampling=SamplingParams.make(1, temperature=0.0),
        keys=jax.random.split(jax.random.key(0), 1),
    )
    toks, logps, _ = res.row(0)
    full = _full_logprobs(model, prompt + toks)
    ref = full[np.arange(len(prompt) - 1, len(prompt) - 1 + len(toks)), toks]
    out["cached_vs_full"] = _check(
        "cached decode vs full forward",
        np.max(np.abs(np.asarray(logps) - ref)),
        tol,
        kernels=engine.kernels.value,
    )

    # (2) fork vs recompute: branches from a prefix inside the sequence vs the prefix prefilled afresh
    cut = len(prompt) + 5
    prefix = (prompt + toks)[:cut]
    branches = engine.allocate(2)
    engine.fork([slot, slot], branches, [prefix] * 2)
    keys = jax.random.split(jax.random.key(1), 2)
    sampled = SamplingParams.make(2, temperature=1.0)
    forked = engine.decode(branches, max_new_tokens=n_new, sampling=sampled, keys=keys)
    fresh_engine = Engine(model, num_slots=2, max_len=sizes.exact_len + 64, kv_dtype="bfloat16")
    fresh = fresh_engine.allocate(2)
    fresh_engine.append({s: prefix for s in fresh})
    again = fresh_engine.decode(fresh, max_new_tokens=n_new, sampling=sampled, keys=keys)
    same_tokens = all(forked.row(i)[0] == again.row(i)[0] for i in range(2))
    diff = max(np.max(np.abs(np.asarray(forked.row(i)[1]) - np.asarray(again.row(i)[1]))) for i in range(2))
    out["fork_vs_recompute"] = _check(
        "fork vs recompute", diff if same_tokens else math.inf, tol, same_tokens=same_tokens
    )

    # (3) the Pallas decode kernels vs their XLA references (the real kernels on a GPU)
    platform, interpret = platform_for_backend()
    b, h, k, d, u = 8, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 1024 if sizes is FULL else 128
    q = jnp.asarray(rng.normal(size=(b, h, d)), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    kk = jnp.asarray(rng.normal(size=(b, k, u, d)), jnp.bfloat16)
    vv = jnp.asarray(rng.normal(size=(b, k, u, d)), jnp.bfloat16)
    lengths = jnp.asarray(rng.integers(1, u + 1, b), jnp.int32)
    want = decode_attention_xla(q, kk[None], vv[None], 0, jnp.arange(b), lengths)
    if platform == "gpu":
        got = slot_attention_pallas(q, kk, vv, lengths, interpret=interpret)
        out["pallas_slots"] = _check(
            "Pallas slot decode vs XLA", float(jnp.max(jnp.abs(got - want))), 2e-2, interpret=interpret
        )
    p = 16
    pages = kk.reshape(b, k, u // p, p, d).transpose(1, 0, 2, 3, 4).reshape(k, b * u // p, p, d)
    vpages = vv.reshape(b, k, u // p, p, d).transpose(1, 0, 2, 3, 4).reshape(k, b * u // p, p, d)
    table = jnp.arange(b * u // p, dtype=jnp.int32).reshape(b, u // p)
    got = paged_attention_pallas(q, pages, vpages, table, lengths, platform=platform, interpret=interpret)
    ref = paged_attention_xla(q, pages, vpages, table, lengths)
    out["pallas_pages"] = _check(
        f"Pallas paged decode ({platform}) vs XLA",
        float(jnp.max(jnp.abs(got - ref))),
        2e-2,
        interpret=interpret,
    )

    # (4) cuDNN causal attention vs XLA (GPU only)
    if jax.default_backend() == "gpu":
        t = 1024
        qs = jnp.asarray(rng.normal(size=(4, t, h, d)), jnp.bfloat16)
        ks = jnp.asarray(rng.normal(size=(4, t, k, d)), jnp.bfloat16)
        vs = jnp.asarray(rng.normal(size=(4, t, k, d)), jnp.bfloat16)
        mask = CausalMask(jnp.asarray([t, 700, 33, 1], jnp.int32))
        a = causal_attention(qs, ks, vs, mask, impl="cudnn").astype(jnp.float32)
        r = causal_attention(qs, ks, vs, mask, impl="xla").astype(jnp.float32)
        real = np.asarray(mask.valid(t))
        diff = float(np.max(np.abs(np.asarray(a - r))[real]))
        out["cudnn_causal"] = _check("cuDNN causal attention vs XLA", diff, 2e-2)

    # (5) packed vs paths train-step loss on the same trees
    trees = random_forest(
        np.random.default_rng(7), num_prompts=3, trees=2, branches=2, rounds=1, vocab=cfg.vocab_size
    )
    optim = OptimConfig(learning_rate=1e-5, warmup_ratio=0.0, total_steps=10)
    loss_cfg = LossConfig(kl_coef=0.0, entropy_coef=0.0)
    step = jit_train_step(None, loss_cfg=loss_cfg, optim_cfg=optim)
    losses = {}
    for kind in ("paths", "packed"):
        params = jax.tree.map(jnp.copy, nnx.state(model))  # the step donates its state
        state = create_train_state(nnx.merge(nnx.graphdef(model), params), optim)[0]
        layout = BatchLayout(length_buckets=(64, 128), row_multiple=2, kind=kind)
        _, metrics = step(state, batch_from_trees(trees, layout), None)
        losses[kind] = float(metrics["loss"])
    out["packed_vs_paths_loss"] = _check(
        "packed vs paths loss", abs(losses["packed"] - losses["paths"]), 2e-2, **losses
    )

    # (6) sharded vs one device
    if jax.device_count() >= 2:
        from treegrpo_jax.parallel import MeshConfig, make_mesh

        mesh = make_mesh(MeshConfig(shape=(1, -1, 1)))
        sharded = init_model(cfg, seed=0, mesh=mesh)
        tokens = jnp.asarray([prompt[:64]] * jax.device_count(), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(64), tokens.shape)
        m = causal_mask(jnp.ones(tokens.shape, bool))
        diff = float(jnp.max(jnp.abs(sharded(tokens, pos, m) - model(tokens, pos, m))))
        out["sharded_vs_one_device"] = _check("sharded vs one device", diff, 0.1)
    else:
        out["sharded_vs_one_device"] = {"skipped": f"{jax.device_count()} device(s)"}
        print("  (sharded vs one device: skipped, one device)")
    return out


# -------------------------------------------------------------------- decode
def _ours(model, cfg, batch: int, sizes: Sizes, prompt: list[int]) -> dict:
    """Every row continues the same `prompt` (forked from one prefilled slot before each timed call)."""
    engine = Engine(
        model, num_slots=batch + 1, max_len=sizes.context + sizes.decode_steps + 16, kv_dtype="bfloat16"
    )
    slots = engine.allocate(batch + 1)
    rows, source = slots[:-1], slots[-1]
    engine.append({source: prompt})
    sampling = SamplingParams.make(batch, temperature=0.0)
    keys = jax.random.split(jax.random.key(0), batch)

    def run() -> tuple[float, np.ndarray]:
        engine.fork([source] * batch, rows)
        jax.block_until_ready(engine.cache)
        t0 = time.perf_counter()
        res = engine.decode(
            rows,
            max_new_tokens=sizes.decode_steps,
            sampling=sampling,
            keys=keys,
            num_steps=sizes.decode_steps,
        )
        return time.perf_counter() - t0, res.tokens

    run()  # compile
    times, tokens = [], None
    for _ in range(sizes.repeats):
        s, tokens = run()
        times.append(s)
    ms = 1e3 * statistics.median(times) / sizes.decode_steps
    return {
        "ms_per_step": ms,
        "tokens_per_s": batch / (ms / 1e3),
        "kernels": engine.kernels.value,
        "tokens": tokens,
    }


def _transformers(model, cfg, batch: int, sizes: Sizes, prompts: np.ndarray, hf_cache: dict) -> dict:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        return {"skipped": f"transformers/torch not importable: {e}"}
    from treegrpo_jax.model.weights_hf import save_hf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "model" not in hf_cache:
        with tempfile.TemporaryDirectory() as tmp:
            save_hf(model, cfg, tmp)
            hf_cache["model"] = (
                AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).to(device).eval()
            )
    hf = hf_cache["model"]
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ids = torch.from_numpy(np.array(prompts, np.int64)).to(device)

    def gen(n):
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                use_cache=True,
            )
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    def timed(n):
        t0 = time.perf_counter()
        out = gen(n)
        return time.perf_counter() - t0, out

    gen(2)  # warm-up
    # Decode time alone: a run of N+1 new tokens minus a run of 1 (the prefill and the first token).
    steps = sizes.decode_steps
    one, many = [], []
    out = None
    for _ in range(sizes.repeats):
        one.append(timed(1)[0])
        s, out = timed(steps + 1)
        many.append(s)
    ms = 1e3 * max(statistics.median(many) - statistics.median(one), 1e-9) / steps
    return {
        "ms_per_step": ms,
        "tokens_per_s": batch / (ms / 1e3),
        "device": device,
        "attn_implementation": hf.config._attn_implementation,
        "tokens": out[:, prompts.shape[1] + 1 : prompts.shape[1] + 1 + steps].cpu().numpy(),
    }


def part_decode(sizes: Sizes, args, ceilings: dict) -> dict:
    cfg = ModelConfig(**sizes.model, dtype="bfloat16", param_dtype="bfloat16")
    model = init_model(cfg, seed=0)
    weight_bytes = cfg.num_params * 2
    rows, hf_cache = [], {}
    for batch in sizes.batches:
        prompt = np.random.default_rng(batch).integers(1, cfg.vocab_size, sizes.context)
        prompts = np.broadcast_to(prompt, (batch, sizes.context))
        ours = _ours(model, cfg, batch, sizes, prompt.tolist())
        live = sizes.context + sizes.decode_steps / 2
        kv_bytes = cfg.num_layers * 2 * batch * cfg.num_kv_heads * cfg.head_dim * 2 * live
        roofline_ms = 1e3 * (weight_bytes + kv_bytes) / ceilings["read_bytes_per_s"]
        peer = _transformers(model, cfg, batch, sizes, prompts, hf_cache)
        row = {
            "batch": batch,
            "context": sizes.context,
            "ours_ms_per_step": ours["ms_per_step"],
            "ours_tokens_per_s": ours["tokens_per_s"],
            "kernels": ours["kernels"],
            "roofline_ms_per_step": roofline_ms,
            "of_roofline": roofline_ms / ours["ms_per_step"],
            "bytes_per_step": weight_bytes + kv_bytes,
        }
        if "skipped" in peer:
            row["transformers"] = peer
        else:
            row.update(
                transformers_ms_per_step=peer["ms_per_step"],
                transformers_tokens_per_s=peer["tokens_per_s"],
                speedup_vs_transformers=peer["ms_per_step"] / ours["ms_per_step"],
                transformers_attn=peer["attn_implementation"],
                # Greedy tokens of the first step agree unless bf16 rounding breaks a near-tie.
                first_token_agreement=float(np.mean(ours["tokens"][:, 0] == peer["tokens"][:, 0])),
            )
        print(
            f"  batch {batch}: ours {ours['ms_per_step']:.2f} ms/step ({row['of_roofline']:.0%} of roofline"
            f" {roofline_ms:.2f} ms)"
            + (
                f", transformers {row['transformers_ms_per_step']:.2f} ms/step"
                if "transformers_ms_per_step" in row
                else ""
            ),
            flush=True,
        )
        rows.append(row)
    return {
        "model": "Qwen2.5-1.5B shape" if sizes is FULL else "toy",
        "num_params": cfg.num_params,
        "rows": rows,
    }


# ----------------------------------------------------------------------- mfu
def part_mfu(sizes: Sizes, args, ceilings: dict) -> dict:
    cfg = ModelConfig(**sizes.model, dtype="bfloat16", param_dtype="float32")
    model = init_model(cfg, seed=0)
    optim = OptimConfig(learning_rate=1e-6, warmup_ratio=0.0, total_steps=100)
    state, _ = create_train_state(model, optim)
    layout = BatchLayout(length_buckets=(sizes.train_seq,), row_multiple=sizes.train_rows)
    batch = jax.device_put(
        build_batch(
            random_path_rows(
                sizes.train_rows, sizes.train_seq, cfg.vocab_size, prompt_len=min(128, sizes.train_seq // 16)
            ),
            layout,
        )
    )
    step = jit_train_step(None, loss_cfg=LossConfig(kl_coef=0.0, entropy_coef=0.0), optim_cfg=optim)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch, None).compile()
    compile_s = time.perf_counter() - t0
    box = {"state": state}

    def run():
        box["state"], metrics = compiled(box["state"], batch, None)
        return metrics

    jax.block_until_ready(run())
    times = []
    for _ in range(sizes.repeats + 1):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    tokens = sizes.train_rows * sizes.train_seq
    n_matmul = cfg.num_params - cfg.vocab_size * cfg.embed_dim * (0 if cfg.tie_embeddings else 1)
    flops = 6 * n_matmul * tokens
    mfu = flops / s / ceilings["bf16_flops_per_s"]
    print(f"  train step {s * 1e3:.0f} ms for {tokens} tokens: MFU {mfu:.1%} (compile {compile_s:.0f} s)")
    return {
        "step_s": s,
        "tokens": tokens,
        "model_flops": flops,
        "mfu": mfu,
        "compile_s": compile_s,
        "layout": "paths",
        "attention": "cudnn" if jax.default_backend() == "gpu" else "dense",
    }


# ------------------------------------------------------------------- smollm2
def part_smollm2(sizes: Sizes, args) -> dict:
    import importlib.util

    from treegrpo_jax.model import assets
    from treegrpo_jax.train.config import from_config_dict
    from treegrpo_jax.train.loop import train_and_evaluate
    from treegrpo_jax.train.metrics import read_metrics

    path = Path(__file__).parents[1] / "configs/multihop.py"
    spec = importlib.util.spec_from_file_location("multihop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        assets.smollm2_gguf_path()
        variant = "smollm2"
    except FileNotFoundError as e:  # e.g. a machine the 94 MiB wheel cannot be carried to
        print(f"  {e}: running :tiny (the scratch model) instead", flush=True)
        variant = "tiny"
    c = module.get_config(f"{variant},smoke" if sizes is SMOKE else variant)
    if sizes is FULL:  # a few minutes on one H200: a short cold start, then as many RL steps as fit
        c.sft.steps, c.run.steps, c.run.eval_every, c.data.eval_prompts = 150, 8, 8, 128
        c.run.checkpoint_every = 8
    workdir = tempfile.mkdtemp(prefix="gpu_check_smollm2_")
    t0 = time.perf_counter()
    final = train_and_evaluate(from_config_dict(c), workdir)
    evals = [r for r in read_metrics(Path(workdir) / "metrics.jsonl") if "eval/em" in r]
    return {
        "config": variant,
        "wall_s": time.perf_counter() - t0,
        "sft_steps": c.sft.steps,
        "rl_steps": c.run.steps,
        "eval_questions": c.data.eval_prompts,
        "em_before": evals[0]["eval/em"],
        "em_after": final.get("eval/em"),
        "workdir": workdir,
    }


# ---------------------------------------------------------------------- main
def _table(result: dict) -> None:
    print(
        f"\n{result['device']}: ceilings read {result['ceilings']['read_bytes_per_s'] / 1e9:.0f} GB/s, "
        f"bf16 matmul {result['ceilings']['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"
    )
    for name, check in result.get("exact", {}).items():
        if isinstance(check, dict) and "pass" in check:
            verdict = "PASS" if check["pass"] else "FAIL"
            print(f"  exact {name:<24} {verdict}  {check['max_abs_diff']:.3g} ≤ {check['tol']}")
    for row in result.get("decode", {}).get("rows", []):
        vs = (
            f"{row['speedup_vs_transformers']:.2f}x transformers" if "speedup_vs_transformers" in row else "-"
        )
        print(
            f"  decode batch {row['batch']:>4}: {row['ours_ms_per_step']:.2f} ms/step, "
            f"{row['of_roofline']:.0%} of roofline, {vs}"
        )
    if "mfu" in result and "mfu" in result["mfu"]:
        print(f"  train step MFU {result['mfu']['mfu']:.1%}")
    if "smollm2" in result and "em_before" in result["smollm2"]:
        s = result["smollm2"]
        em = f"{100 * s['em_before']:.1f} -> {100 * s['em_after']:.1f}"
        print(f"  :smollm2 EM {em} ({s['sft_steps']} SFT steps, {s['rl_steps']} RL steps)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="exact,decode,mfu,smollm2")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on any backend (CI)")
    ap.add_argument("--out", default="workdir/gpu_check.json")
    args = ap.parse_args()
    sizes = SMOKE if args.smoke else FULL
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"exact", "decode", "mfu", "smollm2"}
    if unknown:
        sys.exit(f"gpu_check: unknown parts {sorted(unknown)}")
    dev = jax.devices()[0]
    result = {
        "device": f"{jax.device_count()} × {dev.device_kind} ({jax.default_backend()})",
        "jax": jax.__version__,
        "smoke": args.smoke,
        "t_start": time.time(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write():
        out.write_text(
            json.dumps(result, indent=2, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x))
        )

    print(f"gpu_check on {result['device']}, jax {jax.__version__}: measuring ceilings", flush=True)
    result["ceilings"] = {
        "read_bytes_per_s": read_bandwidth(sizes.bandwidth_mib),
        "bf16_flops_per_s": matmul_peak(sizes.peak_n),
    }
    write()
    for part in parts:
        t0 = time.perf_counter()
        print(f"[{part}]", flush=True)
        try:
            if part == "exact":
                result[part] = part_exact(sizes, args)
            elif part == "decode":
                result[part] = part_decode(sizes, args, result["ceilings"])
            elif part == "mfu":
                result[part] = part_mfu(sizes, args, result["ceilings"])
            else:
                result[part] = part_smollm2(sizes, args)
        except Exception as e:  # a part that cannot run here is recorded; the next one still runs
            traceback.print_exc()
            result[part] = {"error": f"{type(e).__name__}: {e}"}
        result[part]["part_s"] = time.perf_counter() - t0
        write()
    _table(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
