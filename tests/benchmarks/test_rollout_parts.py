"""`benchmarks/rollout.py` after its split by part: flags, the shared policy, the leaf-cost
summary and the report (a smoke test: no timing is asserted)."""

import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import _leaf_cost  # noqa: E402
import _policy  # noqa: E402
import rollout as bench  # noqa: E402


def test_an_unknown_part_fails_with_its_name():
    with pytest.raises(ValueError, match="unknown.*'nope'"):
        bench.parse_args(["--parts=tree,nope"])


def test_every_part_has_a_printer_that_skips_a_part_that_did_not_run(capsys):
    assert set(bench.PARTS) == {"decode", "profile", "tree", "leaf_cost", "kv_dtype", "roofline", "smollm2",
                                "scheduler", "paged"}  # fmt: skip
    bench.print_report({})
    assert capsys.readouterr().out == ""


@pytest.fixture(scope="module")
def policy():
    bc = bench.parse_args(["--vocab=64", "--embed=32", "--mlp=64", "--layers=1", "--heads=2", "--kv_heads=1",
                           "--head_dim=16"])  # fmt: skip
    return _policy.load_policy(bc, 2)


def test_the_policy_holds_its_prompts_its_corpus_and_a_stop_table_of_its_vocabulary(policy):
    assert len(policy.rows) == 2 and policy.name == "random weights"
    assert policy.corpus and all(isinstance(t, str) for t in policy.corpus)
    assert policy.stop_table is not None
    assert policy.model.cfg.vocab_size == policy.tokenizer.vocab_size


def test_leaf_cost_summary_is_the_median_over_rounds_and_counts_engine_calls(policy):
    from treegrpo_jax.rollout.tree_search import rollout

    engine = _policy.engine_for(policy, len(policy.rows))
    stats = {}
    for shape in ("tree", "chain"):
        stats[shape] = [
            rollout(
                engine,
                policy.env,
                list(policy.rows),
                _policy.SHAPES[shape],
                policy.agent,
                key=jax.random.key(k),
            )[1]  # fmt: skip
            for k in range(3)
        ]
    tree, chain = stats["tree"], stats["chain"]
    # Both prefill their prompts and copy them to each chain or tree; a tree also forks its picks.
    assert all(s.append_calls >= 1 and s.fork_calls >= 1 for s in tree + chain)
    walls = [1.0, 3.0, 2.0]
    summary = _leaf_cost._summary(tree, walls)
    assert summary["wall_s"] == 2.0
    leaves = [s.leaves for s in tree]
    assert summary["wall_per_leaf_s"] == sorted(w / n for w, n in zip(walls, leaves, strict=True))[1]
    assert (
        summary["fraction_decode"] == sorted(s.times.decode / w for s, w in zip(tree, walls, strict=True))[1]
    )


def test_the_tree_vs_chain_gap_splits_the_excess_exactly_into_its_parts():
    """Hand-computed: the tree decodes half the chain's tokens per leaf, so its wall per leaf
    beyond half the chain's (75 ms) is decode 20 (row-steps 5 over half the chain's, each
    dearer), forks 20, host 5, untimed 30; the parts add up to the excess."""

    def run(wall, decoded, row_steps, **times):
        phases = {f"time_{p}_s": times.get(p, 0.0) for p in _leaf_cost.PHASES}
        return {"leaves": 10.0, "wall_s": wall, "wall_per_leaf_s": wall / 10, "decoded_per_leaf": decoded,
                "row_steps_per_leaf": row_steps} | phases  # fmt: skip

    runs = {
        "tree/scheduler": run(2.0, 50, 60, decode=1.2, append=0.1, fork=0.2, host=0.1),
        "chain/scheduler": run(2.5, 100, 110, decode=2.0, append=0.2, host=0.1),
    }
    gap = _leaf_cost._gap(runs)
    parts = gap["parts_ms_per_leaf"]
    assert gap["decoded_ratio"] == 0.5
    assert gap["excess_ms_per_leaf"] == pytest.approx(75.0)
    assert sum(parts.values()) == pytest.approx(75.0)
    assert parts["decode_row_steps"] + parts["decode_cost_per_row_step"] == pytest.approx(20.0)
    assert parts["decode_row_steps"] == pytest.approx(1e3 * 2.0 / 1100 * 5)  # the chain's cost × 5 row-steps
    assert parts["fork"] == pytest.approx(20.0) and parts["host"] == pytest.approx(5.0)
    assert parts["append"] == pytest.approx(0.0) and parts["other"] == pytest.approx(30.0)
    assert gap["row_steps_ratio"] == pytest.approx(60 / 110)
