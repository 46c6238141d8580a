"""`rollout.py --parts=decode`: our public generate call against `transformers` and Tunix.

One tiny Llama with random weights, copied into all three systems, greedy, fixed lengths (P
prompt, N new tokens, no EOS), batch 32 and 128, each system's generate timed end to end
(prefill included), interleaved in a rotating order; see `rollout.py`'s docstring.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from collections.abc import Callable

import _peers
import numpy as np
from _common import geomean, num_cores, round_robin, timed

from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.rollout.generate import generate_ids

SYSTEMS = ("ours", "transformers", "tunix")


def engine_generator(model: Decoder, *, new_tokens: int) -> _peers.Generate:
    """Ours, through the public `generate_ids` (a fresh Engine, append, decode, per call)."""

    def generate(prompts: np.ndarray) -> np.ndarray:
        out = generate_ids(model, prompts.tolist(), max_new_tokens=new_tokens)
        return np.asarray(out)

    return generate


def _torch_threads(bc, build: Callable[[int], _peers.Generate], probe: np.ndarray):
    """(generate, probe record): the requested thread count, or the faster of cores and 1.

    PyTorch's OpenMP workers spin at barriers; on a CPU shared with other processes two
    threads can run several times slower than one, which would flatter our ratio.
    """
    if bc.torch_threads is not None:
        return build(bc.torch_threads), {"requested": bc.torch_threads}
    seconds = {}
    for threads in sorted({num_cores(), 1}, reverse=True):
        gen = build(threads)
        gen(probe)  # warm-up
        seconds[threads] = min(timed(lambda gen=gen: gen(probe)) for _ in range(2))
    best = min(seconds, key=seconds.get)
    return build(best), {"probe_rows": len(probe), "probe_seconds": seconds, "chosen": best}


def build_systems(bc, model: Decoder, cfg: ModelConfig, probe: np.ndarray):
    """{name: generate} for the systems that can run, and {name: reason} for those that cannot."""
    systems: dict[str, _peers.Generate] = {"ours": engine_generator(model, new_tokens=bc.new_tokens)}
    unavailable: dict[str, str] = {}
    info: dict[str, dict] = {}

    def transformers():
        def build(threads):
            return _peers.transformers_generator(model, cfg, new_tokens=bc.new_tokens, threads=threads)

        gen, info["transformers_threads"] = _torch_threads(bc, build, probe)
        return gen

    def tunix():
        return _peers.tunix_generator(model, cfg, prompt_len=bc.prompt_len, new_tokens=bc.new_tokens)

    for name, make in (("transformers", transformers), ("tunix", tunix)):
        try:
            systems[name] = make()
            info[name] = getattr(systems[name], "info", {})
        except _peers.PeerUnavailable as e:
            unavailable[name] = str(e)
        except Exception as e:  # noqa: BLE001 -- a peer that cannot be built is a result, not a crash
            unavailable[name] = f"building it failed: {type(e).__name__}: {e}"
            traceback.print_exc()
    return systems, unavailable, info


def run_decode(bc, model: Decoder, cfg: ModelConfig) -> dict:
    """The side-by-side decode-throughput part (see the module docstring)."""
    rng = np.random.default_rng(bc.seed)
    # Ids from 1: Tunix treats the pad id (0) in a prompt as padding.
    prompts_of = {b: rng.integers(1, cfg.vocab_size, (b, bc.prompt_len)) for b in bc.batches}
    systems, unavailable, info = build_systems(bc, model, cfg, prompts_of[min(bc.batches)][:8])
    per_batch = {}
    for b in bc.batches:
        prompts = prompts_of[b]
        tokens, failed = {}, {}
        for name, gen in list(systems.items()):  # warm-up (compiles) and the tokens compared
            try:
                tokens[name] = gen(prompts)
            except Exception as e:  # noqa: BLE001 -- a peer failing is a result, not a crash
                if name == "ours":
                    raise  # our engine failing is a bug to see, not a row of the table
                failed[name] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        runnable = {n: g for n, g in systems.items() if n not in failed}
        measures = {n: functools.partial(timed, functools.partial(g, prompts)) for n, g in runnable.items()}
        seconds = round_robin(measures, bc.repeats)
        row = {"batch": b, "failed": failed}
        for name, secs in seconds.items():
            med = float(np.median(secs))
            row[name] = {
                "seconds": secs,
                "median_seconds": med,
                "tokens_per_s": b * bc.new_tokens / med,
                "greedy_token_agreement_with_ours": float(np.mean(tokens[name] == tokens["ours"])),
            }
        per_batch[str(b)] = row

    def speedup(peer):
        ratios = [
            r["ours"]["tokens_per_s"] / r[peer]["tokens_per_s"] for r in per_batch.values() if peer in r
        ]
        return geomean(ratios) if len(ratios) == len(per_batch) else None

    return {
        "decode_speedup_vs_transformers": speedup("transformers"),
        "decode_speedup_vs_tunix": speedup("tunix"),
        "decode_speedup_basis": f"geometric mean over batches {list(bc.batches)} of per-batch "
        "ratios of median tokens/s (end to end: prefill + decode)",
        "decode": {
            "model": dataclasses.asdict(cfg) | {"num_params": cfg.num_params},
            "prompt_len": bc.prompt_len,
            "new_tokens": bc.new_tokens,
            "repeats": bc.repeats,
            "greedy": True,
            "systems_unavailable": unavailable,
            "systems_info": info,
            "per_batch": per_batch,
        },
    }


def print_decode(result: dict) -> None:
    if "decode" not in result:
        return
    d = result["decode"]
    print(f"\nDecode throughput, tokens/s (P={d['prompt_len']}, N={d['new_tokens']}, greedy, "
          f"median of {d['repeats']}; prefill included)")  # fmt: skip
    print(f"{'batch':>6} " + " ".join(f"{s:>14}" for s in SYSTEMS) + f" {'vs tf':>7} {'vs tunix':>8}")
    for b, row in d["per_batch"].items():
        cells = [f"{row[s]['tokens_per_s']:14.0f}" if s in row else f"{'n/a':>14}" for s in SYSTEMS]
        ratios = [
            f"{row['ours']['tokens_per_s'] / row[s]['tokens_per_s']:.2f}x" if s in row else "n/a"
            for s in ("transformers", "tunix")
        ]
        print(f"{b:>6} " + " ".join(cells) + f" {ratios[0]:>7} {ratios[1]:>8}")
    for name, why in d["systems_unavailable"].items():
        print(f"  {name}: unavailable: {why}")
    for b, row in d["per_batch"].items():
        for name, why in row["failed"].items():
            print(f"  {name} failed at batch {b}: {why}")
    for key in ("decode_speedup_vs_transformers", "decode_speedup_vs_tunix"):
        value = result[key]
        print(f"{key}: {'n/a' if value is None else f'{value:.2f}'}")
    print(f"  ({result['decode_speedup_basis']})")
