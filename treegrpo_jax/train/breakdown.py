"""Why each greedy answer was right or wrong: EM per hop count, per relation asked, per searches made,
and a failure class per question, read from the evaluation's own trees.

For a question with a gold search path (the synthetic world) the classes are, in this order:

  correct              EM 1.
  no_answer            the trajectory ended without an answer (tool limit, context, format).
  shown_answered_other the gold answer was in an observation, and the answer is some other text:
                       reading failed (the model recalled or made up a value).
  shown_answered_bridge the gold answer was shown, and the answer is an entity of the gold path
                       (a bridge or a searched name): it stopped one step short in its reasoning.
  stopped_early        fewer searches than the question needs and the answer never shown.
  wrong_search         enough searches, but not every gold query was searched (a bridge misread).
  not_shown_other      every gold query searched, the answer still not shown (retrieval).

Rows without a gold path get `correct` / `wrong` / `no_answer` only. The trainer classifies every
evaluation (`eval/outcome/*` shares, summed over processes; `WORKDIR/eval_step<N>_breakdown.json`
from a single-process run); `launch/eval.py --breakdown` does the same for any checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from collections.abc import Callable, Sequence

from treegrpo_jax.data.rows import QARow
from treegrpo_jax.env.rewards import normalize_answer
from treegrpo_jax.rollout.tree import Tree

__all__ = [
    "CLASSES",
    "QuestionOutcome",
    "breakdown",
    "classify",
    "format_breakdown",
    "outcome_counts",
    "write_breakdown",
]

CLASSES = (
    "correct",
    "no_answer",
    "shown_answered_other",
    "shown_answered_bridge",
    "stopped_early",
    "wrong_search",
    "not_shown_other",
    "wrong",
)


@dataclasses.dataclass(frozen=True)
class QuestionOutcome:
    """One evaluated question: what it needed, what the chain did, and the failure class."""

    id: str
    data_source: str
    hops: int | None
    relation: str | None  # what the last hop asks (synthetic world), else None
    searches: int
    answer: str | None
    gold: str
    outcome: str


def _contains(haystack: str, needle: str) -> bool:
    n = normalize_answer(needle)
    return bool(n) and f" {n} " in f" {normalize_answer(haystack)} "


def classify(row: QARow, tree: Tree, decode: Callable[[Sequence[int]], str]) -> QuestionOutcome:
    """The outcome of `row`'s one greedy chain (`tree`, from `evaluate`); `decode` turns the
    observation token ids back into text (the tokenizer's `decode`)."""
    leaf = tree.leaves()[0]
    path = tree.path(leaf.node_id)
    queries = [normalize_answer(n.query) for n in path if n.query is not None]
    shown = " ".join(decode(n.obs_tokens) for n in path if n.obs_tokens)
    answer = leaf.answer
    if leaf.em:
        outcome = "correct"
    elif answer is None:
        outcome = "no_answer"
    elif not row.gold_queries:
        outcome = "wrong"
    elif any(_contains(shown, g) for g in row.golden_answers):
        path_names = {normalize_answer(x) for x in (*row.gold_queries, *row.gold_entities[:-1])}
        outcome = (
            "shown_answered_bridge" if normalize_answer(answer) in path_names else "shown_answered_other"
        )
    elif len(queries) < len(row.gold_queries):
        outcome = "stopped_early"
    elif not all(normalize_answer(g) in queries for g in row.gold_queries):
        outcome = "wrong_search"
    else:
        outcome = "not_shown_other"
    return QuestionOutcome(
        id=row.id,
        data_source=row.data_source,
        hops=row.hops,
        relation=row.gold_relations[-1] if row.gold_relations else None,
        searches=len(queries),
        answer=answer,
        gold=row.golden_answers[0],
        outcome=outcome,
    )


def breakdown(outcomes: Sequence[QuestionOutcome]) -> dict:
    """Counts and EM per hop count, per relation asked and per searches made, and the classes."""

    def table(key) -> dict[str, dict]:
        groups: dict[str, list[QuestionOutcome]] = collections.defaultdict(list)
        for o in outcomes:
            groups[str(key(o))].append(o)
        return {
            k: {
                "questions": len(v),
                "em": sum(o.outcome == "correct" for o in v) / len(v),
                **{c: sum(o.outcome == c for o in v) for c in CLASSES if any(o.outcome == c for o in v)},
            }
            for k, v in sorted(groups.items())
        }

    n = max(len(outcomes), 1)
    return {
        "questions": len(outcomes),
        "em": sum(o.outcome == "correct" for o in outcomes) / n,
        "classes": {c: sum(o.outcome == c for o in outcomes) for c in CLASSES},
        "by_hops": table(lambda o: o.hops),
        "by_relation": table(lambda o: o.relation),
        "by_searches": table(lambda o: o.searches),
        "by_hops_and_answer_kind": table(lambda o: f"{o.hops}hop/{_answer_kind(o.relation)}"),
    }


_VALUE_RELATIONS = {
    "birth_year",
    "founding_year",
    "publication_year",
    "city_founding_year",
    "established_year",
    "occupation",
    "genre",
}


def _answer_kind(relation: str | None) -> str:
    """ "value" (a year, an occupation, a genre: read out of the last passage) or "entity" (a name)."""
    if relation is None:
        return "unknown"
    return "value" if relation in _VALUE_RELATIONS else "entity"


def format_breakdown(b: dict) -> str:
    """The class counts and the EM per hop count × answer kind, as plain text."""
    lines = [f"{'outcome':<24} {'questions':>9} {'share':>7}"]
    for c, k in b["classes"].items():
        if k:
            lines.append(f"{c:<24} {k:>9} {100 * k / max(b['questions'], 1):>6.1f}%")
    lines.append("")
    lines.append(f"{'hops/answer kind':<24} {'questions':>9} {'EM':>7}")
    for key, row in b["by_hops_and_answer_kind"].items():
        lines.append(f"{key:<24} {row['questions']:>9} {100 * row['em']:>6.1f}%")
    return "\n".join(lines)


def write_breakdown(workdir: str, step: int, outcomes: Sequence[QuestionOutcome]) -> dict:
    """Writes `workdir/eval_step<step>_breakdown.json` (the tables and one record per question)
    atomically and returns the tables."""
    tables = breakdown(outcomes)
    path = os.path.join(workdir, f"eval_step{step}_breakdown.json")
    with open(path + ".tmp", "w") as f:
        json.dump({**tables, "questions_detail": [dataclasses.asdict(o) for o in outcomes]}, f, indent=1)
    os.replace(path + ".tmp", path)
    return tables


def outcome_counts(outcomes: Sequence[QuestionOutcome], prefix: str = "eval/outcome") -> dict[str, int]:
    """How many questions fell in each class (`eval/outcome/stopped_early`, ...): counts, so that
    processes holding different questions add them up; divide by their sum for shares."""
    return {f"{prefix}/{c}": sum(o.outcome == c for o in outcomes) for c in CLASSES}
