"""Bad configs and malformed data files, each with what its error message must say.

`BAD_CONFIGS`: one wrong value per entry, set on `configs/multihop.py:tiny` (or the paper
config) as a plain dict, then parsed by `from_config_dict` and checked against the devices
(`TrainConfig.check_devices`). An error is *clear* when it is a one-line ValueError that names
the field (`config.<block>` and the field's name) and matches the entry's `hint` (the allowed
values or the rule broken).

`BAD_DATA`: one malformed QA file per entry; its error must name the file and, for a bad
record, the 1-based row (`FILE:ROW`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import re
from collections.abc import Callable
from typing import Any

from ml_collections import ConfigDict

from treegrpo_jax.data.readers import read_rows
from treegrpo_jax.train.config import from_config_dict

REPO = pathlib.Path(__file__).resolve().parents[2]
_MULTIHOP = REPO / "configs" / "multihop.py"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BadConfig:
    """Set `key` (dotted, e.g. "tree.num_trees") to `value`; the error must match `hint`."""

    key: str
    value: Any
    hint: str  # a regex the message must contain (allowed values, the broken rule)
    base: str = "tiny"  # "tiny" or "paper" (configs/multihop.py with no argument)
    extra: tuple[tuple[str, Any], ...] = ()  # set first (e.g. switch to the HTTP retriever)
    num_devices: int = 1

    @property
    def name(self) -> str:
        return f"{self.key}={self.value!r}" + (f" ({self.base})" if self.base != "tiny" else "")


_NOWHERE = "/nonexistent/treegrpo_jax/nothing"

BAD_CONFIGS: tuple[BadConfig, ...] = (
    # tree shape M / N / L
    BadConfig(key="tree.num_trees", value=0, hint="≥ 1"),
    BadConfig(key="tree.num_picks", value=-1, hint="≥ 0"),
    BadConfig(key="tree.num_rounds", value=1.5, hint="must be an int"),
    BadConfig(key="tree.num_tree", value=2, hint=r"unknown key.*known"),
    BadConfig(key="tree.rule", value="best_first", hint=r"known rules.*uniform"),
    BadConfig(key="tree.rule_temperature", value=0.0, hint="> 0"),
    BadConfig(key="tree.rule_tokens", value=0, hint="≥ 1"),
    # rollout driver
    BadConfig(key="rollout.driver", value="async", hint=r"allowed: \['continuous', 'lockstep'\]"),
    BadConfig(key="rollout.quantum", value=12, hint="power of two"),
    BadConfig(key="rollout.exit_fraction", value=0.0, hint=r"in \(0, 1\]"),
    BadConfig(key="rollout.admit_prompts", value=0, hint="≥ 1"),
    # K/V cache layout
    BadConfig(key="kv_cache.layout", value="pages", hint=r"allowed: \['slots', 'paged'\]"),
    BadConfig(key="kv_cache.page_size", value=24, hint="power of two"),
    BadConfig(key="kv_cache.pages", value=-4, hint="≥ 0"),
    # training reward
    BadConfig(key="reward.kind", value="bleu", hint=r"allowed: \['em_format', 'f1', 'callable'\]"),
    BadConfig(key="reward.fn", value="my_rewards.py", hint="only used with kind=callable"),
    BadConfig(
        key="reward.fn",
        value="no_such_module_xyz:score",
        hint="cannot be loaded",
        extra=(("reward.kind", "callable"),),
    ),
    # batch divisibility, buckets, loss
    BadConfig(key="run.prompts_per_step", value=7, hint="divisible by"),
    BadConfig(key="rl.num_minibatches", value=3, hint="divisible by"),
    BadConfig(key="rl.num_microbatches", value=0, hint="positive int"),
    BadConfig(key="rl.row_multiple", value=0, hint="positive int"),
    BadConfig(key="rl.length_buckets", value=(256, 512), hint="≥ config.run.context_len"),
    BadConfig(key="rl.length_buckets", value=(512, 256), hint="ascending"),
    BadConfig(key="rl.layout", value="zigzag", hint="allowed"),
    BadConfig(key="rl.estimator", value="best", hint=r"tree|intra|allowed"),
    BadConfig(key="rl.credit", value="median", hint=r"sum|mean|sqrt"),
    BadConfig(key="rl.aggregation", value="sum", hint="allowed"),
    BadConfig(key="rl.eps_low", value=1.5, hint=r"\[0, 1\)"),
    BadConfig(key="rl.dual_clip", value=0.5, hint="> 1"),
    BadConfig(key="rl.kl_coef", value=-1.0, hint="≥ 0"),
    # caps
    BadConfig(key="agent.max_step_tokens", value=0, hint="≥ 1"),
    BadConfig(key="agent.max_step_tokens", value=4096, hint="< config.run.context_len"),
    BadConfig(key="agent.max_tool_calls", value=-1, hint="≥ 0"),
    BadConfig(key="agent.max_turns", value=1, hint="≥ max_tool_calls"),
    BadConfig(key="agent.min_step_room", value=0, hint="≥ 1"),
    BadConfig(key="agent.top_k", value=0, hint="≥ 1"),
    BadConfig(key="agent.top_p", value=1.5, hint="top_p ≤ 1"),
    BadConfig(key="agent.temperature", value=-1.0, hint="temperature ≥ 0"),
    BadConfig(key="agent.max_tool_call", value=3, hint=r"unknown key.*known"),
    BadConfig(key="observation.max_tokens", value=8, hint=">= 16"),
    BadConfig(key="observation.max_tokens", value=4096, hint="< config.run.context_len"),
    BadConfig(key="observation.passage_tokens", value=0, hint=">= 1"),
    BadConfig(key="run.context_len", value=0, hint="positive int"),
    BadConfig(key="run.rollout_slots", value=3, hint="leaves per prompt"),
    BadConfig(key="run.rollout_slots", value=-1, hint="≥ 0"),
    # mesh vs devices
    BadConfig(key="mesh.shape", value=(2, 1, 1), hint="needs 2 devices but 1"),
    BadConfig(key="mesh.shape", value=(-1, 3, 1), hint="do not divide", num_devices=4),
    BadConfig(key="mesh.shape", value=(-1, -1, 1), hint="at most one -1"),
    BadConfig(key="mesh.shape", value=(1, 1), hint="3 entries"),
    BadConfig(
        key="rl.row_multiple", value=4, hint="data × fsdp", extra=(("mesh.shape", (8, 1, 1)),), num_devices=8
    ),
    # run block
    BadConfig(key="run.steps", value=0, hint="positive int"),
    BadConfig(key="run.eval_every", value=0, hint="positive int"),
    BadConfig(key="run.checkpoint_every", value=-2, hint="positive int"),
    BadConfig(key="run.keep_checkpoints", value=0, hint="positive int"),
    BadConfig(key="run.seed", value=-1, hint="≥ 0"),
    BadConfig(key="run.render_trees", value=-1, hint="≥ 0"),
    BadConfig(key="run.tensorboard", value="yes", hint="True or False"),
    BadConfig(key="run.profile_steps", value="5:3", hint="FIRST:LAST"),
    # model
    BadConfig(key="model.source", value="magic", hint=r"allowed: \['scratch', 'pretrained'\]"),
    BadConfig(key="model.dtype", value="float8", hint="allowed"),
    BadConfig(key="model.param_dtype", value="int8", hint="allowed"),
    BadConfig(key="model.kv_dtype", value="float16", hint="allowed"),
    BadConfig(key="model.kernels", value="fast", hint=r"allowed: \['auto', 'xla', 'native', 'pallas'\]"),
    BadConfig(key="model.tokenizer_vocab", value=100, hint="≥"),
    BadConfig(key="model.dims.num_heads", value=3, hint="multiple of"),
    BadConfig(key="model.dims.hidden", value=64, hint="allowed keys"),
    BadConfig(key="model.dims.head_dim", value=0, hint="positive int"),
    BadConfig(key="model.path", value="", hint="is empty", base="paper"),
    BadConfig(key="model.path", value=_NOWHERE, hint="no such file", base="paper"),
    # data
    BadConfig(key="data.kind", value="web", hint=r"allowed: \['synthetic', 'files', 'tfds'\]"),
    BadConfig(key="data.name", value="", hint="is empty", extra=(("data.kind", "tfds"),)),
    BadConfig(
        key="data.train_files",
        value=f"{_NOWHERE}.parquet",
        hint="no such file",
        extra=(("data.kind", "files"),),
    ),
    BadConfig(
        key="data.train_files",
        value=str(_MULTIHOP),
        hint=r"allowed: \['.parquet', '.jsonl'\]",
        extra=(("data.kind", "files"), ("data.test_files", str(_MULTIHOP))),
    ),
    BadConfig(key="data.train_files", value="", hint="is empty", extra=(("data.kind", "files"),)),
    BadConfig(key="data.eval_prompts", value=-1, hint="≥ 0"),
    BadConfig(key="data.skip_bad_rows", value="no", hint="True or False"),
    BadConfig(key="data.world.num_people", value=0, hint="positive int"),
    BadConfig(key="data.world.test_fraction", value=1.5, hint="test_fraction"),
    BadConfig(key="data.world.distractors", value=2.0, hint=r"distractors.*\[0, 1\]"),
    BadConfig(key="data.world.questions_per_hop", value=(1, 1, 1, 1, 1, 1), hint="1 to 5"),
    # retriever
    BadConfig(key="retriever.kind", value="grpc", hint=r"allowed: \['bm25', 'http'\]"),
    BadConfig(key="retriever.url", value="", hint="is empty", extra=(("retriever.kind", "http"),)),
    BadConfig(key="retriever.url", value="ftp://host/retrieve", hint=r"http\(s\)://"),
    BadConfig(key="retriever.timeout_s", value=0, hint="> 0"),
    BadConfig(key="retriever.max_retries", value=-1, hint="≥ 0"),
    BadConfig(key="retriever.max_outage_s", value=-5.0, hint="≥ 0"),
    BadConfig(key="retriever.corpus", value=f"{_NOWHERE}.jsonl", hint="no such file"),
    # optimiser, cold start, template, blocks
    BadConfig(key="optim.learning_rate", value=-1.0, hint="≥ 0"),
    BadConfig(key="optim.warmup_ratio", value=1.5, hint=r"\[0, 1\)"),
    BadConfig(key="optim.schedule", value="linear", hint="allowed"),
    BadConfig(key="optim.grad_clip", value=0.0, hint="> 0 or None"),
    BadConfig(key="sft.steps", value=-1, hint="≥ 0"),
    BadConfig(key="sft.batch_rows", value=0, hint="≥ 1"),
    BadConfig(key="sft.script.wrong_answer_rate", value=2.0, hint=r"\[0, 1\]"),
    BadConfig(key="template", value="no_such_template", hint="no bundled template"),
    BadConfig(key="trainer", value={"steps": 3}, hint=r"unknown block.*known"),
)


def _base(name: str) -> dict:
    spec = importlib.util.spec_from_file_location("multihop_config", _MULTIHOP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("tiny" if name == "tiny" else None).to_dict()


def _set(d: dict, key: str, value: Any) -> None:
    *blocks, field = key.split(".")
    for block in blocks:
        d = d[block]
    d[field] = value


def config_error(case: BadConfig) -> str | None:
    """The error `case` raises at the config boundary (None when it is accepted)."""
    d = _base(case.base)
    for key, value in case.extra + ((case.key, case.value),):
        _set(d, key, value)
    try:
        cfg = from_config_dict(ConfigDict(d))
        cfg.check_devices(case.num_devices)
    except ValueError as e:
        return str(e)
    return None


def is_clear(case: BadConfig, message: str | None) -> bool:
    """One line, names `config.<block>` and the field, and says what is allowed."""
    if not message or "\n" in message:
        return False
    block, field = case.key.split(".")[0], case.key.split(".")[-1]
    named = f"config.{block}" in message or "config: unknown block" in message
    return named and field in message and re.search(case.hint, message) is not None


# ------------------------------------------------------------------------- data
@dataclasses.dataclass(frozen=True, kw_only=True)
class BadData:
    """A QA file `write(path)` fills; its error must name the file and `row` (None: the file)."""

    name: str
    suffix: str
    write: Callable[[pathlib.Path], None]
    row: int | None
    hint: str


def _jsonl(*records: Any, raw: bytes = b"") -> Callable[[pathlib.Path], None]:
    def write(path: pathlib.Path) -> None:
        lines = [json.dumps(r).encode() for r in records]
        path.write_bytes(b"\n".join(lines) + b"\n" + raw)

    return write


def _parquet(columns: dict[str, list]) -> Callable[[pathlib.Path], None]:
    def write(path: pathlib.Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(columns), path)

    return write


_GOOD = {"question": "Who founded Dovra?", "golden_answers": ["Ada"]}

BAD_DATA: tuple[BadData, ...] = (
    BadData(
        name="missing_question",
        suffix=".jsonl",
        write=_jsonl(_GOOD, {"golden_answers": ["x"]}),
        row=2,
        hint="question",
    ),
    BadData(
        name="empty_answers",
        suffix=".jsonl",
        write=_jsonl(_GOOD, _GOOD, {"question": "q", "golden_answers": []}),
        row=3,
        hint="empty golden_answers",
    ),
    BadData(
        name="blank_answer",
        suffix=".jsonl",
        write=_jsonl({"question": "q", "golden_answers": ["  "]}),
        row=1,
        hint="blank",
    ),
    BadData(
        name="answers_not_a_list",
        suffix=".jsonl",
        write=_jsonl(_GOOD, {"question": "q", "golden_answers": 7}),
        row=2,
        hint="golden_answers",
    ),
    BadData(name="not_an_object", suffix=".jsonl", write=_jsonl(_GOOD, ["q", ["a"]]), row=2, hint="object"),
    BadData(
        name="invalid_json",
        suffix=".jsonl",
        write=_jsonl(_GOOD, raw=b'{"question": "q", golden\n'),
        row=2,
        hint="invalid JSON",
    ),
    BadData(
        name="latin1_bytes",
        suffix=".jsonl",
        write=_jsonl(_GOOD, raw='{"question": "caf\xe9", "golden_answers": ["x"]}\n'.encode("latin-1")),
        row=2,
        hint="invalid UTF-8",
    ),
    BadData(
        name="utf16_file",
        suffix=".jsonl",
        write=lambda p: p.write_bytes(json.dumps(_GOOD).encode("utf-16")),
        row=1,
        hint="invalid UTF-8",
    ),
    BadData(
        name="question_null",
        suffix=".jsonl",
        write=_jsonl({"question": None, "golden_answers": ["x"]}),
        row=1,
        hint="question",
    ),
    BadData(
        name="parquet_no_question_column",
        suffix=".parquet",
        write=_parquet({"query": ["q"], "golden_answers": [["a"]]}),
        row=None,
        hint="no 'question' column",
    ),
    BadData(
        name="parquet_no_answer_column",
        suffix=".parquet",
        write=_parquet({"question": ["q"]}),
        row=None,
        hint="no 'golden_answers' column",
    ),
    BadData(
        name="parquet_empty_answers",
        suffix=".parquet",
        write=_parquet({"question": ["a", "b"], "golden_answers": [["x"], []]}),
        row=2,
        hint="empty golden_answers",
    ),
    BadData(
        name="parquet_wrong_types",
        suffix=".parquet",
        write=_parquet({"question": ["a", "b"], "golden_answers": [1, 2]}),
        row=1,
        hint="golden_answers",
    ),
    BadData(
        name="not_parquet",
        suffix=".parquet",
        write=lambda p: p.write_bytes(b"question,answer\nq,a\n"),
        row=None,
        hint="cannot read as parquet",
    ),
    BadData(
        name="csv_extension",
        suffix=".csv",
        write=lambda p: p.write_text("question,answer\n"),
        row=None,
        hint="unknown extension",
    ),
)


def data_error(case: BadData, directory: pathlib.Path) -> str | None:
    """Writes `case`'s file into `directory`, reads it; the error (None when it reads fine)."""
    path = directory / f"{case.name}{case.suffix}"
    case.write(path)
    try:
        read_rows([path])
    except ValueError as e:
        return str(e)
    return None


def data_is_clear(case: BadData, message: str | None, directory: pathlib.Path) -> bool:
    """Names the file (and `FILE:ROW` for a bad record) and says what is wrong."""
    if not message:
        return False
    path = str(directory / f"{case.name}{case.suffix}")
    where = f"{path}:{case.row}:" if case.row is not None else path
    return where in message and re.search(case.hint, message) is not None
