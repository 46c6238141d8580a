"""Helpers the benchmarks share (every part of `rollout.py`, train_step.py, rl_step_phases.py):
timing, interleaving, the environment record."""

from __future__ import annotations

import math
import os
import pathlib
import platform
import time
from collections.abc import Callable

import _peers
import jax
import numpy as np


def num_cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0))


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of `fn()` (which must block until its result is on the host)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `repeats` calls of `fn()`, each blocked until its result is ready."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def round_robin(measures: dict, repeats: int) -> dict[object, list[float]]:
    """Seconds from every `measure()`, interleaved in a rotating order.

    Load from other processes then hits every measure alike, so their ratios hold even
    when the absolute numbers drift.
    """
    names = list(measures)
    seconds: dict[object, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds[name].append(measures[name]())
    return seconds


def geomean(xs: list[float]) -> float | None:
    return float(math.exp(np.mean(np.log(xs)))) if xs else None


def environment() -> dict:
    """Versions, cores and load: enough to judge how comparable two result files are."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cores": num_cores(),
        "load_average": list(os.getloadavg()),
        "jax_backend": jax.default_backend(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "versions": {
            d: _peers.version_of(d)
            for d in ("jax", "jaxlib", "flax", "torch", "transformers", "google-tunix", "numpy")
        },
    }


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
