"""Metric logs: `WORKDIR/metrics.jsonl` always, TensorBoard event files, optional W&B.

One JSON object per logged step, `{"step": s, "train/reward_mean": ..., ...}`; several
rows may share a step (training metrics, then evaluation metrics). Values are plain JSON
numbers; non-finite floats become the strings "NaN", "Infinity" and "-Infinity" (strict
JSON has no such numbers, and `null` would lose which one it was). `read_metrics` turns
them back into floats.

Resuming: a run restarted from checkpoint `s` re-logs every step after `s`, so the
trainer calls `truncate_after(s)`, which atomically rewrites metrics.jsonl without the
rows of steps > s and makes TensorBoard drop its events after `s` (`purge_step`). A line
torn by a kill mid-write is dropped when the file is next opened.

Multi-host: every process calls `reduce_across_processes` (a collective); only the
primary process (`is_primary=True`) writes anything.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import pathlib
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["MetricsWriter", "read_metrics", "reduce_across_processes"]

log = logging.getLogger(__name__)

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _scalar(key: str, value: Any) -> float | int | str | bool:
    """A JSON-ready Python scalar from a Python / NumPy / JAX scalar (or a string)."""
    if isinstance(value, str | bool):
        return value
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        if np.size(value) != 1:
            raise ValueError(f"metric {key!r} must be a scalar, got shape {np.shape(value)}")
        value = np.asarray(value).reshape(()).item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    raise TypeError(f"metric {key!r} must be a number or a string, got {type(value).__name__}")


def _parse(line: str) -> dict[str, Any]:
    row = json.loads(line)
    return {k: _NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in row.items()}


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads a metrics.jsonl file (non-finite strings back to floats; a torn last line skipped).

    Args:
      path: the file; a missing file reads as no rows.

    Returns:
      The rows in file order.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        return []
    rows = []
    lines = path.read_text(encoding="utf-8").split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(_parse(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the last line, torn by a kill mid-write
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON object: {line[:80]!r}") from None
    return rows


def _rewrite(path: pathlib.Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Replaces `path` by `rows` atomically (a kill leaves either the old or the new file)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({k: _scalar(k, v) for k, v in row.items()}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsWriter:
    """Writes scalar metrics to JSONL, TensorBoard and (optionally) Weights & Biases.

    Args:
      workdir: the run directory; metrics.jsonl and tb/ go there.
      tensorboard: also write TensorBoard event files under `WORKDIR/tb/`.
      wandb_project: log to this W&B project when `wandb` is installed (a one-line
        warning otherwise). The W&B run id is kept in `WORKDIR/wandb_id` so a resumed
        run continues the same W&B run.
      is_primary: only the primary process writes; on others every method is a no-op.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        is_primary: bool = True,
    ):
        self.workdir = pathlib.Path(workdir)
        self.path = self.workdir / "metrics.jsonl"
        self._primary = is_primary
        self._file = None
        self._tb = None
        self._tensorboard = tensorboard
        self._wandb = None
        if not is_primary:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():
            data = self.path.read_bytes()
            if data and not data.endswith(b"\n"):  # a kill mid-line: drop the torn row
                _rewrite(self.path, read_metrics(self.path))
        self._file = self.path.open("a", encoding="utf-8")
        if tensorboard:
            self._tb = self._open_tensorboard(purge_step=None)
        if wandb_project:
            self._wandb = self._open_wandb(wandb_project)

    def _open_tensorboard(self, purge_step: int | None):
        from tensorboardX import SummaryWriter

        # purge_step: TensorBoard hides events at steps >= it from earlier event files.
        return SummaryWriter(logdir=str(self.workdir / "tb"), purge_step=purge_step, flush_secs=30)

    def _open_wandb(self, project: str):
        try:
            import wandb
        except ImportError:
            log.warning("wandb_project=%r but wandb is not installed: not logging to W&B", project)
            return None
        id_file = self.workdir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        try:
            return wandb.init(project=project, dir=str(self.workdir), id=run_id, resume="allow")
        except Exception as e:  # W&B is optional: a login or network problem must not stop training
            log.warning("W&B disabled: wandb.init failed: %s", str(e).splitlines()[0] if str(e) else e)
            return None

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Logs `metrics` at `step` (one JSONL row; numeric values to TensorBoard / W&B).

        Args:
          step: the RL step the metrics belong to.
          metrics: name → Python / NumPy / JAX scalar, or a string (JSONL only).
        """
        if not self._primary:
            return
        values = {k: _scalar(k, v) for k, v in metrics.items() if k != "step"}
        self._file.write(json.dumps({"step": int(step), **values}) + "\n")
        self._file.flush()  # a kill loses at most the row being written
        numeric = {
            k: _NON_FINITE[v] if isinstance(v, str) else float(v)
            for k, v in values.items()
            if not isinstance(v, str) or v in _NON_FINITE
        }
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, global_step=int(step))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=int(step))

    def truncate_after(self, step: int) -> None:
        """Forgets every row logged at a step > `step` (call when resuming from checkpoint `step`).

        Args:
          step: the checkpoint step the run resumes from; -1 forgets everything.
        """
        if not self._primary:
            return
        self._file.close()
        _rewrite(self.path, [row for row in read_metrics(self.path) if row["step"] <= step])
        self._file = self.path.open("a", encoding="utf-8")
        if self._tb is not None:
            self._tb.close()
            self._tb = self._open_tensorboard(purge_step=step + 1)

    def close(self) -> None:
        """Flushes and closes every sink (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reduce_across_processes(metrics: Mapping[str, Any], *, sum_keys: Iterable[str] = ()) -> dict[str, float]:
    """Averages scalar metrics over JAX processes; sums those in `sum_keys` (counters).

    Every process must call this with the same keys (it is a collective). With one process
    it only converts the values to floats.

    Args:
      metrics: name → scalar, this process's values.
      sum_keys: names whose values add up across processes (token counts, tool calls, ...).

    Returns:
      name → reduced float, identical on every process.
    """
    keys = sorted(metrics)
    local = np.asarray([float(np.asarray(metrics[k])) for k in keys], np.float64)
    if jax.process_count() == 1:
        return dict(zip(keys, local.tolist(), strict=True))
    # Sent as the float64s' raw 32-bit words: JAX without x64 would round them to float32,
    # which is inexact for counters above 2**24 (tokens decoded over a run).
    words = multihost_utils.process_allgather(local.view(np.uint32))
    gathered = np.asarray(words, np.uint32).reshape(jax.process_count(), -1).view(np.float64)
    sums, means = gathered.sum(axis=0), gathered.mean(axis=0)
    sum_keys = set(sum_keys)
    return {k: float(sums[i] if k in sum_keys else means[i]) for i, k in enumerate(keys)}
