"""The QA row every dataset reader produces, and the record of a row that could not be read.

A row is what the trainer needs to start a rollout and score it: an id, the question, the list of
accepted answers (exact match against *any* of them, docs/DESIGN.md §1) and the name of the source it came
from (so metrics can be split per dataset). Rows from the synthetic world also carry the gold search
path, which the scripted demonstrations follow.

Readers never raise on a malformed record deep inside a loop: `parse_row` turns a raw mapping into
either a `QARow` or a `BadRow(file, row_number, reason)`, and the reader decides whether to skip it
(and count it) or to stop with a `BadRowError` that names the file and the row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["BadRow", "BadRowError", "QARow", "parse_row"]


def _is_valid_text(value: Any) -> bool:
    """True for a `str` that can be encoded as UTF-8 (JSON allows lone surrogates; we do not)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_str_tuple(name: str, values: Any, *, allow_empty: bool) -> str | None:
    if not isinstance(values, tuple):
        return f"{name} must be a tuple of str, got {type(values).__name__}"
    if not values and not allow_empty:
        return f"{name} is empty"
    for i, value in enumerate(values):
        if not _is_valid_text(value):
            return f"{name}[{i}] must be valid UTF-8 text, got {type(value).__name__}"
        if not value.strip():
            return f"{name}[{i}] is blank"
    return None


def _check_fields(row: QARow) -> str | None:
    """Returns why `row` is invalid, or None. Shared by `QARow.__post_init__` and `parse_row`."""
    for name in ("id", "question", "data_source"):
        value = getattr(row, name)
        if not _is_valid_text(value):
            return f"{name} must be valid UTF-8 text, got {type(value).__name__}"
        if not value.strip():
            return f"{name} is empty"
    reason = _check_str_tuple("golden_answers", row.golden_answers, allow_empty=False)
    if reason:
        return reason
    # bool is an int subclass; a JSON `true` is never a hop count.
    if row.hops is not None and (not isinstance(row.hops, int) or isinstance(row.hops, bool) or row.hops < 1):
        return f"hops must be a positive int, got {row.hops!r}"
    for name in ("gold_queries", "gold_entities", "gold_relations"):
        reason = _check_str_tuple(name, getattr(row, name), allow_empty=True)
        if reason:
            return reason
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class QARow:
    """One question with its accepted answers.

    Attributes:
        id: unique within its dataset (generated from file name and row number when absent).
        question: the question text, as shown to the agent.
        golden_answers: accepted answers; a prediction is correct if it matches any of them.
        data_source: where the row came from (e.g. "nq", "hotpotqa", "synthetic_2hop").
        hops: number of searches the question needs, when known (synthetic world).
        gold_queries: the entity name to search at each hop (length `hops` when present).
        gold_entities: what each hop's passage yields: the bridging entity for hops before the last,
            the answer for the last hop (length `hops` when present).
        gold_relations: what each hop asks of its query: a relation or attribute name of the synthetic
            world (e.g. "author", "born_in", "birth_year"; length `hops` when present).
    """

    id: str
    question: str
    golden_answers: tuple[str, ...]
    data_source: str
    hops: int | None = None
    gold_queries: tuple[str, ...] = ()
    gold_entities: tuple[str, ...] = ()
    gold_relations: tuple[str, ...] = ()

    def __post_init__(self):
        reason = _check_fields(self)
        if reason:
            raise ValueError(f"QARow: {reason}")

    def to_json_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict in a fixed key order; optional fields only when set."""
        out: dict[str, Any] = {
            "id": self.id,
            "question": self.question,
            "golden_answers": list(self.golden_answers),
            "data_source": self.data_source,
        }
        if self.hops is not None:
            out["hops"] = self.hops
        if self.gold_queries:
            out["gold_queries"] = list(self.gold_queries)
        if self.gold_entities:
            out["gold_entities"] = list(self.gold_entities)
        if self.gold_relations:
            out["gold_relations"] = list(self.gold_relations)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class BadRow:
    """A record that could not be turned into a `QARow`.

    Attributes:
        file: path of the file it came from.
        row_number: 1-based position: the line number in a JSONL file, the row position in parquet.
        reason: what is wrong, in words.
    """

    file: str
    row_number: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.row_number}: {self.reason}"


class BadRowError(ValueError):
    """Raised by readers on the first bad row when `skip_bad_rows` is off."""

    def __init__(self, bad_row: BadRow):
        super().__init__(f"bad row in {bad_row} (pass skip_bad_rows=True to skip and count such rows)")
        self.bad_row = bad_row


def _as_str_tuple(name: str, value: Any, *, single_str_ok: bool) -> tuple[Any, ...] | str:
    """Turns a list-like into a tuple; returns a reason string for anything else."""
    if isinstance(value, str) and single_str_ok:
        return (value,)
    # Parquet list columns come back as lists; numpy arrays appear when users build rows with pandas.
    if isinstance(value, list | tuple) or type(value).__name__ == "ndarray":
        return tuple(value)
    return f"{name} must be a list of str, got {type(value).__name__}"


def _golden_answers(record: Mapping[str, Any]) -> Any:
    """Finds the answers at top level or where Search-R1's processed files keep them."""
    if record.get("golden_answers") is not None:
        return record["golden_answers"]
    reward_model = record.get("reward_model")
    if isinstance(reward_model, Mapping):
        ground_truth = reward_model.get("ground_truth")
        if isinstance(ground_truth, Mapping):
            return ground_truth.get("target")
    return None


def parse_row(
    record: Any,
    *,
    file: str,
    row_number: int,
    default_data_source: str,
) -> QARow | BadRow:
    """Validates one raw record (a parsed JSON object or a parquet row) into a `QARow`.

    Accepted layout: `question` (str), `golden_answers` (list of str, or a single str) or Search-R1's
    `reward_model.ground_truth.target`, optional `data_source` (str), optional `id` (str or int),
    optional `hops`, `gold_queries`, `gold_entities`, `gold_relations`. Other keys are ignored.
    Surrounding white space is stripped from the question and the answers.

    Args:
        record: the raw record.
        file: file name, for the report.
        row_number: 1-based position in the file, for the report and the default id.
        default_data_source: used when the record has no `data_source`.

    Returns:
        A `QARow`, or a `BadRow` that says what is wrong.
    """

    def bad(reason: str) -> BadRow:
        return BadRow(file=file, row_number=row_number, reason=reason)

    if not isinstance(record, Mapping):
        return bad(f"expected an object, got {type(record).__name__}")
    question = record.get("question")
    if question is None:
        return bad("missing question")
    if not isinstance(question, str):
        return bad(f"question must be a str, got {type(question).__name__}")
    answers = _golden_answers(record)
    if answers is None:
        return bad("missing golden_answers (nor reward_model.ground_truth.target)")
    answers = _as_str_tuple("golden_answers", answers, single_str_ok=True)
    if isinstance(answers, str):
        return bad(answers)
    if any(not isinstance(answer, str) for answer in answers):
        return bad("golden_answers must contain only str")
    answers = tuple(answer.strip() for answer in answers if answer.strip())
    if not answers:
        return bad("empty golden_answers")

    row_id = record.get("id")
    if row_id is None:
        row_id = f"{default_data_source}-{row_number}"
    elif isinstance(row_id, int) and not isinstance(row_id, bool):
        row_id = str(row_id)
    data_source = record.get("data_source")
    if data_source is None:
        data_source = default_data_source

    extras: dict[str, Any] = {}
    if record.get("hops") is not None:
        extras["hops"] = record["hops"]
    for name in ("gold_queries", "gold_entities", "gold_relations"):
        if record.get(name) is not None:
            values = _as_str_tuple(name, record[name], single_str_ok=False)
            if isinstance(values, str):
                return bad(values)
            extras[name] = values
    try:
        return QARow(
            id=row_id,
            question=question.strip(),
            golden_answers=answers,
            data_source=data_source,
            **extras,
        )
    except ValueError as err:
        # The dataclass's own check covers what is left (types of id/data_source, encodings).
        return bad(str(err).removeprefix("QARow: "))
