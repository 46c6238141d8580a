"""Kill a real training run at a chosen moment, run the same command again, compare parameters.

`TrainCommand` is `python launch/train.py --config=... --workdir=...` exactly as a user types
it; `start` runs it in a subprocess (logs to files, so a chatty child never blocks), the
`*_written` predicates watch the workdir for a kill moment, `kill` sends SIGKILL (nothing
runs in the child after it: no handler, no flush), and `final_params` reads a checkpoint's
parameters back for a bitwise comparison with an uninterrupted run.

All runs of one check share a persistent XLA compilation cache (`cache_dir`), so only the
first one pays for compiling; a cached executable is the same program, so the comparison
stays bitwise.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from treegrpo_jax.model.build import abstract_model, param_shardings
from treegrpo_jax.train.checkpoint import CheckpointConfig, Checkpointer
from treegrpo_jax.train.export import load_model_config
from treegrpo_jax.train.metrics import read_metrics

REPO = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainCommand:
    """One training command line (the same for the uninterrupted run and every restart).

    Attributes:
      config: the `--config` value, e.g. "configs/resilience.py" or "configs/resilience.py:http".
      overrides: extra `--config.*=...` flags.
      cache_dir: persistent XLA compilation cache shared by the runs ("" disables it).
    """

    config: str = "configs/resilience.py"
    overrides: tuple[str, ...] = ()
    cache_dir: str = ""

    def argv(self, workdir: str | os.PathLike) -> list[str]:
        return [
            sys.executable,
            str(REPO / "launch" / "train.py"),
            f"--config={REPO / self.config}",
            f"--workdir={workdir}",
            *self.overrides,
        ]

    def env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
        if self.cache_dir:
            env.update(
                JAX_COMPILATION_CACHE_DIR=self.cache_dir,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
            )
        return env

    def start(self, workdir: str | os.PathLike, log_name: str) -> subprocess.Popen:
        """Starts the run; stdout and stderr go to `WORKDIR/../<log_name>.log`."""
        workdir = pathlib.Path(workdir)
        log = workdir.parent / f"{log_name}.log"
        with log.open("ab") as out:
            return subprocess.Popen(
                self.argv(workdir), stdout=out, stderr=subprocess.STDOUT, env=self.env(), cwd=REPO
            )

    def run(self, workdir: str | os.PathLike, log_name: str, timeout_s: float = 900) -> int:
        """Runs to the end; the exit status."""
        proc = self.start(workdir, log_name)
        try:
            return proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def log_tail(workdir: str | os.PathLike, log_name: str, chars: int = 3000) -> str:
    path = pathlib.Path(workdir).parent / f"{log_name}.log"
    return path.read_text(errors="replace")[-chars:] if path.is_file() else ""


# ----------------------------------------------------------------- kill moments
def checkpoint_written(step: int) -> Callable[[pathlib.Path], bool]:
    """True once checkpoint `step` has committed (its directory carries the step's name)."""
    return lambda workdir: (workdir / "checkpoints" / str(step)).is_dir()


def checkpoint_being_written(step: int) -> Callable[[pathlib.Path], bool]:
    """True while Orbax writes `step` into its tmp directory (or once it committed: the
    write can be faster than the poll, and then the kill lands just after the commit)."""

    def seen(workdir: pathlib.Path) -> bool:
        directory = workdir / "checkpoints"
        if not directory.is_dir():
            return False
        return any(
            p.name == str(step) or p.name.startswith(f"{step}.orbax-checkpoint-tmp")
            for p in directory.iterdir()
        )

    return seen


def wait_for(
    proc: subprocess.Popen,
    workdir: str | os.PathLike,
    moment: Callable[[pathlib.Path], bool],
    *,
    timeout_s: float = 600,
    poll_s: float = 0.005,
) -> bool:
    """Waits until `moment(workdir)` holds; False if `proc` ended (or the time ran out) first."""
    workdir, deadline = pathlib.Path(workdir), time.monotonic() + timeout_s
    while not moment(workdir):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def wait_then_kill(
    proc: subprocess.Popen,
    workdir: str | os.PathLike,
    moment: Callable[[pathlib.Path], bool],
    *,
    delay_s: float = 0.0,
    timeout_s: float = 600,
) -> bool:
    """SIGKILLs `proc` `delay_s` after `moment(workdir)` holds; False if it ended first."""
    if not wait_for(proc, workdir, moment, timeout_s=timeout_s):
        return False
    time.sleep(delay_s)
    if proc.poll() is not None:
        return False
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return True


def uncommitted_steps(workdir: str | os.PathLike) -> list[str]:
    """Tmp directories a killed save left behind (they must never be read as a step)."""
    directory = pathlib.Path(workdir) / "checkpoints"
    return (
        sorted(p.name for p in directory.iterdir() if "orbax-checkpoint-tmp" in p.name)
        if directory.is_dir()
        else []
    )


# ------------------------------------------------------------------ comparison
def final_params(workdir: str | os.PathLike, step: int | None = None) -> dict[str, np.ndarray]:
    """The policy parameters of checkpoint `step` (default: the latest), by name, on the host."""
    cfg = load_model_config(workdir)
    _, abstract = abstract_model(cfg)
    shardings = param_shardings(abstract, None)
    abstract = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        abstract,
        shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    ckpt = Checkpointer(workdir, CheckpointConfig(keep=None, async_save=False))
    try:
        params = ckpt.restore_params(step, abstract_params=abstract)
    finally:
        ckpt.close()
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Largest |a - b| over all parameters (inf when the names or shapes differ)."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a)


def bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a
    )


def train_rows(workdir: str | os.PathLike, keys: Sequence[str] = ("train/loss",)) -> list[tuple]:
    """(step, *keys) of every training row of the run's metrics.jsonl."""
    rows = read_metrics(pathlib.Path(workdir) / "metrics.jsonl")
    return [(r["step"], *(r.get(k) for k in keys)) for r in rows if "train/reward_mean" in r]
