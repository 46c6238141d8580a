"""QA data: rows, readers (Search-R1 parquet, JSONL), a TFDS array_record builder, the batch loader
and the synthetic world (the embedded default task).

Every name loads on first use (`treegrpo_jax._exports`): importing tensorflow_datasets costs most
of a second and only the array_record path needs it, and `python -m
treegrpo_jax.data.synthetic_world` runs that module as `__main__`, which an eager import here would
load a second time (runpy warns about exactly that).
"""

from treegrpo_jax._exports import lazy_exports

_EXPORTS = {
    "LoaderConfig": "loader",
    "RowLoader": "loader",
    "ReadResult": "readers",
    "read_jsonl": "readers",
    "read_parquet": "readers",
    "read_rows": "readers",
    "BadRow": "rows",
    "BadRowError": "rows",
    "QARow": "rows",
    "parse_row": "rows",
    "Entity": "synthetic_entities",
    "Kind": "synthetic_entities",
    "World": "synthetic_world",
    "WorldConfig": "synthetic_world",
    "build_world": "synthetic_world",
    "write_world": "synthetic_world",
    "QADataset": "tfds_builder",
    "QADatasetConfig": "tfds_builder",
    "QARowSource": "tfds_builder",
    "open_prepared": "tfds_builder",
    "prepare_qa_dataset": "tfds_builder",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
