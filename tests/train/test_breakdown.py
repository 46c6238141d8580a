"""The evaluation breakdown (issue 28 item 3): each failure class from a hand-built chain."""

import pytest

from treegrpo_jax.data.rows import QARow
from treegrpo_jax.rollout.tree import Node, StepKind, Tree
from treegrpo_jax.train.breakdown import breakdown, classify, format_breakdown

ROW = QARow(
    id="q",
    question="In which city was the author of The Bells of Tovar born?",
    golden_answers=("Sathimor",),
    data_source="synthetic_2hop",
    hops=2,
    gold_queries=("The Bells of Tovar", "Kelo Varndi"),
    gold_entities=("Kelo Varndi", "Sathimor"),
    gold_relations=("author", "born_in"),
)


def _decode(ids):
    return "".join(chr(i) for i in ids)


def _chain(searches: list[tuple[str, str]], answer: str | None, em: float) -> Tree:
    """Root, one SEARCH node per (query, observation text), then an ANSWER leaf (or a TRUNCATED one)."""
    nodes = [Node(node_id=0, parent=-1, depth=0, kind=StepKind.ROOT)]
    for query, shown in searches:
        i = len(nodes)
        nodes.append(
            Node(
                node_id=i,
                parent=i - 1,
                depth=i,
                kind=StepKind.SEARCH,
                query=query,
                obs_tokens=[ord(c) for c in shown],
            )
        )
        nodes[i - 1].children.append(i)
    i = len(nodes)
    kind = StepKind.ANSWER if answer is not None else StepKind.TRUNCATED
    nodes.append(Node(node_id=i, parent=i - 1, depth=i, kind=kind, answer=answer, is_leaf=True, em=em))
    nodes[i - 1].children.append(i)
    return Tree(prompt_id=0, tree_id=0, prompt_tokens=[1], nodes=nodes)


BELLS = ("The Bells of Tovar", "The Bells of Tovar is a novel by Kelo Varndi.")
KELO = ("Kelo Varndi", "Kelo Varndi was born in Sathimor in 1801.")
CASES = [
    ("correct", _chain([BELLS, KELO], "Sathimor", 1.0)),
    ("no_answer", _chain([BELLS], None, 0.0)),
    ("shown_answered_other", _chain([BELLS, KELO], "Drima", 0.0)),
    ("shown_answered_bridge", _chain([BELLS, KELO], "Kelo Varndi", 0.0)),
    ("stopped_early", _chain([BELLS], "Kelo Varndi", 0.0)),
    ("wrong_search", _chain([BELLS, ("Kelo Vorn", "Kelo Vorn was born in Famor.")], "Famor", 0.0)),
    ("not_shown_other", _chain([BELLS, ("Kelo Varndi", "Kelo Varndi wrote books.")], "Famor", 0.0)),
]


@pytest.mark.parametrize("expected, tree", CASES, ids=[c[0] for c in CASES])
def test_each_class(expected, tree):
    outcome = classify(ROW, tree, _decode)
    assert outcome.outcome == expected
    assert outcome.relation == "born_in" and outcome.hops == 2
    assert outcome.searches == len(tree.path(tree.leaves()[0].node_id)) - 1


def test_a_word_inside_a_longer_word_is_not_shown():
    tree = _chain([BELLS, ("Kelo Varndi", "Kelo Varndi was born in Sathimorel.")], "Famor", 0.0)
    assert classify(ROW, tree, _decode).outcome == "not_shown_other"


def test_rows_without_a_gold_path_are_right_or_wrong():
    row = QARow(id="n", question="Capital of France?", golden_answers=("Paris",), data_source="nq")
    assert (
        classify(row, _chain([("France", "Paris is the capital.")], "Lyon", 0.0), _decode).outcome == "wrong"
    )


def test_breakdown_tables_count_every_question_once():
    outcomes = [classify(ROW, tree, _decode) for _, tree in CASES]
    b = breakdown(outcomes)
    assert b["questions"] == 7 and b["em"] == pytest.approx(1 / 7)
    assert sum(b["classes"].values()) == 7 and all(b["classes"][c] == 1 for c, _ in CASES)
    assert b["by_hops"]["2"]["questions"] == 7
    assert sum(r["questions"] for r in b["by_searches"].values()) == 7
    assert b["by_searches"]["1"]["questions"] == 2  # no_answer and stopped_early searched once
    assert b["by_hops_and_answer_kind"] == {"2hop/entity": b["by_hops"]["2"]}
    text = format_breakdown(b)
    assert "shown_answered_other" in text and "2hop/entity" in text
