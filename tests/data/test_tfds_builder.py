"""Tests for the TFDS builder over local files: array_record round trip, without TensorFlow."""

import json
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treegrpo_jax.data import (
    LoaderConfig,
    QARow,
    QARowSource,
    RowLoader,
    prepare_qa_dataset,
    read_rows,
)

TRAIN = [
    QARow(
        id="t0",
        question="Où est né l'auteur de «Zola»?",
        golden_answers=("Paris", "paris, fr"),
        data_source="mine",
    ),
    QARow(
        id="t1",
        question="In which city was the founder of the Vorn Guild born?",
        golden_answers=("Kelth",),
        data_source="synthetic_2hop",
        hops=2,
        gold_queries=("Vorn Guild", "Ama Tessi"),
        gold_entities=("Ama Tessi", "Kelth"),
        gold_relations=("founder", "born_in"),
    ),
    QARow(id="t2", question="日本の首都は?", golden_answers=("東京",), data_source="mine"),
]


def _write(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r.to_json_dict(), ensure_ascii=False) + "\n" for r in TRAIN), "utf-8")
    test = tmp_path / "test.parquet"
    records = [
        {"id": f"e{i}", "question": f"q{i}?", "golden_answers": [f"a{i}"], "data_source": "nq"}
        for i in range(5)
    ]
    pq.write_table(pa.Table.from_pylist(records), test)
    return train, test


def test_round_trip_is_exact_and_keeps_file_order(tmp_path):
    train, test = _write(tmp_path)
    builder = prepare_qa_dataset(
        name="mine", split_files={"train": [train], "test": [test]}, data_dir=tmp_path / "tfds"
    )
    sources = builder.as_data_source()
    assert set(sources) == {"train", "test"}
    assert tuple(QARowSource(sources["train"])) == tuple(TRAIN)
    assert tuple(QARowSource(sources["test"])) == read_rows(test).rows
    assert list((tmp_path / "tfds" / "qa_dataset" / "mine" / "1.1.0").glob("*.array_record*"))

    rows = QARowSource(sources["test"])
    assert rows[-1].id == "e4"
    with pytest.raises(IndexError):
        rows[5]
    # The loader indexes the source lazily, like a tuple of rows.
    loader = RowLoader(
        rows, LoaderConfig(batch_size=2, seed=0, num_epochs=1), process_index=0, process_count=1
    )
    ids = [r.id for batch in loader for r in batch]
    assert len(ids) == len(set(ids)) == 4  # 5 rows, batches of 2, remainder dropped
    assert set(ids) <= {f"e{i}" for i in range(5)}


def test_prepared_copy_is_reused_and_stale_copy_refused(tmp_path):
    train, test = _write(tmp_path)
    kwargs = dict(name="mine", split_files={"train": [train]}, data_dir=tmp_path / "tfds")
    first = prepare_qa_dataset(**kwargs)
    again = prepare_qa_dataset(**kwargs)
    assert tuple(QARowSource(again.as_data_source()["train"])) == tuple(TRAIN)
    assert first.info.metadata["skipped"] == {"train": 0}
    with open(train, "a", encoding="utf-8") as f:
        f.write(json.dumps({"question": "new?", "golden_answers": ["n"]}) + "\n")
    with pytest.raises(ValueError, match="prepared from other files"):
        prepare_qa_dataset(**kwargs)


def test_bad_rows_fail_or_are_skipped_and_counted(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"question": "ok?", "golden_answers": ["y"]}\n{"question": "no answers", "golden_answers": []}\n'
    )
    with pytest.raises(Exception, match=r"bad.jsonl:2: empty golden_answers"):
        prepare_qa_dataset(name="strict", split_files={"train": [path]}, data_dir=tmp_path / "tfds")
    builder = prepare_qa_dataset(
        name="lenient", split_files={"train": [path]}, data_dir=tmp_path / "tfds", skip_bad_rows=True
    )
    assert len(builder.as_data_source()["train"]) == 1
    assert builder.info.metadata["skipped"] == {"train": 1}


def test_grain_reads_the_data_source(tmp_path):
    grain = pytest.importorskip("grain")
    train, _ = _write(tmp_path)
    builder = prepare_qa_dataset(name="g", split_files={"train": [train]}, data_dir=tmp_path / "tfds")
    dataset = grain.MapDataset.source(QARowSource(builder.as_data_source()["train"])).shuffle(seed=1)
    assert sorted(r.id for r in dataset) == ["t0", "t1", "t2"]


def test_data_kind_tfds_reads_the_same_rows_as_the_files_by_index(tmp_path):
    """`data.kind=tfds` (issue 32 item 4): the prepared copy opened from its directory alone gives
    the files' rows in order, by index and by slice, and the loader draws the same batches."""
    from treegrpo_jax.data.tfds_builder import main, open_prepared
    from treegrpo_jax.train import setup
    from treegrpo_jax.train.config import DataKind, DataSpec

    train, test = _write(tmp_path)
    data_dir = tmp_path / "tfds"
    main(["--name=mine", f"--data_dir={data_dir}", f"--train={train}", f"--test={test}"])
    spec = DataSpec(kind=DataKind.TFDS, name="mine", data_dir=str(data_dir))
    files = DataSpec(kind=DataKind.FILES, train_files=(str(train),), test_files=(str(test),))

    def load(data):  # load_data reads cfg.data and cfg.retriever.corpus only
        cfg = types.SimpleNamespace(data=data, retriever=types.SimpleNamespace(corpus=""))
        return setup.load_data(cfg, str(tmp_path))

    a, b = load(spec), load(files)
    assert isinstance(a.train, QARowSource) and len(a.train) == len(b.train) == 3
    assert [a.train[i] for i in range(3)] == list(b.train) and a.test[1:4] == list(b.test[1:4])
    cfg = LoaderConfig(batch_size=2, seed=3)
    la, lb = (RowLoader(d.train, cfg, process_index=0, process_count=1) for d in (a, b))
    assert [next(la) for _ in range(4)] == [next(lb) for _ in range(4)]
    with pytest.raises(KeyError, match="has splits"):
        open_prepared("mine", data_dir, ("train", "validation"))
    with pytest.raises(FileNotFoundError, match="treegrpo-prepare-data --name=other"):
        open_prepared("other", data_dir, ("train",))
    with pytest.raises(ValueError, match=r"config.data.name='other': no prepared copy"):
        DataSpec(kind=DataKind.TFDS, name="other", data_dir=str(data_dir))
    with pytest.raises(ValueError, match="config.data.name is empty"):
        DataSpec(kind=DataKind.TFDS, data_dir=str(data_dir))
