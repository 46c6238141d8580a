"""A TFDS builder over local QA files, prepared into array_record and read without TensorFlow.

`tfds.load` needs TensorFlow; the array_record path does not: `download_and_prepare` writes
array_record shards, and `builder.as_data_source()` gives random-access sources that decode
examples to numpy (text as bytes). `QARowSource` turns such a source back into `QARow`s, so the
loader (and grain, if wanted) can index it like a list.

Usage:

    builder = prepare_qa_dataset(
        name="hotpot", split_files={"train": ["train.parquet"], "test": ["dev.jsonl"]},
        data_dir="/data/tfds")
    rows = QARowSource(builder.as_data_source()["train"])   # Sequence[QARow]

The config name identifies the prepared copy under `data_dir/qa_dataset/<name>/<version>`; the
SHA-256 of every source file is stored with it, and `prepare_qa_dataset` refuses to reuse a copy
whose sources have changed (pick another name, or delete the folder).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from treegrpo_jax.data.readers import read_rows
from treegrpo_jax.data.rows import QARow

__all__ = ["QADataset", "QADatasetConfig", "QARowSource", "main", "open_prepared", "prepare_qa_dataset"]


# BuilderConfig is TFDS's own mutable dataclass (eq=False), so this one cannot be frozen; it is
# validated in __post_init__ like our frozen configs.
@dataclasses.dataclass(eq=False)
class QADatasetConfig(tfds.core.BuilderConfig):
    """Which local files make up each split.

    Attributes:
        split_files: split name -> JSONL / parquet paths, read in order with `read_rows`.
        skip_bad_rows: skip bad rows (counted in the prepared metadata) instead of failing.
    """

    split_files: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    skip_bad_rows: bool = False

    def __post_init__(self):
        if not self.name:
            raise ValueError("QADatasetConfig.name must be set: it names the prepared copy")
        if not self.split_files:
            raise ValueError("QADatasetConfig.split_files must name at least one split")
        for split, files in self.split_files.items():
            if isinstance(files, str | os.PathLike) or not files:
                raise ValueError(f"QADatasetConfig.split_files[{split!r}] must be a non-empty list of paths")
        self.split_files = {split: tuple(str(f) for f in files) for split, files in self.split_files.items()}


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _source_fingerprint(config: QADatasetConfig) -> dict[str, str]:
    files = sorted({f for files in config.split_files.values() for f in files})
    return {f: _file_sha256(f) for f in files}


class QADataset(tfds.core.GeneratorBasedBuilder):
    """QA rows from local files; see `QADatasetConfig`. Examples keep file order (no TFDS shuffle)."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {
        "1.0.0": "QA rows with optional gold search path.",
        "1.1.0": "Optional gold relation per hop.",
    }

    # TFDS finds a packaged builder's source file (to look for download checksums next to it)
    # through a check that imports the `importlib_resources` backport, which TFDS does not install.
    # There is nothing to download here, so name this file directly and skip that lookup.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        features = tfds.features.FeaturesDict(
            {
                "id": tfds.features.Text(),
                "question": tfds.features.Text(),
                "golden_answers": tfds.features.Sequence(tfds.features.Text()),
                "data_source": tfds.features.Text(),
                # 0 stands for "unknown": a feature cannot be None.
                "hops": np.int32,
                "gold_queries": tfds.features.Sequence(tfds.features.Text()),
                "gold_entities": tfds.features.Sequence(tfds.features.Text()),
                "gold_relations": tfds.features.Sequence(tfds.features.Text()),
            }
        )
        # `dataset_info_from_configs` would look for metadata files next to this module; build the
        # info directly. No shuffling: the loader shuffles per epoch, and file order must survive.
        return tfds.core.DatasetInfo(
            builder=self,
            description="QA rows (Search-R1 parquet / JSONL) read from local files.",
            features=features,
            disable_shuffling=True,
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[str, dict[str, Any]]]]:
        del dl_manager  # local files only, nothing to download
        config = self.builder_config
        assert isinstance(config, QADatasetConfig), "QADataset needs a QADatasetConfig"
        self.info.metadata["source_sha256"] = _source_fingerprint(config)
        self.info.metadata["skipped"] = {}
        return {split: self._generate_examples(split, files) for split, files in config.split_files.items()}

    def _generate_examples(self, split: str, files: Sequence[str]) -> Iterator[tuple[str, dict[str, Any]]]:
        result = read_rows(files, skip_bad_rows=self.builder_config.skip_bad_rows)
        if not result.rows:
            raise ValueError(f"split {split!r}: no valid rows in {list(files)}")
        self.info.metadata["skipped"][split] = result.num_skipped
        for index, row in enumerate(result.rows):
            # Keys only need to be unique; ids may repeat across source files.
            yield (
                f"{index:010d}",
                {
                    "id": row.id,
                    "question": row.question,
                    "golden_answers": list(row.golden_answers),
                    "data_source": row.data_source,
                    "hops": row.hops or 0,
                    "gold_queries": list(row.gold_queries),
                    "gold_entities": list(row.gold_entities),
                    "gold_relations": list(row.gold_relations),
                },
            )


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _texts(values: Sequence[bytes | str]) -> tuple[str, ...]:
    return tuple(_text(v) for v in values)


class QARowSource(Sequence[QARow]):
    """Random access to `QARow`s over a TFDS data source (one split of `as_data_source()`)."""

    def __init__(self, source: Any):
        """Wraps `source`, anything with `__len__` and `__getitem__` returning decoded examples."""
        self._source = source

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int | slice) -> QARow | list[QARow]:  # type: ignore[override]
        if isinstance(index, slice):  # reads just those rows
            return [self[i] for i in range(*index.indices(len(self)))]
        if not isinstance(index, int | np.integer):
            raise TypeError(f"QARowSource indices must be ints, got {type(index).__name__}")
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        example = self._source[int(index)]
        hops = int(example["hops"])
        return QARow(
            id=_text(example["id"]),
            question=_text(example["question"]),
            golden_answers=_texts(example["golden_answers"]),
            data_source=_text(example["data_source"]),
            hops=hops if hops > 0 else None,
            gold_queries=_texts(example["gold_queries"]),
            gold_entities=_texts(example["gold_entities"]),
            gold_relations=_texts(example["gold_relations"]) if "gold_relations" in example else (),
        )


def prepare_qa_dataset(
    *,
    name: str,
    split_files: Mapping[str, Sequence[str | os.PathLike]],
    data_dir: str | os.PathLike,
    skip_bad_rows: bool = False,
) -> QADataset:
    """Builds (or reuses) the array_record copy of local QA files.

    Args:
        name: config name; the copy lives under `data_dir/qa_dataset/<name>/1.1.0`.
        split_files: split name -> files (.jsonl / .parquet).
        data_dir: TFDS data directory.
        skip_bad_rows: skip and count bad rows instead of failing.

    Returns:
        The prepared builder; call `.as_data_source()` on it.

    Raises:
        ValueError: if a copy with this name exists but was prepared from different file contents.
    """
    config = QADatasetConfig(
        name=name,
        split_files={split: [os.fspath(f) for f in files] for split, files in split_files.items()},
        skip_bad_rows=skip_bad_rows,
    )
    builder = QADataset(config=config, data_dir=os.fspath(data_dir), file_format="array_record")
    if builder.is_prepared():
        stored = dict(builder.info.metadata.get("source_sha256", {}))
        current = _source_fingerprint(config)
        if stored != current:
            raise ValueError(
                f"{Path(builder.data_dir)} was prepared from other files or contents "
                f"({sorted(stored)}); use another name or delete that folder"
            )
        return builder
    builder.download_and_prepare()
    return builder


def open_prepared(name: str, data_dir: str | os.PathLike, splits: Sequence[str]) -> tuple[QARowSource, ...]:
    """Random-access rows of `splits` of the copy `prepare_qa_dataset(name=name, data_dir=...)` made.

    Reads the prepared directory itself (`tfds.builder_from_directory`: no source files, no builder
    config needed), newest version first; rows are decoded when indexed, never a split at once.

    Raises:
        FileNotFoundError: no prepared copy of `name` under `data_dir`.
        KeyError: a split that the copy does not have (the message lists those it has).
    """
    root = Path(data_dir) / "qa_dataset" / name
    versions = sorted(
        (p for p in root.glob("*") if (p / "dataset_info.json").is_file()), key=lambda p: p.name
    )
    if not versions:
        raise FileNotFoundError(
            f"no prepared TFDS copy at {root} (prepare it: treegrpo-prepare-data --name={name} "
            f"--data_dir={data_dir} --train=FILES --test=FILES)"
        )
    builder = tfds.builder_from_directory(os.fspath(versions[-1]))
    sources = builder.as_data_source()
    missing = [s for s in splits if s not in sources]
    if missing:
        raise KeyError(f"{versions[-1]} has splits {sorted(sources)}, not {missing}")
    return tuple(QARowSource(sources[s]) for s in splits)


def main(argv: Sequence[str] | None = None) -> None:
    """`treegrpo-prepare-data`: JSONL / parquet files → an array_record copy that `data.kind=tfds`
    trains on. Prints the `--config.data.*` flags to pass."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--name", required=True, help="names the copy: DATA_DIR/qa_dataset/NAME")
    p.add_argument("--data_dir", required=True, help="TFDS data directory")
    p.add_argument("--train", required=True, help="comma-separated .jsonl / .parquet files")
    p.add_argument("--test", required=True, help="comma-separated .jsonl / .parquet files")
    p.add_argument("--skip_bad_rows", action="store_true", help="skip (and count) malformed rows")
    args = p.parse_args(argv)
    split_files = {"train": args.train.split(","), "test": args.test.split(",")}
    builder = prepare_qa_dataset(
        name=args.name, split_files=split_files, data_dir=args.data_dir, skip_bad_rows=args.skip_bad_rows
    )
    counts = {split: info.num_examples for split, info in builder.info.splits.items()}
    print(
        f"prepared {builder.data_dir}: {counts} (skipped: {dict(builder.info.metadata.get('skipped', {}))})"
    )
    print(
        "train on it with: --config.data.kind=tfds "
        f"--config.data.name={args.name} --config.data.data_dir={args.data_dir}"
    )


if __name__ == "__main__":
    main()
