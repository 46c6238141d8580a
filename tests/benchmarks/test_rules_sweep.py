"""benchmarks/rules_sweep.py's report: the sd of a difference, the ≥ 2 sd verdict, the rankings,
and the tables over five hop counts (the training runs are `test_budget_sweep.py`'s machinery)."""

import importlib.util
import math
import pathlib
import sys

import pytest

_ROOT = pathlib.Path(__file__).parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _ROOT / f"benchmarks/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


sweep = _load("budget_sweep")
rules = _load("rules_sweep")


def _record(name, seed, em, multi):
    hops = {"1": 0.5, **{str(h): multi for h in range(2, 6)}}
    return {
        "name": name,
        "seed": seed,
        "budget": rules.RULE_RUNS[name][1],
        "em": em,
        "em_by_hops": hops,
        "tool_calls_per_question": 2.0,
        "decoded_tokens": 1000.0,
        "wall_s": 10.0,
        "picks": 16.0,
        "root_picks": 4.0,
    }


def test_difference_and_its_sd_by_hand():
    d, sd = rules.difference([0.5, 0.6, 0.7], [0.4, 0.4, 0.4])
    assert d == pytest.approx(0.2)
    assert sd == pytest.approx(math.sqrt(0.01 / 3))  # var(a) = 0.01, var(b) = 0


def test_verdicts_rankings_and_tables(tmp_path):
    records = [
        # tree (2,2,1): 0.60 ± 0.01 on multi-hop; chain_16: 0.50 ± 0.01 → +10 points, z ≈ 12
        *[_record("tree_2_2_1", s, 0.6, 0.60 + 0.01 * (s - 1)) for s in range(3)],
        *[_record("chain_16", s, 0.5, 0.50 + 0.01 * (s - 1)) for s in range(3)],
        # chain_4 overlaps the tree: 0.58 ± 0.05 → +2 ± 3 points, not beyond noise
        *[_record("chain_4", s, 0.58, [0.53, 0.58, 0.63][s]) for s in range(3)],
        *[_record("tree_2_2_1_last", s, 0.7, 0.70) for s in range(3)],
        *[_record("tree_2_2_1_entropy", s, 0.4, 0.40) for s in range(3)],
    ]
    table = rules.comparisons(records)
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
    assert rows["tree (2,2,1) at ≈4 vs chain GRPO at 16"].endswith("| yes, better |")
    assert "+10.0 ± 0.8 (+12.2)" in rows["tree (2,2,1) at ≈4 vs chain GRPO at 16"]
    assert rows["tree (2,2,1) at ≈4 vs chain GRPO at 4"].endswith("| no |")
    assert rows["chain GRPO at 16 vs at 4"].endswith("| yes, worse |")
    assert "tree (4,2,1) at ≈8 vs chain GRPO at 16" not in rows  # no (4,2,1) runs: left out
    one = rules.comparisons([_record("tree_4_2_1", 0, 0.9, 0.9), _record("chain_16", 0, 0.5, 0.5)])
    assert "| +40.0 (1 seed) | +40.0 (1 seed) | needs ≥ 2 seeds each |" in one  # no verdict from one seed
    ranking = rows["branching rule at (2,2,1)"]
    assert ranking.index("tree_2_2_1_last") < ranking.index("tree_2_2_1 ") < ranking.index("entropy")
    sc = sweep.SweepConfig(out=str(tmp_path), steps=30, base="tiny,hard")
    summary = rules.summarize(records, sc, (1, 2, 3, 4, 5))
    assert (
        "| 5-hop |" in summary
        and "| tree_2_2_1 | ≈4, uniform, sum | 3 | 60.0 ± 0.0 | 60.0 ± 1.0 |" in summary
    )
    assert "| 25% |" in summary  # root picks: 4 of 16
