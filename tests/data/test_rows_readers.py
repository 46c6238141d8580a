"""Tests for QARow validation and the JSONL / parquet readers, bad rows included."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treegrpo_jax.data import BadRow, BadRowError, QARow, parse_row, read_jsonl, read_parquet, read_rows
from treegrpo_jax.data import readers as readers_module


def _write_jsonl_lines(path, lines):
    """Writes raw lines (str or bytes) so tests can plant broken bytes and broken JSON."""
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            f.write(b"\n")


def _record(question, answers, **extra):
    return json.dumps({"question": question, "golden_answers": answers, **extra}, ensure_ascii=False)


def test_qarow_validates_and_names_the_field():
    row = QARow(id="a", question="Q?", golden_answers=("x",), data_source="nq")
    assert row.hops is None and row.gold_queries == ()
    with pytest.raises(ValueError, match="golden_answers is empty"):
        QARow(id="a", question="Q?", golden_answers=(), data_source="nq")
    with pytest.raises(ValueError, match="question is empty"):
        QARow(id="a", question="  ", golden_answers=("x",), data_source="nq")
    with pytest.raises(ValueError, match="hops"):
        QARow(id="a", question="Q?", golden_answers=("x",), data_source="nq", hops=0)
    with pytest.raises(ValueError, match="gold_queries"):
        QARow(id="a", question="Q?", golden_answers=("x",), data_source="nq", gold_queries=["x"])


def test_to_json_dict_round_trips_through_parse_row():
    row = QARow(
        id="r1",
        question="Wer schrieb «Faust»?",
        golden_answers=("Goethe", "J. W. Goethe"),
        data_source="synthetic_2hop",
        hops=2,
        gold_queries=("Faust", "Goethe"),
        gold_entities=("Goethe", "1749"),
        gold_relations=("author", "birth_year"),
    )
    back = parse_row(
        json.loads(json.dumps(row.to_json_dict())), file="f", row_number=1, default_data_source="d"
    )
    assert back == row


def test_read_jsonl_good_rows_defaults_and_order(tmp_path):
    path = tmp_path / "hotpot_dev.jsonl"
    _write_jsonl_lines(
        path,
        [
            _record(" Who? ", [" Ann ", "Anne"], id="q1", data_source="hotpotqa"),
            "",  # blank lines are not records
            _record("Where?", "Paris"),  # a bare string is one answer
            _record("When?", ["1990"], id=7, hops=1, gold_queries=["X"], gold_entities=["1990"]),
        ],
    )
    result = read_jsonl(path)
    assert result.num_skipped == 0
    assert [r.id for r in result.rows] == ["q1", "hotpot_dev-3", "7"]
    assert result.rows[0].question == "Who?"
    assert result.rows[0].golden_answers == ("Ann", "Anne")
    assert result.rows[1].golden_answers == ("Paris",)
    assert result.rows[1].data_source == "hotpot_dev"  # the file's stem by default
    assert result.rows[2].hops == 1 and result.rows[2].gold_entities == ("1990",)
    assert read_jsonl(path, default_data_source="mine").rows[1].data_source == "mine"


BAD_JSONL_LINES = [
    (_record("Fine?", ["yes"]), None),
    (json.dumps({"golden_answers": ["a"]}), "missing question"),
    (_record("Empty?", []), "empty golden_answers"),
    (_record("Blank?", ["  "]), "empty golden_answers"),
    (_record("Typed?", [1923]), "only str"),
    (_record(17, ["a"]), "question must be a str"),
    ('{"question": "cut', "invalid JSON"),
    (b'{"question": "caf\xe9?", "golden_answers": ["a"]}', "invalid UTF-8"),
    ('["not", "an", "object"]', "expected an object"),
    ('{"question": "\\ud800?", "golden_answers": ["a"]}', "UTF-8"),
    (_record("Id?", ["a"], id=[1]), "id must be"),
    (_record("Last fine?", ["yes"]), None),
]


def test_read_jsonl_reports_first_bad_row_with_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_jsonl_lines(path, [line for line, _ in BAD_JSONL_LINES])
    with pytest.raises(BadRowError) as info:
        read_jsonl(path)
    assert info.value.bad_row == BadRow(file=str(path), row_number=2, reason="missing question")
    assert f"{path}:2: missing question" in str(info.value)
    assert "skip_bad_rows" in str(info.value)


def test_read_jsonl_skips_and_counts_bad_rows(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_jsonl_lines(path, [line for line, _ in BAD_JSONL_LINES])
    result = read_jsonl(path, skip_bad_rows=True)
    assert [r.question for r in result.rows] == ["Fine?", "Last fine?"]
    expected = [(n, reason) for n, (_, reason) in enumerate(BAD_JSONL_LINES, start=1) if reason]
    assert result.num_skipped == len(expected)
    for bad, (row_number, reason) in zip(result.bad_rows, expected, strict=True):
        assert bad.file == str(path)
        assert bad.row_number == row_number
        assert reason in bad.reason, (bad, reason)


def _write_parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)


def test_read_parquet_top_level_and_search_r1_nested_answers(tmp_path):
    flat = tmp_path / "nq_train.parquet"
    _write_parquet(
        flat,
        [
            {
                "id": "train_0",
                "question": "who sang it",
                "golden_answers": ["Ann", "Bo"],
                "data_source": "nq",
            },
            {"id": "train_1", "question": "where is it", "golden_answers": ["Lyon"], "data_source": "nq"},
        ],
    )
    # Search-R1's processed files: the templated prompt, answers under reward_model, no id column.
    nested = tmp_path / "hotpotqa_processed.parquet"
    _write_parquet(
        nested,
        [
            {
                "data_source": "hotpotqa",
                "question": "which came first?",
                "prompt": [{"role": "user", "content": "Answer the given question..."}],
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": ["the first one"]}},
                "extra_info": {"split": "train", "index": 0},
            }
        ],
    )
    rows = read_rows([flat, nested]).rows
    assert [(r.id, r.data_source, r.golden_answers) for r in rows] == [
        ("train_0", "nq", ("Ann", "Bo")),
        ("train_1", "nq", ("Lyon",)),
        ("hotpotqa_processed-1", "hotpotqa", ("the first one",)),
    ]


def test_read_parquet_bad_rows_across_batches(tmp_path, monkeypatch):
    # Tiny record batches make sure row numbers keep counting across batch boundaries.
    monkeypatch.setattr(readers_module, "_PARQUET_BATCH_ROWS", 2)
    path = tmp_path / "mixed.parquet"
    answers = [["a"], ["b"], [], ["d"], ["e"], None, ["g"]]
    questions = ["q1", "q2", "q3", None, "q5", "q6", "q7"]
    _write_parquet(
        path, [{"question": q, "golden_answers": a} for q, a in zip(questions, answers, strict=True)]
    )
    with pytest.raises(BadRowError, match=rf"{path.name}:3: empty golden_answers"):
        read_parquet(path)
    result = read_parquet(path, skip_bad_rows=True)
    assert [r.question for r in result.rows] == ["q1", "q2", "q5", "q7"]
    assert [(b.row_number, b.reason.split(" (")[0]) for b in result.bad_rows] == [
        (3, "empty golden_answers"),
        (4, "missing question"),
        (6, "missing golden_answers"),
    ]


def test_read_parquet_wrong_types_are_bad_rows(tmp_path):
    path = tmp_path / "typed.parquet"
    _write_parquet(path, [{"question": 5, "golden_answers": ["a"]}, {"question": 6, "golden_answers": ["b"]}])
    result = read_parquet(path, skip_bad_rows=True)
    assert result.rows == () and result.num_skipped == 2
    assert all("question must be a str" in b.reason for b in result.bad_rows)


def test_whole_file_problems_always_raise(tmp_path):
    no_question = tmp_path / "noq.parquet"
    _write_parquet(no_question, [{"query": "x", "golden_answers": ["a"]}])
    with pytest.raises(ValueError, match="no 'question' column"):
        read_parquet(no_question, skip_bad_rows=True)
    no_answers = tmp_path / "noa.parquet"
    _write_parquet(no_answers, [{"question": "x", "answer": "a"}])
    with pytest.raises(ValueError, match="golden_answers"):
        read_parquet(no_answers, skip_bad_rows=True)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="cannot read as parquet"):
        read_parquet(garbage)
    with pytest.raises(ValueError, match="unknown extension"):
        read_rows(tmp_path / "rows.csv")
    with pytest.raises(FileNotFoundError):
        read_rows(tmp_path / "missing.jsonl")


def test_read_rows_concatenates_and_collects_skips(tmp_path):
    a = tmp_path / "a.jsonl"
    _write_jsonl_lines(a, [_record("A1?", ["x"]), "{broken", _record("A2?", ["y"])])
    b = tmp_path / "b.parquet"
    _write_parquet(
        b, [{"question": "B1?", "golden_answers": ["z"]}, {"question": "B2?", "golden_answers": []}]
    )
    result = read_rows([a, b], skip_bad_rows=True)
    assert [r.question for r in result.rows] == ["A1?", "A2?", "B1?"]
    assert [(b.file.rsplit("/", 1)[-1], b.row_number) for b in result.bad_rows] == [
        ("a.jsonl", 2),
        ("b.parquet", 2),
    ]


def test_read_jsonl_accepts_a_byte_order_mark(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _record("A?", ["x"]).encode() + b"\n" + _record("B?", ["y"]).encode())
    assert [r.question for r in read_jsonl(path).rows] == ["A?", "B?"]
