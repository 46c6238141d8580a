"""`rollout.py --parts=profile`: our Engine's decode alone, ms per step against batch B, live
context U and pool length T, with a least-squares fit `step = fixed + a*B + b*B*U + c*B*T` and
the FLOP floor at the matmul rate measured in the same run."""

from __future__ import annotations

import functools

import jax
import numpy as np
from _common import round_robin, timed
from _roofline import matmul_gflops

from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.sampling import SamplingParams


def _decode_flops(cfg: ModelConfig, rows: int, keys: float) -> float:
    """Approximate FLOPs of one decode step: weight matmuls + attention over `keys` keys."""
    weights = cfg.num_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.embed_dim)  # no lookup
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys  # q·k and p·v
    return rows * (2 * weights + attention)


def _profile_measures(bc, model: Decoder, cfg: ModelConfig, *, batch: int, pool_len: int):
    """{(context, pool_len): measure} for one pool of `batch` rows: every context that fits.

    One extra slot per context holds it (prefilled once, one ragged append); before every
    timed call it is forked to the `batch` decoding rows, so each call decodes from the
    same state. A measure returns the seconds of the decode alone (fork not timed).
    """
    rng = np.random.default_rng(bc.seed + 1)
    contexts = [c for c in bc.profile_contexts if c + bc.profile_steps + 1 <= pool_len]
    engine = Engine(model, num_slots=batch + len(contexts), max_len=pool_len)
    slots = engine.allocate(batch + len(contexts))
    rows, sources = slots[:batch], slots[batch:]
    engine.append(
        {s: rng.integers(1, cfg.vocab_size, c).tolist() for s, c in zip(sources, contexts, strict=True)}
    )
    sampling = SamplingParams.make(batch, temperature=0.0)
    keys = jax.random.split(jax.random.key(bc.seed), batch)

    def measure(source):
        engine.fork([source] * batch, rows)
        jax.block_until_ready(engine.cache)
        return timed(
            lambda: engine.decode(rows, max_new_tokens=bc.profile_steps, sampling=sampling, keys=keys)
        )

    return {(c, pool_len): functools.partial(measure, s) for s, c in zip(sources, contexts, strict=True)}


def run_profile(bc, model: Decoder, cfg: ModelConfig) -> dict:
    """Our Engine's decode alone: ms per step against batch, live context and pool length.

    Every batch runs each context in a pool long enough for the longest one, and the
    shortest context again in a short pool: at equal live context, a step should not
    cost more in a longer pool (no per-step copies of the whole cache). The cases of one
    batch are timed interleaved.
    """
    steps = bc.profile_steps
    gflops = matmul_gflops()
    # Powers of two (at least 128, like the engine's attention spans), so that at equal
    # context both pools attend over the same span and differ only in their length.
    lens = (max(bc.profile_contexts) + steps + 1, min(bc.profile_contexts) + steps + 1)
    pools = sorted({max(128, 1 << (n - 1).bit_length()) for n in lens}, reverse=True)
    points = []
    for b in bc.profile_batches:
        measures = {}
        for pool_len in pools:
            measures |= _profile_measures(bc, model, cfg, batch=b, pool_len=pool_len)
        for measure in measures.values():
            measure()  # compile
        for (ctx, pool_len), seconds in round_robin(measures, bc.repeats).items():
            # Interference from other processes only ever adds time: the fastest call is
            # the least noisy estimate of the step cost (the median is kept alongside).
            ms = 1e3 * min(seconds) / steps
            bound_ms = 1e3 * _decode_flops(cfg, b, ctx + steps / 2) / (gflops * 1e9)
            points.append(
                {
                    "batch": b,
                    "context": ctx,
                    "pool_len": pool_len,
                    "ms_per_step": ms,
                    "median_ms_per_step": 1e3 * float(np.median(seconds)) / steps,
                    "us_per_row_step": 1e3 * ms / b,
                    "flop_bound_ms_per_step": bound_ms,
                    "fraction_of_matmul_peak": bound_ms / ms,
                }
            )
    profile = {"steps_per_call": steps, "cpu_matmul_gflops": gflops, "points": points}
    return {"profile": profile | _fit(points, steps)}


def _fit(points: list[dict], steps: int) -> dict:
    """Least squares `ms/step = fixed + per_row*B + per_row_key*B*U + per_row_pool*B*T`.

    U: mean live keys over the call (context + steps/2); T: pool length per slot.
    """
    if len(points) < 4:
        return {}
    a = np.asarray(
        [
            [1.0, p["batch"], p["batch"] * (p["context"] + steps / 2), p["batch"] * p["pool_len"]]
            for p in points
        ]
    )
    y = np.asarray([p["ms_per_step"] for p in points])
    (fixed, per_row, per_row_key, per_row_pool), *_ = np.linalg.lstsq(a, y, rcond=None)
    return {
        "fit": {
            "fixed_ms_per_step": float(fixed),
            "per_row_us_per_step": float(1e3 * per_row),
            "per_row_key_ns_per_step": float(1e6 * per_row_key),
            "per_row_pool_token_ns_per_step": float(1e6 * per_row_pool),
        }
    }


def print_profile(result: dict) -> None:
    if "profile" not in result:
        return
    p = result["profile"]
    print(f"\nEngine decode profile ({p['steps_per_call']} steps per call, fastest call; "
          f"CPU f32 matmul {p['cpu_matmul_gflops']:.0f} GFLOP/s)")  # fmt: skip
    head = ("batch", "context", "pool", "ms/step", "us/row", "flop-bound ms", "of peak")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (6, 8, 6, 9, 8, 14, 8), strict=True)))
    for q in p["points"]:
        print(f"{q['batch']:>6} {q['context']:>8} {q['pool_len']:>6} {q['ms_per_step']:9.2f} "
              f"{q['us_per_row_step']:8.1f} "
              f"{q['flop_bound_ms_per_step']:14.2f} {q['fraction_of_matmul_peak']:8.1%}")  # fmt: skip
    if "fit" in p:
        f = p["fit"]
        print(f"fit: {f['fixed_ms_per_step']:.2f} ms fixed + {f['per_row_us_per_step']:.1f} us/row "
              f"+ {f['per_row_key_ns_per_step']:.2f} ns/(row*key) "
              f"+ {f['per_row_pool_token_ns_per_step']:.2f} ns/(row*pool token) per step")  # fmt: skip
