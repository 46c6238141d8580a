"""QA data: rows, readers (Search-R1 parquet, JSONL), a TFDS array_record builder, the batch loader
and the synthetic world (the embedded default task).

Two groups of names load on first use rather than at import:
- the TFDS names (`QADataset`, `QADatasetConfig`, `QARowSource`, `prepare_qa_dataset`): importing
  tensorflow_datasets costs most of a second and only the array_record path needs it;
- the synthetic world's names: `python -m treegrpo_jax.data.synthetic_world` runs that module as
  `__main__`, and an eager import here would load it a second time (runpy warns about exactly that).
"""

import importlib
from typing import Any

from treegrpo_jax.data.loader import LoaderConfig, RowLoader
from treegrpo_jax.data.readers import ReadResult, read_jsonl, read_parquet, read_rows
from treegrpo_jax.data.rows import BadRow, BadRowError, QARow, parse_row
from treegrpo_jax.data.synthetic_entities import Entity, Kind

_LAZY = {
    "QADataset": "tfds_builder",
    "QADatasetConfig": "tfds_builder",
    "QARowSource": "tfds_builder",
    "prepare_qa_dataset": "tfds_builder",
    "World": "synthetic_world",
    "WorldConfig": "synthetic_world",
    "build_world": "synthetic_world",
    "write_world": "synthetic_world",
}

__all__ = [
    "BadRow",
    "BadRowError",
    "Entity",
    "Kind",
    "LoaderConfig",
    "QARow",
    "ReadResult",
    "RowLoader",
    "parse_row",
    "read_jsonl",
    "read_parquet",
    "read_rows",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
