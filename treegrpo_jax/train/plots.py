"""PNG plots of a run's metrics.jsonl: reward, EM, tool calls, response length and the learning
signal (`mechanism/*`) vs step.

One PNG per panel (`reward.png`, `em.png`, `tool_calls.png`, `response_length.png`,
`mechanism.png`) and a
grid of all of them (`overview.png`). A panel whose metrics were never logged is skipped;
a single logged point is drawn as a marker. Noisy training curves get a moving average
drawn over the raw values once there are enough points for it to mean something.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display on TPU VMs / CI

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from treegrpo_jax.train.metrics import read_metrics  # noqa: E402

__all__ = ["PANELS", "Panel", "plot_metrics"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Panel:
    """One figure: the metrics drawn on it and how it is labelled.

    Attributes:
      name: file stem of the PNG.
      title: figure title.
      ylabel: y-axis label.
      keys: metric names drawn (each one line), in legend order.
      prefix: additionally draw every metric named `prefix + <suffix>` (e.g. EM per data
        source), labelled by its suffix.
      percent: values are fractions shown as percentages.
    """

    name: str
    title: str
    ylabel: str
    keys: tuple[str, ...]
    prefix: str | None = None
    percent: bool = False


PANELS: tuple[Panel, ...] = (
    Panel(name="reward", title="Training reward", ylabel="mean leaf reward", keys=("train/reward_mean",)),
    Panel(
        name="em",
        title="Evaluation exact match",
        ylabel="EM (%)",
        keys=("eval/em",),
        prefix="eval/em/",
        percent=True,
    ),
    Panel(
        name="tool_calls",
        title="Tool calls per trajectory",
        ylabel="search calls",
        keys=("train/tool_calls_mean", "eval/tool_calls_mean"),
    ),
    Panel(
        name="response_length",
        title="Response length",
        ylabel="model-generated tokens",
        keys=("train/response_tokens_mean", "eval/response_tokens_mean"),
    ),
    Panel(  # why a step learns or not (`rl/mechanism.py`)
        name="mechanism",
        title="Learning signal per step",
        ylabel="share (%)",
        keys=(
            "mechanism/leaves_nonzero",
            "mechanism/tokens_nonzero",
            "mechanism/equal_tree_groups",
            "mechanism/equal_prompt_groups",
        ),
        percent=True,
    ),
)

_SMOOTH_MIN_POINTS = 12  # below this a moving average only hides the few points there are


def _series(rows: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key`, finite values only, sorted by step (last row wins per step)."""
    by_step: dict[int, float] = {}
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            by_step[int(row["step"])] = float(value)
    steps = np.asarray(sorted(by_step), np.int64)
    return steps, np.asarray([by_step[s] for s in steps], np.float64)


def _lines(rows: Sequence[dict], panel: Panel) -> list[tuple[str, np.ndarray, np.ndarray]]:
    keys = list(panel.keys)
    if panel.prefix:
        found = {k for row in rows for k in row if k.startswith(panel.prefix)}
        keys += sorted(found - set(keys))
    lines = []
    for key in keys:
        steps, values = _series(rows, key)
        if len(steps):
            if panel.prefix and key.startswith(panel.prefix):
                label = key[len(panel.prefix) :]  # a data source
            elif panel.prefix:
                label = "average"
            else:
                label = key.split("/")[0]  # "train" / "eval"
            lines.append((label, steps, values * (100.0 if panel.percent else 1.0)))
    return lines


def _moving_average(values: np.ndarray) -> np.ndarray:
    """Centred moving average whose window shrinks symmetrically at the ends (no end bias on trends)."""
    n = len(values)
    i = np.arange(n)
    radius = np.minimum(max(1, n // 20), np.minimum(i, n - 1 - i))
    csum = np.concatenate([[0.0], np.cumsum(values)])
    return (csum[i + radius + 1] - csum[i - radius]) / (2 * radius + 1)


def _draw(ax, panel: Panel, lines) -> None:
    many = len(lines) > 1
    for i, (label, steps, values) in enumerate(lines):
        color = f"C{i}"
        # Per-source EM lines are secondary to the average: thinner and lighter.
        secondary = many and panel.prefix is not None and i > 0
        marker = "o" if len(steps) <= 30 else None
        if len(steps) >= _SMOOTH_MIN_POINTS:
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
            ax.plot(steps, _moving_average(values), color=color, linewidth=2, label=label)
        else:
            ax.plot(
                steps,
                values,
                color=color,
                marker=marker,
                markersize=4 if secondary else 6,
                linewidth=1 if secondary else 2,
                alpha=0.7 if secondary else 1.0,
                label=label,
            )
    ax.set_title(panel.title, fontsize=12, fontweight="bold")
    ax.set_xlabel("RL step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    all_steps = np.concatenate([steps for _, steps, _ in lines])
    if all_steps.min() == all_steps.max():  # one step: give the lone marker some room
        ax.set_xlim(all_steps.min() - 1, all_steps.max() + 1)
    if many or lines[0][0] not in ("average", panel.keys[0].split("/")[0]):  # say which, when unusual
        ax.legend(fontsize=8, loc="best", ncol=2 if len(lines) > 4 else 1, framealpha=0.8)


def plot_metrics(
    metrics_jsonl: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    panels: Sequence[Panel] = PANELS,
) -> list[pathlib.Path]:
    """Draws each panel with data as `OUT_DIR/<panel>.png`, and all of them as `overview.png`.

    Args:
      metrics_jsonl: a run's metrics.jsonl (see `metrics.MetricsWriter`).
      out_dir: where the PNGs go (created if needed).
      panels: what to draw (default: reward, EM, tool calls, response length).

    Returns:
      The paths written (none when no panel has data).
    """
    rows = read_metrics(metrics_jsonl)
    drawn = [(panel, lines) for panel in panels if (lines := _lines(rows, panel))]
    if not drawn:
        return []
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for panel, lines in drawn:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
        _draw(ax, panel, lines)
        written.append(out / f"{panel.name}.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    cols = 1 if len(drawn) == 1 else 2
    nrows = math.ceil(len(drawn) / cols)
    size = (6.4 * cols, 4.0 * nrows)
    fig, axes = plt.subplots(nrows, cols, figsize=size, layout="constrained", squeeze=False)
    for ax, (panel, lines) in zip(axes.flat, drawn, strict=False):
        _draw(ax, panel, lines)
    for ax in axes.flat[len(drawn) :]:
        ax.axis("off")
    fig.suptitle(f"Training run: {pathlib.Path(metrics_jsonl).parent.name}", fontsize=14)
    written.append(out / "overview.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
