"""Metric plots: PNGs for full, partial, single-point and empty logs."""

import math

import numpy as np

from treegrpo_jax.train.metrics import MetricsWriter
from treegrpo_jax.train.plots import plot_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def _log(workdir, steps, *, eval_every=5, keys=None):
    rng = np.random.default_rng(0)
    with MetricsWriter(workdir, tensorboard=False) as writer:
        for step in steps:
            row = {
                "train/reward_mean": 0.2 + 0.6 * step / max(steps) + 0.05 * rng.standard_normal(),
                "train/tool_calls_mean": 2.4 + 0.6 * step / max(steps),
                "train/response_tokens_mean": 300 + 2 * step,
                "mechanism/leaves_nonzero": 0.2 + 0.01 * step,
                "mechanism/equal_prompt_groups": 0.7 - 0.01 * step,
                "train/loss": math.nan if step == 3 else 0.1,
            }
            writer.write(step, {k: v for k, v in row.items() if keys is None or k in keys})
            if step % eval_every == 0 and (keys is None or "eval/em" in keys):
                writer.write(
                    step,
                    {
                        "eval/em": 0.15 + 0.2 * step / max(steps),
                        "eval/em/hotpotqa": 0.2 + 0.2 * step / max(steps),
                        "eval/em/2wikimultihopqa": 0.1 + 0.25 * step / max(steps),
                        "eval/tool_calls_mean": 2.0 + step / max(steps),
                    },
                )
    return workdir / "metrics.jsonl"


def _names(paths):
    return sorted(p.name for p in paths)


def test_full_metrics_give_every_panel_and_an_overview(tmp_path):
    paths = plot_metrics(_log(tmp_path, range(1, 41)), tmp_path / "plots")
    assert _names(paths) == [
        "em.png",
        "mechanism.png",
        "overview.png",
        "response_length.png",
        "reward.png",
        "tool_calls.png",
    ]
    for path in paths:
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5_000


def test_missing_keys_skip_their_panels(tmp_path):
    jsonl = _log(tmp_path, range(1, 8), keys={"train/reward_mean", "train/loss"})
    assert _names(plot_metrics(jsonl, tmp_path / "plots")) == ["overview.png", "reward.png"]


def test_single_point_and_empty_logs(tmp_path):
    jsonl = _log(tmp_path / "one", [5])
    paths = plot_metrics(jsonl, tmp_path / "one" / "plots")
    assert "em.png" in _names(paths) and all(p.read_bytes()[:8] == PNG for p in paths)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert plot_metrics(tmp_path / "empty" / "metrics.jsonl", tmp_path / "empty" / "plots") == []
    assert plot_metrics(tmp_path / "nothing.jsonl", tmp_path / "plots") == []
