"""The whole `:tiny` pipeline at toy sizes: cold start, Tree-GRPO steps, eval, checkpoints,
SIGTERM + resume equal to an uninterrupted run, the eval CLI, and the HF export."""

import json
import os
import signal

import numpy as np
import pytest

from tests.train.toy import toy_config
from treegrpo_jax.train import metrics as metrics_lib
from treegrpo_jax.train.eval_main import evaluate_checkpoint
from treegrpo_jax.train.loop import train_and_evaluate
from treegrpo_jax.train.metrics import read_metrics

KEYS = [
    "step",
    "train/reward_mean",
    "train/tool_calls_mean",
    "train/response_tokens_mean",
    "rollout/decoded_tokens",
    "rollout/tool_calls",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("run"))
    final = train_and_evaluate(toy_config(), workdir)
    return workdir, final


def test_run_writes_metrics_plots_checkpoints(uninterrupted):
    workdir, final = uninterrupted
    rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    train_rows = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for key in KEYS:
        assert all(key in r for r in train_rows), key
    evals = [r for r in rows if "eval/em" in r]
    assert [r["step"] for r in evals] == [0, 3]  # after the cold start, and at the end
    assert 0.0 <= final["eval/em"] <= 1.0
    assert os.path.isfile(os.path.join(workdir, "plots", "overview.png"))
    assert any(p.startswith("eval_trees_step") for p in os.listdir(os.path.join(workdir, "plots")))
    assert os.path.isdir(os.path.join(workdir, "tb"))
    with open(os.path.join(workdir, "final_eval.json")) as f:
        assert json.load(f)["eval/em"] == final["eval/em"]


def test_sigterm_then_resume_equals_uninterrupted(uninterrupted, tmp_path, monkeypatch):
    """SIGTERM lands during step 2: the run saves, exits cleanly, and the re-run finishes identically."""
    workdir_ref, _ = uninterrupted
    write = metrics_lib.MetricsWriter.write

    def write_then_preempt(self, step, metrics):
        write(self, step, metrics)
        if step == 1 and "train/reward_mean" in metrics:
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the loop: finish step, save, exit

    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write_then_preempt)
    workdir = str(tmp_path / "run")
    with pytest.raises(SystemExit) as stop:
        train_and_evaluate(toy_config(), workdir)
    assert stop.value.code == 0
    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write)
    train_and_evaluate(toy_config(), workdir)  # the same command again: resumes at step 1
    got = [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if "train/reward_mean" in r]
    want = [r for r in read_metrics(os.path.join(workdir_ref, "metrics.jsonl")) if "train/reward_mean" in r]
    assert [r["step"] for r in got] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        for key in KEYS + ["train/loss"]:
            np.testing.assert_allclose(g[key], w[key], rtol=1e-6, err_msg=key)


def test_eval_cli_library_on_saved_checkpoint(uninterrupted, capsys):
    workdir, final = uninterrupted
    metrics = evaluate_checkpoint(toy_config(), workdir)
    assert metrics["eval/em"] == pytest.approx(final["eval/em"])
    assert "data source" in capsys.readouterr().out
