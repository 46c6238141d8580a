"""What a long-lived training process holds, and the guard against XLA:CPU's mapping limit.

Each RL step logs `process/*` (Linux, read from /proc/self): resident memory, live threads, open
files, memory mappings and compiled programs so far, so a run that leaks shows it in its own
metrics (`benchmarks/soak.py` reads them over hundreds of steps).

Why mappings: XLA:CPU keeps ~6 memory mappings per live compiled executable (its JIT code and
data), and the kernel allows a process `vm.max_map_count` of them (65,530 by default). A process
that keeps enough distinct programs alive reaches the limit, and the next `mmap` inside XLA's
compiler fails — a segfault or abort in `backend_compile_and_load`, not a Python error
(`benchmarks/map_count.py` and tests/train/test_process_stats.py reproduce it). A training run
compiles a bounded set of shape buckets, so it should never come near; `release_if_near_limit`
makes sure: past a fraction of the limit it drops JAX's caches of compiled programs (they
recompile on next use) and says so, instead of letting the process die.
"""

from __future__ import annotations

import contextlib
import os
import pathlib

from absl import logging

from treegrpo_jax.train.compile_clock import compile_count

_PROC = pathlib.Path("/proc/self")


def map_count() -> int | None:
    """Memory mappings of this process (lines of /proc/self/maps); None off Linux."""
    try:
        with open(_PROC / "maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_limit() -> int | None:
    """The kernel's per-process mapping limit, `vm.max_map_count`; None off Linux."""
    try:
        return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


def _status() -> dict[str, int]:
    """VmRSS (kB) and Threads from /proc/self/status."""
    out = {}
    try:
        for line in (_PROC / "status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "Threads"):
                out[name] = int(value.split()[0])
    except OSError:
        pass
    return out


def sample() -> dict[str, float]:
    """`process/*` metrics of this process now (keys that cannot be read are left out)."""
    status = _status()
    out: dict[str, float] = {"process/compiled_programs": float(compile_count())}
    if "VmRSS" in status:
        out["process/rss_mb"] = status["VmRSS"] / 1024
    if "Threads" in status:
        out["process/threads"] = float(status["Threads"])
    with contextlib.suppress(OSError):
        out["process/open_files"] = float(len(os.listdir(_PROC / "fd")))
    maps = map_count()
    if maps is not None:
        out["process/memory_maps"] = float(maps)
    return out


def release_if_near_limit(fraction: float = 0.5) -> bool:
    """Drops JAX's compiled-program caches when this process's mappings pass `fraction` of
    `vm.max_map_count`; returns whether it did. Programs still referenced elsewhere keep their
    mappings; the jit caches are what grows without bound in a long process."""
    maps, limit = map_count(), map_limit()
    if maps is None or limit is None or maps <= fraction * limit:
        return False
    import jax

    jax.clear_caches()
    logging.warning(
        "this process holds %d memory mappings, past %.0f%% of vm.max_map_count=%d (XLA:CPU keeps ~6 "
        "per compiled program, and compiling past the limit crashes): released JAX's compiled "
        "programs, %d mappings now",
        maps,
        100 * fraction,
        limit,
        map_count() or 0,
    )
    return True
