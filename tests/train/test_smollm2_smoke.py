"""`launch/train.py --config=configs/multihop.py:smollm2,smoke` end to end: the offline pretrained
SmolLM2 through cold start, one Tree-GRPO step and two 4-question evaluations, with the run header
and a progress bar for every phase someone waits on (≈2 min on the 2-core CPU)."""

import json
import math

import pytest

from treegrpo_jax.testing.preemption import TrainCommand
from treegrpo_jax.train.metrics import read_metrics


@pytest.mark.slow
def test_smollm2_smoke_runs_end_to_end_with_progress(tmp_path, smollm2_path):
    del smollm2_path  # skips when the wheel is missing
    command = TrainCommand(config="configs/multihop.py:smollm2,smoke")
    workdir = tmp_path / "run"
    returncode = command.run(workdir, "train", timeout_s=900)
    out = (tmp_path / "train.log").read_text(errors="replace")
    assert returncode == 0, out[-4000:]
    # The header says what will run before anything long starts.
    header = out.index("model    smollm2: 134.5M parameters, 30 layers, vocab 49152; compute float32")
    for line in (
        "data     synthetic:",
        "tree     M=2 N=1 L=1: 4 leaves per prompt",
        "devices  1 × cpu",
        "workdir  ",
    ):
        assert line in out, line
    assert out.index("cold-start SFT") > header
    bars = ("loading weights", "BM25: 350 passages indexed", "cold-start SFT", "eval (step 0)", "4/4",
            "rollout (step 1)", "8/8")  # fmt: skip
    for bar in bars:
        assert bar in out, bar

    rows = read_metrics(workdir / "metrics.jsonl")
    evals = [r for r in rows if "eval/em" in r]
    assert [r["step"] for r in evals] == [0, 1]
    (train,) = [r for r in rows if "train/loss" in r]
    assert train["step"] == 1 and math.isfinite(train["train/loss"])
    assert train["rollout/prompts"] == 2 and train["rollout/leaves"] == 8
    final = json.loads((workdir / "final_eval.json").read_text())
    assert final["eval/em"] == evals[-1]["eval/em"]
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["0", "1"]
