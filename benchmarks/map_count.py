"""What kills a long XLA:CPU process (issue 29 item 1): each compiled executable keeps its own
memory mappings (the JIT's code and data sections), so a process that compiles enough distinct
programs runs into the kernel's per-process mapping limit (`vm.max_map_count`, 65,530 by default)
and the next `mmap` inside XLA's compiler fails: an abort or a segfault in `backend_compile_and_load`.

    .venv/bin/python benchmarks/map_count.py --out=docs/benchmarks/map_count.json         # measure
    .venv/bin/python benchmarks/map_count.py --until_crash --out=/tmp/crash.json          # reproduce

Measure: compiles `--programs` distinct tiny programs (one per input length), sampling the number of
lines of /proc/self/maps every `--every`; then `jax.clear_caches()` and the count again. Prints the
mappings per live executable and how many programs the limit allows. `--until_crash` keeps compiling
(in a child process, which it watches) until the child dies, and records the last count it printed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time


def map_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def max_map_count() -> int:
    try:
        return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except OSError:
        return 65530


def compile_programs(n: int, every: int, start: int = 1, report=None) -> list[tuple[int, int]]:
    """Compiles n distinct programs (x ↦ sin(x)·2 + 1 at lengths start..start+n-1); keeps them live."""
    import jax
    import jax.numpy as jnp

    samples, live = [(0, map_count())], []
    for i in range(n):
        fn = jax.jit(lambda x: jnp.sin(x) * 2.0 + 1.0)
        live.append(fn.lower(jax.ShapeDtypeStruct((start + i,), jnp.float32)).compile())
        if (i + 1) % every == 0:
            samples.append((i + 1, map_count()))
            if report:
                report(i + 1, samples[-1][1])
    return samples


def measure(args) -> dict:
    import jax

    samples = compile_programs(args.programs, args.every)
    before_clear = map_count()
    jax.clear_caches()
    import gc

    gc.collect()
    after_clear = map_count()
    (n0, m0), (n1, m1) = samples[1], samples[-1]
    per_program = (m1 - m0) / (n1 - n0)
    limit = max_map_count()
    return {
        "jax": jax.__version__,
        "programs": args.programs,
        "samples": samples,
        "maps_per_live_executable": per_program,
        "max_map_count": limit,
        "programs_to_reach_limit": int((limit - samples[0][1]) / per_program),
        "maps_before_clear_caches": before_clear,
        "maps_after_clear_caches": after_clear,
        "note": "compiled objects held by the caller (here `live`) keep their mappings after clear_caches",
    }


_CHILD = """
import sys
sys.path.insert(0, {repo!r})
from benchmarks.map_count import compile_programs
compile_programs(10**7, {every}, report=lambda n, m: print(n, m, flush=True))
"""


def until_crash(args) -> dict:
    t0 = time.monotonic()
    child = _CHILD.format(repo=str(pathlib.Path(__file__).resolve().parents[1]), every=args.every)
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    last = (0, 0)
    for line in proc.stdout:
        n, m = map(int, line.split())
        last = (n, m)
        if n % (args.every * 20) == 0:
            print(f"  {n} programs, {m} mappings", flush=True)
    proc.wait()
    stderr = proc.stderr.read()
    return {
        "returncode": proc.returncode,
        "programs_compiled": last[0],
        "maps_at_last_report": last[1],
        "max_map_count": max_map_count(),
        "stderr_tail": stderr[-2000:],
        "wall_s": time.monotonic() - t0,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, default=400)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--until_crash", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    result = until_crash(args) if args.until_crash else measure(args)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
