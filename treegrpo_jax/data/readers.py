"""Readers for QA files: Search-R1-style parquet and JSONL.

Both produce `QARow`s through `parse_row`, so the layout rules live in one place (see `rows.py`).
A bad record stops the read with a `BadRowError` naming the file and the 1-based row, unless
`skip_bad_rows=True`, in which case it is skipped and reported in `ReadResult.bad_rows`.

Problems with the file as a whole (missing, unreadable parquet, no `question` column) always raise:
skipping every row of a file would hide the mistake rather than report it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from treegrpo_jax.data.rows import BadRow, BadRowError, QARow, parse_row

__all__ = ["ReadResult", "read_jsonl", "read_parquet", "read_rows"]

PathLike = str | os.PathLike

# Parquet is read in record batches so a large training file never sits in memory as Python objects
# twice (arrow table + list of dicts).
_PARQUET_BATCH_ROWS = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadResult:
    """Rows read from one or more files, with the records that were skipped.

    Attributes:
        rows: the valid rows, in file order.
        bad_rows: the skipped records (empty unless `skip_bad_rows=True`).
    """

    rows: tuple[QARow, ...]
    bad_rows: tuple[BadRow, ...]

    @property
    def num_skipped(self) -> int:
        """How many records were skipped."""
        return len(self.bad_rows)


def _collect(parsed: Iterable[QARow | BadRow], *, skip_bad_rows: bool) -> tuple[list[QARow], list[BadRow]]:
    rows: list[QARow] = []
    bad_rows: list[BadRow] = []
    for item in parsed:
        if isinstance(item, BadRow):
            if not skip_bad_rows:
                raise BadRowError(item)
            bad_rows.append(item)
        else:
            rows.append(item)
    return rows, bad_rows


def _default_source(path: Path, default_data_source: str | None) -> str:
    return default_data_source if default_data_source is not None else path.name.split(".")[0]


def _parse_jsonl(path: Path, data_source: str) -> Iterator[QARow | BadRow]:
    file = str(path)
    # Bytes, not text mode: a bad byte sequence then costs one row, not the whole file.
    with path.open("rb") as f:
        for row_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue  # blank lines (a trailing newline, separators) are not records
            try:
                # "utf-8-sig" on the first line: editors on Windows like to start files with a BOM.
                text = raw.decode("utf-8-sig" if row_number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                yield BadRow(file=file, row_number=row_number, reason=f"invalid UTF-8: {err.reason}")
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                yield BadRow(file=file, row_number=row_number, reason=f"invalid JSON: {err.msg}")
                continue
            yield parse_row(record, file=file, row_number=row_number, default_data_source=data_source)


def read_jsonl(
    path: PathLike,
    *,
    skip_bad_rows: bool = False,
    default_data_source: str | None = None,
) -> ReadResult:
    """Reads a JSONL file of QA records, one JSON object per line.

    Args:
        path: the file.
        skip_bad_rows: skip bad records and report them instead of raising.
        default_data_source: `data_source` for records without one (default: the file's stem).

    Returns:
        The rows and the skipped records. Row numbers are 1-based line numbers.

    Raises:
        BadRowError: on the first bad record when `skip_bad_rows` is False.
        FileNotFoundError: if the file does not exist.
    """
    path = Path(path)
    parsed = _parse_jsonl(path, _default_source(path, default_data_source))
    rows, bad_rows = _collect(parsed, skip_bad_rows=skip_bad_rows)
    return ReadResult(rows=tuple(rows), bad_rows=tuple(bad_rows))


def _parse_parquet(path: Path, data_source: str) -> Iterator[QARow | BadRow]:
    # Imported here: pyarrow is only needed by users who actually read parquet.
    import pyarrow.parquet as pq

    file = str(path)
    try:
        parquet_file = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a corrupt or non-parquet file
        raise ValueError(f"{file}: cannot read as parquet: {err}") from err
    columns = set(parquet_file.schema_arrow.names)
    if "question" not in columns:
        raise ValueError(f"{file}: no 'question' column (columns: {sorted(columns)})")
    if "golden_answers" not in columns and "reward_model" not in columns:
        raise ValueError(
            f"{file}: no 'golden_answers' column and no Search-R1 'reward_model' column "
            f"(columns: {sorted(columns)})"
        )
    row_number = 0
    for batch in parquet_file.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        for record in batch.to_pylist():
            row_number += 1
            yield parse_row(record, file=file, row_number=row_number, default_data_source=data_source)


def read_parquet(
    path: PathLike,
    *,
    skip_bad_rows: bool = False,
    default_data_source: str | None = None,
) -> ReadResult:
    """Reads a Search-R1-style parquet file.

    The answers come from a `golden_answers` list column or, in Search-R1's processed files, from
    `reward_model.ground_truth.target`. Extra columns (`prompt`, `ability`, `extra_info`, ...) are
    ignored: the prompt is rebuilt from the question by our own template.

    Args:
        path: the file.
        skip_bad_rows: skip bad rows and report them instead of raising.
        default_data_source: `data_source` for rows without one (default: the file's stem).

    Returns:
        The rows and the skipped rows. Row numbers are 1-based row positions.

    Raises:
        BadRowError: on the first bad row when `skip_bad_rows` is False.
        ValueError: if the file is not parquet or lacks the question or answer column.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(path)
    parsed = _parse_parquet(path, _default_source(path, default_data_source))
    rows, bad_rows = _collect(parsed, skip_bad_rows=skip_bad_rows)
    return ReadResult(rows=tuple(rows), bad_rows=tuple(bad_rows))


_READERS: dict[str, Any] = {".parquet": read_parquet, ".jsonl": read_jsonl}


def read_rows(
    paths: PathLike | Sequence[PathLike],
    *,
    skip_bad_rows: bool = False,
) -> ReadResult:
    """Reads and concatenates QA files, choosing the reader by extension (.parquet or .jsonl).

    Args:
        paths: one path or several; rows keep the order of the files and of the rows inside them.
            Ids are kept as they are: Search-R1's files reuse ids such as "train_0" across
            datasets, so an id is unique only together with `data_source`.
        skip_bad_rows: skip bad rows and report them instead of raising.

    Returns:
        All valid rows and all skipped rows.

    Raises:
        ValueError: for an unknown extension.
        BadRowError: on the first bad row when `skip_bad_rows` is False.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    rows: list[QARow] = []
    bad_rows: list[BadRow] = []
    for path in map(Path, paths):
        reader = _READERS.get(path.suffix)
        if reader is None:
            raise ValueError(f"{path}: unknown extension {path.suffix!r}; expected one of {sorted(_READERS)}")
        result = reader(path, skip_bad_rows=skip_bad_rows)
        rows.extend(result.rows)
        bad_rows.extend(result.bad_rows)
    return ReadResult(rows=tuple(rows), bad_rows=tuple(bad_rows))
