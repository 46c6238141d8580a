"""The whole `:tiny` pipeline at toy sizes: cold start, Tree-GRPO steps, eval, checkpoints,
SIGTERM + resume equal to an uninterrupted run, the eval CLI, and the HF export."""

import dataclasses
import json
import os
import signal

import numpy as np
import pytest

from tests.train.toy import toy_config
from treegrpo_jax.train import metrics as metrics_lib
from treegrpo_jax.train.config import from_config_dict
from treegrpo_jax.train.config_dict import ConfigChangedError, load_run_config
from treegrpo_jax.train.eval_main import evaluate_checkpoint
from treegrpo_jax.train.loop import train_and_evaluate
from treegrpo_jax.train.metrics import read_metrics
from treegrpo_jax.train.report import referenced_files

# The whole pipeline six times, with real SIGTERMs: ~40 s or more each on 2 cores. They once
# crashed the suite's process inside XLA and ran in an interpreter of their own; the cause was
# the mapping limit (tests/train/test_process_stats.py), which tests/conftest.py now guards.
pytestmark = pytest.mark.slow

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
    for r in evals:  # every evaluation classifies its answers: shares of the questions, EM among them
        shares = {k: v for k, v in r.items() if k.startswith("eval/outcome/")}
        assert sum(shares.values()) == pytest.approx(1.0)
        assert shares["eval/outcome/correct"] == pytest.approx(r["eval/em"])
        with open(os.path.join(workdir, f"eval_step{r['step']}_breakdown.json")) as f:
            assert json.load(f)["questions"] == toy_config().data.eval_prompts
    # Train-batch fill: real tokens never exceed the padded slots the update computed over.
    assert all(0 < r["batch/tokens"] <= r["batch/slots"] for r in train_rows)
    assert 0.0 <= final["eval/em"] <= 1.0
    assert os.path.isfile(os.path.join(workdir, "plots", "overview.png"))
    assert any(p.startswith("eval_trees_step") for p in os.listdir(os.path.join(workdir, "plots")))
    assert os.path.isdir(os.path.join(workdir, "tb"))
    with open(os.path.join(workdir, "final_eval.json")) as f:
        assert json.load(f)["eval/em"] == final["eval/em"]
    # Training trees (branches, rewards, advantages) at the evaluation step, and the run's page.
    assert os.path.isfile(os.path.join(workdir, "plots", "train_trees_step00003.png"))
    with open(os.path.join(workdir, "index.html"), encoding="utf-8") as f:
        page = f.read()
    linked = referenced_files(page)
    assert "plots/overview.png" in linked and "plots/train_trees_step00003.png" in linked
    assert "plots/eval_trees_step00003.png" in linked and "metrics.jsonl" in linked
    for rel in linked:  # every file the page shows or links exists, relative to the workdir
        assert os.path.isfile(os.path.join(workdir, rel)), rel
    assert f"{100 * final['eval/em']:.1f}%" in page


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
    assert from_config_dict(load_run_config(workdir)) == toy_config()  # WORKDIR/config.json
    changed = dataclasses.replace(toy_config(), optim=dataclasses.replace(toy_config().optim, b2=0.95))
    with pytest.raises(ConfigChangedError, match=r"optim\.b2: 0\.999 → 0\.95"):
        train_and_evaluate(changed, workdir)  # refused before anything loads
    train_and_evaluate(toy_config(), workdir)  # the same command again: resumes at step 1
    got = [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if "train/reward_mean" in r]
    want = [r for r in read_metrics(os.path.join(workdir_ref, "metrics.jsonl")) if "train/reward_mean" in r]
    assert [r["step"] for r in got] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        for key in KEYS + ["train/loss"]:
            np.testing.assert_allclose(g[key], w[key], rtol=1e-6, err_msg=key)


def test_eval_cli_library_on_saved_checkpoint(uninterrupted, capsys):
    workdir, final = uninterrupted
    metrics = evaluate_checkpoint(toy_config(), workdir, with_breakdown=True)
    assert metrics["eval/em"] == pytest.approx(final["eval/em"])
    out = capsys.readouterr().out
    assert "data source" in out and "hops/answer kind" in out
    step = max(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    with open(os.path.join(workdir, f"eval_step{step}_breakdown.json")) as f:
        tables = json.load(f)
    # The classes account for every question, and their EM is the evaluation's.
    assert tables["questions"] == len(tables["questions_detail"]) == sum(tables["classes"].values()) > 0
    assert tables["em"] == pytest.approx(metrics["eval/em"])


def _sigterm_on_decode(monkeypatch, armed):
    """SIGTERM on the first `Engine.decode` call after `armed()` turns true."""
    from treegrpo_jax.rollout.engine import Engine

    decode, sent = Engine.decode, []

    def decode_then_preempt(self, *args, **kwargs):
        if armed() and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "decode", decode_then_preempt)
    return sent


def _preempt_and_resume(monkeypatch, tmp_path, arm_on):
    """Runs until SIGTERM lands where `arm_on(step, metrics)` says; exits 0; resumes; returns workdir."""
    write, state = metrics_lib.MetricsWriter.write, {"armed": False}

    def write_and_arm(self, step, metrics):
        write(self, step, metrics)
        state["armed"] = state["armed"] or arm_on(step, metrics)

    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write_and_arm)
    sent = _sigterm_on_decode(monkeypatch, lambda: state["armed"])
    workdir = str(tmp_path / "run")
    with pytest.raises(SystemExit) as stop:
        train_and_evaluate(toy_config(), workdir)
    assert stop.value.code == 0 and sent
    monkeypatch.undo()
    final = train_and_evaluate(toy_config(), workdir)
    return workdir, final


def _assert_same_log(workdir, workdir_ref):
    got, want = (read_metrics(os.path.join(w, "metrics.jsonl")) for w in (workdir, workdir_ref))
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        for key in [k for k in KEYS + ["train/loss", "eval/em"] if k in w]:
            np.testing.assert_allclose(g[key], w[key], rtol=1e-6, err_msg=key)


def test_sigterm_during_a_rollout_saves_its_start_and_resumes_exactly(uninterrupted, tmp_path, monkeypatch):
    """Mid-rollout of step 2: checkpoint 1 is kept, the rollout is dropped, the re-run repeats it."""
    workdir_ref, final_ref = uninterrupted
    workdir, final = _preempt_and_resume(
        monkeypatch, tmp_path, lambda step, m: step == 1 and "train/reward_mean" in m
    )
    _assert_same_log(workdir, workdir_ref)
    assert final["eval/em"] == final_ref["eval/em"]


def test_sigterm_during_evaluation_saves_it_pending_and_resumes_exactly(uninterrupted, tmp_path, monkeypatch):
    """Mid-evaluation after the last step: the step is saved with its evaluation pending."""
    workdir_ref, final_ref = uninterrupted
    workdir, final = _preempt_and_resume(
        monkeypatch, tmp_path, lambda step, m: step == 3 and "train/reward_mean" in m
    )
    _assert_same_log(workdir, workdir_ref)
    assert _untimed(final) == _untimed(final_ref)


def test_sigterm_during_the_cold_start_exits_and_the_rerun_repeats_it(uninterrupted, tmp_path, monkeypatch):
    from treegrpo_jax.train import cold_start as cold_start_lib

    workdir_ref, final_ref = uninterrupted
    batches = cold_start_lib._length_grouped_batches

    def batches_then_preempt(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return batches(*args, **kwargs)

    monkeypatch.setattr(cold_start_lib, "_length_grouped_batches", batches_then_preempt)
    workdir = str(tmp_path / "run")
    with pytest.raises(SystemExit) as stop:
        train_and_evaluate(toy_config(), workdir)
    assert stop.value.code == 0
    assert not os.listdir(os.path.join(workdir, "checkpoints"))  # nothing half-done kept
    monkeypatch.undo()
    final = train_and_evaluate(toy_config(), workdir)
    _assert_same_log(workdir, workdir_ref)
    assert _untimed(final) == _untimed(final_ref)


def _untimed(metrics):
    return {k: v for k, v in metrics.items() if "wall" not in k and "time" not in k}
