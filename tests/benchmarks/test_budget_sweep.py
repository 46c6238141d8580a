"""benchmarks/budget_sweep.py at toy sizes: one shared cold start, resumable runs, the report."""

import importlib.util
import json
import pathlib
import sys

import jax
import pytest

from tests.train.toy import multihop, toy_config_dict
from treegrpo_jax.train import loop

_ROOT = pathlib.Path(__file__).parents[2]
_SPEC = importlib.util.spec_from_file_location("budget_sweep", _ROOT / "benchmarks/budget_sweep.py")
sweep = importlib.util.module_from_spec(_SPEC)
sys.modules["budget_sweep"] = sweep  # dataclasses look their module up there
_SPEC.loader.exec_module(sweep)


def _toy(variant, base="tiny"):
    """The toy `:tiny` config with the variant's tree shape (and rule), estimator and credit."""
    c = toy_config_dict()
    full = multihop.get_config(f"{base},{variant}" if variant else base)
    c.tree, c.rl.estimator, c.rl.credit = full.tree, full.rl.estimator, full.rl.credit
    return c


@pytest.mark.slow
def test_runs_share_one_cold_start_resume_and_report(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "base_config", _toy)
    args = ["--out", str(tmp_path), "--seeds=1", "--steps=1", "--prompts_per_step=2", "--eval_prompts=4"]
    args.append("--sft_steps=2")
    before = jax.config.jax_compilation_cache_dir
    sweep.main([*args, "--runs=chain_2,tree_1_2_1"])
    # The sweep's on-disk compile cache is its own: the rest of this process does not read it.
    assert jax.config.jax_compilation_cache_dir == before
    assert any((tmp_path / "xla_cache").iterdir())  # it was used while the sweep ran
    result = json.loads((tmp_path / "results.json").read_text())
    runs = result["runs"]
    assert sorted((r["name"], r["seed"]) for r in runs) == [("chain_2", 0), ("tree_1_2_1", 0)]
    cold = json.loads((tmp_path / "cold_start" / "metrics.jsonl").read_text().splitlines()[0])
    for r in runs:
        assert r["steps"] == 1 and r["em_cold_start"] == cold["eval/em"]  # the same starting point
        assert 0.0 <= r["em"] <= 1.0 and set(r["em_by_hops"]) == {"1", "2", "3", "4"}
        assert r["leaves"] == 2 * (2 if r["name"] == "chain_2" else 3)  # prompts × leaves per prompt
        assert r["decoded_tokens"] > 0 and len(r["reward_curve"]) == 1
        assert r["config"]["overrides"]["run.seed"] == 0 and r["variant"] in r["config"]["config"]
    # A tree of (1, 2, 1) prefills less than it would by re-submitting every branch's prefix.
    tree = [r for r in runs if r["name"] == "tree_1_2_1"]
    assert all(r["reprefill_tokens"] > r["prefilled_tokens"] for r in tree)
    # Re-running trains nothing: every finished run is read back from its result.json.
    stamp = (tmp_path / "runs" / "chain_2_s0" / "result.json").stat().st_mtime_ns
    monkeypatch.setattr(loop, "train_and_evaluate", _must_not_train)
    sweep.main([*args, "--runs=chain_2,tree_1_2_1"])
    assert (tmp_path / "runs" / "chain_2_s0" / "result.json").stat().st_mtime_ns == stamp
    sweep.main([*args, "--runs=chain_2,tree_1_2_1", "--report_only"])
    table = (tmp_path / "summary.md").read_text()
    assert "| chain_2 | 2 | 1 |" in table and "| tree_1_2_1 |" in table
    # The paper's layout: budget ≈2 pairs chain_2 with tree_1_2_1; budgets with no runs are left out.
    assert "| ≈2 | chain_2 |" in table and "| tree_1_2_1 |" in table.split("| ≈2 |")[1]
    assert "| ≈4 |" not in table
    assert f"| cold start | – | – | {100 * cold['eval/em']:.1f} |" in table
    assert (tmp_path / "em_vs_cost.png").stat().st_size > 1000


def _must_not_train(cfg, workdir):
    raise AssertionError(f"a finished run was trained again: {workdir}")
