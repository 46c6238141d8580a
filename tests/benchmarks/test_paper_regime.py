"""benchmarks/paper_regime.py: the claims it pairs, its tables with the mechanism, the frontier plot,
and the mechanism means a run's record carries (`budget_sweep._record`)."""

import importlib.util
import json
import pathlib
import sys

import pytest

_ROOT = pathlib.Path(__file__).parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _ROOT / f"benchmarks/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


budget_sweep = _load("budget_sweep")
_load("rules_sweep")
_load("verdict")
regime = _load("paper_regime")


def _record(name, seed, multi, *, nonzero=0.5):
    return {
        "name": name,
        "seed": seed,
        "budget": "b",
        "em": multi,
        "em_by_hops": {"1": 0.5, **{str(h): multi for h in range(2, 6)}},
        "em_cold_start": 0.1,
        "tool_calls_per_question": 2.0,
        "train_em_curve": [0.1, 0.1, 0.2, 0.1, 0.0, 0.5],
        "decoded_tokens": 1000.0 * (4 if name == "chain_16" else 1),
        "train_wall_s": 10.0,
        "wall_s": 12.0,
        "compile_s": 3.0,
        "mechanism": {"leaves_nonzero": nonzero, "tokens_nonzero": nonzero, "equal_tree_groups": 0.25},
    }


def test_claims_pair_each_claims_runs_and_tables_show_the_mechanism(tmp_path):
    records = [
        *[_record("tree_2_2_1", s, 0.30 + 0.01 * s + 0.02, nonzero=0.8) for s in range(3)],
        *[_record("chain_16", s, 0.30 + 0.01 * s) for s in range(3)],
        *[_record("tree_2_2_1_intra", s, 0.05 + 0.001 * s) for s in range(2)],
    ]
    c = regime.claims(records)
    assert list(c) == [
        "quarter budget: tree (2,2,1) at ≈4 vs chain GRPO at 16",
        "intra-only vs intra + inter at (2,2,1)",
    ]
    quarter = c["quarter budget: tree (2,2,1) at ≈4 vs chain GRPO at 16"]
    assert (
        quarter["multi-hop"]["mean"] == pytest.approx(0.02) and quarter["multi-hop"]["verdict"] == "a better"
    )
    assert c["intra-only vs intra + inter at (2,2,1)"]["multi-hop"]["verdict"] == "b better"
    table = regime.claims_table(c)
    assert "| 36.8 / 33.9 | 3 | +2.0 ± 0.0" in table and "tree_2_2_1 better" in table
    assert "| collapses / 36.8 | 2 |" in table
    sc = budget_sweep.SweepConfig(out=str(tmp_path), steps=60, eval_prompts=1500, base="tiny,hard,verdict")
    rows = {
        line.split(" | ")[0]: line
        for line in regime.run_table(records, sc).splitlines()
        if line.startswith("| ")
    }
    # sampled EM over steps 1-5 = 10%; leaves A≠0 80% for the tree; no equal_prompt_groups → "–"
    assert "| 10.0 ± 0.0 |" in rows["| tree_2_2_1"] and "| 80% | 80% | 25% | – |" in rows["| tree_2_2_1"]
    regime.plot_frontier(records, str(tmp_path / "frontier.png"))
    assert (tmp_path / "frontier.png").stat().st_size > 0


def test_a_runs_record_carries_its_mechanism_means_and_compiles(tmp_path):
    rows = [
        {"step": 0, "eval/em": 0.1, "eval/tool_calls_mean": 1.0},
        {
            "step": 1,
            "train/reward_mean": 0.2,
            "train/em_mean": 0.1,
            "time/step_s": 2.0,
            "time/compile_s": 1.5,
            "time/compiles": 2.0,
            "mechanism/leaves_nonzero": 0.25,
            "mechanism/abs_adv_depth1": 1.0,
        },
        {
            "step": 2,
            "train/reward_mean": 0.3,
            "train/em_mean": 0.2,
            "time/step_s": 1.0,
            "time/compile_s": 0.0,
            "time/compiles": 0.0,
            "mechanism/leaves_nonzero": 0.75,
            "mechanism/abs_adv_depth1": 0.0,
        },
        {"step": 2, "eval/em": 0.2, "eval/tool_calls_mean": 2.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = budget_sweep._record("chain_2", 0, "v", str(tmp_path), 5.0, label="2")
    assert r["mechanism"] == {"abs_adv_depth1": 0.5, "leaves_nonzero": 0.5}
    assert r["compile_s"] == 1.5 and r["compiles"] == 2.0 and r["train_wall_s"] == 3.0
