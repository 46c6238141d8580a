"""Where one Engine decode step's time goes, by XLA op (issue 15's profiling entry point).

    .venv/bin/python benchmarks/profile_decode.py [--batch=128] [--live=256] [--kernels=native|xla]
        [--kv=float32|bfloat16] [--sampled] [--out=DIR]

Runs `:tiny`-dims decode (random weights) once to compile, then one call of `--steps` steps
under `jax.profiler` and sums the trace's events by name (XLA:CPU thunks: fusions, matmuls
as `ynn_fusion`, the kernels as `ffi_call`, the layer loop as `while`); then, without the
profiler, the step time at `--live` and at one live token, whose difference is what attention
over the live K/V costs (the trace's per-op times include waits of its async executor, so
this ablation is the check on them). The trace stays in `--out` for Perfetto.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _roofline  # noqa: E402

from treegrpo_jax.model.build import init_model  # noqa: E402
from treegrpo_jax.model.config import ModelConfig  # noqa: E402


def _summarise(trace_dir: pathlib.Path, top: int) -> list[tuple[str, float, int]]:
    files = sorted(trace_dir.glob("**/*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no Perfetto trace under {trace_dir}")
    with gzip.open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    total: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(("$", "ThunkExecutor", "Pjit")):
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    return [(name, us / 1e3, count[name]) for name, us in total.most_common(top)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--live", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--kv", default="float32")
    ap.add_argument("--sampled", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/treegrpo_decode_profile"))
    a = ap.parse_args(argv)
    model = init_model(ModelConfig(**_roofline.TINY_DIMS, tie_embeddings=True), seed=0)
    from treegrpo_jax.native import resolve

    impl = resolve(a.kernels).value
    case = _roofline.Case(a.batch, a.live, a.sampled, impl, a.kv)
    measure = _roofline._measure(model, case, steps=a.steps, pool_len=_roofline.POOL_LEN)
    measure()  # compile
    jax.profiler.start_trace(str(a.out), create_perfetto_trace=True)
    traced = measure()
    jax.profiler.stop_trace()
    print(f"{case.name}: traced call {1e3 * traced / a.steps:.2f} ms/step (profiler on)")
    print(f"{'ms/step':>9} {'calls/step':>10}  op")
    for name, ms, n in _summarise(a.out, a.top):
        print(f"{ms / a.steps:9.3f} {n / a.steps:10.1f}  {name}")
    short = _roofline.Case(a.batch, 1, a.sampled, impl, a.kv)
    fixed = _roofline._measure(model, short, steps=a.steps, pool_len=_roofline.POOL_LEN)
    fixed()
    times = {"live": [], "one": []}
    for _ in range(5):
        times["live"].append(measure())
        times["one"].append(fixed())
    live_ms, one_ms = (1e3 * float(np.median(times[k])) / a.steps for k in ("live", "one"))
    print(f"\nwithout profiler (median of 5): {live_ms:.2f} ms/step at {a.live} live tokens, "
          f"{one_ms:.2f} at 1: attention over the live K/V ≈ {live_ms - one_ms:.2f} ms, "
          f"the rest ≈ {one_ms:.2f} ms")  # fmt: skip
    print(f"trace: {a.out} (open the .trace.json.gz in Perfetto); {time.strftime('%H:%M:%S')}")


if __name__ == "__main__":
    main()
