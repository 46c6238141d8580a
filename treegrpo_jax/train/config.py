"""The config boundary: an ml_collections ConfigDict becomes frozen, validated dataclasses.

Every block of a config file maps to one dataclass. Library code only ever sees the
dataclasses. Unknown keys and bad values fail here with the full key path
(`config.tree.num_picks: ...`), before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import urllib.parse
from typing import Any

from ml_collections import ConfigDict

from treegrpo_jax.data.synthetic_world import WorldConfig
from treegrpo_jax.env.observation import ObservationConfig
from treegrpo_jax.env.prompt import load_template
from treegrpo_jax.env.reward_fn import RewardConfig
from treegrpo_jax.env.scripted_agent import ScriptConfig
from treegrpo_jax.model.bpe_train import AGENT_TAGS, SPECIAL_TOKENS
from treegrpo_jax.model.config import ModelConfig, Remat
from treegrpo_jax.model.pretrained import NAMED_MODELS
from treegrpo_jax.native import Kernels
from treegrpo_jax.parallel.mesh import MeshConfig
from treegrpo_jax.rl.batch import BatchLayout, LayoutKind
from treegrpo_jax.rl.loss import LossConfig
from treegrpo_jax.rl.optim import OptimConfig
from treegrpo_jax.rollout.agent import AgentConfig
from treegrpo_jax.rollout.page_pool import KVCacheConfig
from treegrpo_jax.rollout.scheduler import SchedulerConfig
from treegrpo_jax.rollout.tree_search import TreeSearchConfig
from treegrpo_jax.train.profiling import parse_profile_steps
from treegrpo_jax.validation import as_enum, check_bool, check_int, check_number


class ModelSource(enum.StrEnum):
    SCRATCH = "scratch"  # a new model of the `dims` below (the tiny synthetic-world policy)
    PRETRAINED = "pretrained"  # `path`: HF directory, .gguf file, or "smollm2"


class DataKind(enum.StrEnum):
    SYNTHETIC = "synthetic"
    FILES = "files"
    TFDS = "tfds"  # a prepared array_record copy (`data/tfds_builder.py`)


class RetrieverKind(enum.StrEnum):
    BM25 = "bm25"
    HTTP = "http"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    source: ModelSource = ModelSource.PRETRAINED
    path: str = ""
    dims: tuple[tuple[str, Any], ...] = ()  # ModelConfig fields for SCRATCH (vocab from the tokenizer)
    dtype: str = "auto"  # compute: auto (f32 on CPU, bf16 on GPU/TPU), float32, bfloat16, float16
    param_dtype: str = "float32"
    kv_dtype: str = "auto"  # rollout K/V storage: auto (f32 on CPU, bf16 on GPU/TPU), float32, bfloat16
    kernels: str = "auto"  # rollout attention + sampling: auto (CPU kernels), xla, native, pallas (paged)
    tokenizer_vocab: int = 2048  # SCRATCH: BPE vocabulary trained on the world's text
    remat: str = "none"  # training backward: none (keep all) | layer (recompute each layer) | dots
    attention_chunk: int = 0  # training attention: queries this many at a time (0: all; ModelConfig)

    def __post_init__(self):
        object.__setattr__(self, "source", _enum(ModelSource, self.source, "model.source"))
        object.__setattr__(self, "remat", _enum(Remat, self.remat, "model.remat"))
        _check_int("model.attention_chunk", self.attention_chunk, 0, "(0: every query at once)")
        if self.source == ModelSource.PRETRAINED and not self.path:
            raise ValueError(
                "config.model.path is empty: set --config.model.path=/path/to/hf_checkpoint (or a .gguf)"
            )
        if self.source == ModelSource.PRETRAINED and self.path not in NAMED_MODELS:
            _check_path(
                "model.path", self.path, f"an HF checkpoint directory, a .gguf file or {list(NAMED_MODELS)}"
            )
        for name, allowed in (("dtype", ("auto", *_DTYPES)), ("param_dtype", _DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"config.model.{name}={getattr(self, name)!r}; allowed: {list(allowed)}")
        if self.kv_dtype not in _KV_DTYPES:
            raise ValueError(f"config.model.kv_dtype={self.kv_dtype!r}; allowed: {list(_KV_DTYPES)}")
        object.__setattr__(self, "kernels", _enum(Kernels, self.kernels, "model.kernels"))
        floor = 256 + len(SPECIAL_TOKENS) + len(AGENT_TAGS)  # bytes + specials + atomic tags
        _check_int("model.tokenizer_vocab", self.tokenizer_vocab, floor + 1)
        if self.source == ModelSource.SCRATCH:
            # Built only after the tokenizer is trained: check the dims now, not minutes later.
            try:
                ModelConfig(
                    vocab_size=self.tokenizer_vocab,
                    **dict(self.dims),
                    dtype="float32" if self.dtype == "auto" else self.dtype,
                    param_dtype=self.param_dtype,
                )
            except (TypeError, ValueError) as e:
                known = sorted({f.name for f in dataclasses.fields(ModelConfig)} - _DERIVED_MODEL_FIELDS)
                raise ValueError(f"config.model.dims: {e} (allowed keys: {known})") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSpec:
    kind: DataKind = DataKind.SYNTHETIC
    train_files: tuple[str, ...] = ()
    test_files: tuple[str, ...] = ()
    skip_bad_rows: bool = False
    # kind=tfds: a copy prepared by `treegrpo-prepare-data` (`data/tfds_builder.py`) under
    # data_dir/qa_dataset/<name>/, read by random access (`tfds.data_source`, no split in memory).
    name: str = ""
    data_dir: str = ""
    train_split: str = "train"
    test_split: str = "test"
    eval_prompts: int = 256  # test questions evaluated (the first N, per run; 0 = all)
    world: WorldConfig = dataclasses.field(default_factory=WorldConfig)

    def __post_init__(self):
        object.__setattr__(self, "kind", _enum(DataKind, self.kind, "data.kind"))
        _check_bool("data.skip_bad_rows", self.skip_bad_rows)
        _check_int("data.eval_prompts", self.eval_prompts, 0, "(0 = all)")
        if self.kind == DataKind.TFDS:
            for key in ("name", "data_dir", "train_split", "test_split"):
                if not isinstance(getattr(self, key), str) or not getattr(self, key):
                    raise ValueError(
                        f"config.data.{key} is empty: data.kind=tfds reads data_dir/qa_dataset/NAME "
                        "(prepare it with `treegrpo-prepare-data`)"
                    )
            if not os.path.isdir(os.path.join(self.data_dir, "qa_dataset", self.name)):
                raise ValueError(
                    f"config.data.name={self.name!r}: no prepared copy at "
                    f"{os.path.join(self.data_dir, 'qa_dataset', self.name)} (run `treegrpo-prepare-data "
                    f"--name={self.name} --data_dir={self.data_dir} --train=... --test=...` first)"
                )
        if self.kind == DataKind.FILES:
            for name in ("train_files", "test_files"):
                files = getattr(self, name)
                if not files:
                    raise ValueError(
                        f"config.data.{name} is empty: set --config.data.{name}=a.parquet,b.parquet"
                    )
                missing = [f for f in files if not os.path.exists(f)]
                if missing:
                    raise ValueError(f"config.data.{name}: no such file(s) {missing}")
                odd = [f for f in files if os.path.splitext(f)[1] not in _DATA_EXTENSIONS]
                if odd:
                    raise ValueError(
                        f"config.data.{name}: {odd} have unknown extensions; "
                        f"allowed: {list(_DATA_EXTENSIONS)}"
                    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetrieverSpec:
    kind: RetrieverKind = RetrieverKind.BM25
    corpus: str = ""  # BM25 corpus JSONL (synthetic data: the world's corpus)
    url: str = ""  # HTTP: the Search-R1 retrieval server's URL
    timeout_s: float = 10.0
    max_retries: int = 3
    max_outage_s: float = 600.0  # unreachable this long: save a checkpoint and stop (0 = never stop)

    def __post_init__(self):
        object.__setattr__(self, "kind", _enum(RetrieverKind, self.kind, "retriever.kind"))
        if self.kind == RetrieverKind.HTTP and not self.url:
            raise ValueError(
                "config.retriever.url is empty: set --config.retriever.url=http://HOST:PORT/retrieve"
            )
        if self.url:
            parsed = urllib.parse.urlsplit(self.url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(f"config.retriever.url={self.url!r}: must be http(s)://HOST[:PORT]/PATH")
        if self.corpus:
            _check_path("retriever.corpus", self.corpus, 'a corpus JSONL of {"id", "contents"} lines')
        _check_number("retriever.timeout_s", self.timeout_s, "> 0", lambda x: x > 0)
        _check_int("retriever.max_retries", self.max_retries, 0)
        _check_number("retriever.max_outage_s", self.max_outage_s, "≥ 0 (0 = never stop)", lambda x: x >= 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTSpec:
    steps: int = 0  # cold-start SFT steps (0: none)
    batch_rows: int = 32
    demonstrations: int = 2048
    optim: OptimConfig = dataclasses.field(
        default_factory=lambda: OptimConfig(learning_rate=1e-3, warmup_ratio=0.05)
    )
    script: ScriptConfig = dataclasses.field(default_factory=ScriptConfig)
    # Synthetic data: demonstrations also come from this many counterfactual copies of the world
    # (same names, facts re-drawn: `WorldConfig.facts_variant`), taken in turn with the world itself,
    # so that an answer is predicted by the passage just read, not by a fact recalled from training.
    world_variants: int = 0

    def __post_init__(self):
        _check_int("sft.steps", self.steps, 0, "(0 = no cold start)")
        _check_int("sft.batch_rows", self.batch_rows, 1)
        _check_int("sft.demonstrations", self.demonstrations, 1)
        _check_int("sft.world_variants", self.world_variants, 0, "(0 = the world itself only)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    seed: int = 0
    steps: int = 180
    prompts_per_step: int = 512
    eval_every: int = 20
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    rollout_slots: int = 0  # 0: enough for every prompt of a step at once
    context_len: int = 4096
    render_trees: int = 2  # trees pictured at each eval
    tensorboard: bool = True
    wandb_project: str = ""
    distributed: bool = False  # jax.distributed.initialize() (multi-host TPU pods / GPU nodes)
    # Explicit multi-process settings (all three, or none: JAX detects TPU pods and SLURM).
    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1
    allow_config_change: bool = False  # resume although the config differs from WORKDIR/config.json
    # "FIRST:LAST": a jax.profiler trace of those RL steps under WORKDIR/tb (`train/profiling.py`).
    profile_steps: str = ""
    # JAX's persistent compilation cache in this directory (shared by runs; "" = off).
    compile_cache_dir: str = ""

    def __post_init__(self):
        for name in (
            "steps",
            "prompts_per_step",
            "eval_every",
            "checkpoint_every",
            "keep_checkpoints",
            "context_len",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"config.run.{name} must be a positive int, got {getattr(self, name)!r}")
        _check_int("run.seed", self.seed, 0)
        _check_int("run.rollout_slots", self.rollout_slots, 0, "(0 = one per leaf of every prompt)")
        _check_int("run.render_trees", self.render_trees, 0)
        for name in ("tensorboard", "distributed", "allow_config_change"):
            _check_bool(f"run.{name}", getattr(self, name))
        for name in ("profile_steps", "compile_cache_dir"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"config.run.{name} must be a string, got {getattr(self, name)!r}")
        parse_profile_steps(self.profile_steps)
        if self.profile_steps and parse_profile_steps(self.profile_steps)[0] > self.steps:
            raise ValueError(
                f"config.run.profile_steps={self.profile_steps!r} starts after the last step "
                f"(run.steps={self.steps})"
            )
        if not isinstance(self.num_processes, int) or self.num_processes < 0:
            raise ValueError(f"config.run.num_processes must be an int ≥ 0, got {self.num_processes!r}")
        if not isinstance(self.process_id, int) or not -1 <= self.process_id < max(self.num_processes, 1):
            raise ValueError(
                f"config.run.process_id must be -1 (detect) or in [0, num_processes={self.num_processes}), "
                f"got {self.process_id!r}"
            )
        explicit = (bool(self.coordinator_address), self.num_processes > 0, self.process_id >= 0)
        if any(explicit) and not all(explicit):
            raise ValueError(
                "config.run.coordinator_address, num_processes and process_id are set together (or all "
                f"left empty to let JAX detect them), got {self.coordinator_address!r}, "
                f"{self.num_processes}, {self.process_id}"
            )
        if any(explicit) and not self.distributed:
            raise ValueError("config.run.coordinator_address etc. need config.run.distributed=True")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a run needs, validated."""

    model: ModelSpec
    data: DataSpec
    retriever: RetrieverSpec
    agent: AgentConfig
    observation: ObservationConfig
    tree: TreeSearchConfig
    loss: LossConfig
    optim: OptimConfig
    layout: BatchLayout
    sft: SFTSpec
    run: RunSpec
    mesh: MeshConfig
    rollout: SchedulerConfig = SchedulerConfig()
    kv_cache: KVCacheConfig = KVCacheConfig()
    reward: RewardConfig = RewardConfig()
    template: str = "search_agent"

    def __post_init__(self):
        if self.optim.total_steps != self.run.steps:
            raise ValueError(
                f"config.optim.total_steps={self.optim.total_steps} must equal "
                f"config.run.steps={self.run.steps}"
            )
        g = self.tree.leaves_per_prompt
        if self.run.rollout_slots and self.run.rollout_slots < g:
            raise ValueError(
                f"config.run.rollout_slots={self.run.rollout_slots} < leaves per prompt M·(1+N·L)={g}"
            )
        if self.run.prompts_per_step % self.layout.num_minibatches:
            raise ValueError(
                f"config.run.prompts_per_step={self.run.prompts_per_step} must be divisible by "
                f"config.rl.num_minibatches={self.layout.num_minibatches}"
            )
        if self.sft.world_variants and self.data.kind != DataKind.SYNTHETIC:
            raise ValueError(
                f"config.sft.world_variants={self.sft.world_variants} needs config.data.kind=synthetic "
                f"(it re-draws the synthetic world's facts), got {self.data.kind.value!r}"
            )
        self._check_lengths()
        try:
            load_template(self.template)
        except FileNotFoundError as e:
            raise ValueError(
                f"config.template: {e} (bundled: search_agent, search_agent_terse, search_agent_bare)"
            ) from None

    def _check_lengths(self) -> None:
        """Every cap fits the context, and the context fits the longest training bucket."""
        ctx = self.run.context_len
        if self.layout.length_buckets[-1] < ctx:
            raise ValueError(
                f"config.rl.length_buckets={self.layout.length_buckets}: the longest must be ≥ "
                f"config.run.context_len={ctx}, or a long trajectory cannot be trained on"
            )
        step = self.agent.max_step_tokens + self.agent.min_step_room
        if step >= ctx:
            raise ValueError(
                f"config.agent.max_step_tokens + min_step_room = {step} must be < "
                f"config.run.context_len={ctx}"
            )
        if self.observation.max_tokens >= ctx:
            raise ValueError(
                f"config.observation.max_tokens={self.observation.max_tokens} must be < "
                f"config.run.context_len={ctx}"
            )

    def check_devices(self, num_devices: int, num_processes: int = 1) -> None:
        """Raises a ValueError naming the key when the job's devices cannot run this config.

        Args:
          num_devices: `jax.device_count()` (all processes).
          num_processes: `jax.process_count()`.
        """
        try:
            shape = self.mesh.resolve(num_devices)
        except ValueError as e:
            raise ValueError(f"config.{e}") from None
        if self.run.prompts_per_step % num_processes:
            raise ValueError(
                f"config.run.prompts_per_step={self.run.prompts_per_step} must be divisible by the "
                f"{num_processes} processes (each samples its own share of the prompts)"
            )
        rows = math.prod(shape[:2])  # the data and fsdp axes split the rows
        if self.layout.row_multiple % rows:
            raise ValueError(
                f"config.rl.row_multiple={self.layout.row_multiple} must be a multiple of the mesh's "
                f"data × fsdp = {rows} devices (config.mesh.shape={self.mesh.shape} → {shape})"
            )


_DATA_EXTENSIONS = (".parquet", ".jsonl")
_DTYPES = ("float32", "bfloat16", "float16")  # ModelConfig's compute / storage dtypes
_KV_DTYPES = ("auto", "float32", "bfloat16")  # the rollout engine's stored K/V
# ModelConfig fields a config file never sets: the tokenizer and the `model` block give them.
_DERIVED_MODEL_FIELDS = {
    "vocab_size",
    "dtype",
    "param_dtype",
    "eos_token_ids",
    "bos_token_id",
    "remat",
    "attention_chunk",
}


def _check_int(key: str, value, minimum: int, note: str = "") -> None:
    check_int(f"config.{key}", value, minimum, note)


def _check_number(key: str, value, allowed: str, ok) -> None:
    check_number(f"config.{key}", value, allowed, ok)


def _check_bool(key: str, value) -> None:
    check_bool(f"config.{key}", value)


def _check_path(key: str, path: str, what: str) -> None:
    if not os.path.exists(path):
        raise ValueError(f"config.{key}={path!r}: no such file or directory (expected {what})")


def _enum(cls, value, key: str):
    return as_enum(cls, value, f"config.{key}")


def _make(cls, block: dict[str, Any], key: str, **fixed):
    """cls(**block) with errors that name `config.<key>.<field>`."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(block) - fields)
    if unknown:
        raise ValueError(f"config.{key}: unknown key(s) {unknown}; known: {sorted(fields - set(fixed))}")
    try:
        return cls(**block, **fixed)
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("config.") else f"config.{key}: {msg}") from None


def _tuple(value) -> tuple:
    if isinstance(value, str):
        return tuple(v for v in value.split(",") if v)
    return tuple(value)


def from_config_dict(config: ConfigDict) -> TrainConfig:
    """Turns a config file's ConfigDict into a validated TrainConfig."""
    c = config.to_dict()
    known = {
        "model",
        "data",
        "retriever",
        "agent",
        "observation",
        "tree",
        "rl",
        "optim",
        "sft",
        "run",
        "mesh",
        "rollout",
        "kv_cache",
        "reward",
        "template",
    }
    unknown = sorted(set(c) - known)
    if unknown:
        raise ValueError(f"config: unknown block(s) {unknown}; known: {sorted(known)}")
    model = dict(c["model"])
    model["dims"] = tuple(sorted(model.get("dims", {}).items()))
    data = dict(c["data"])
    world = _make(
        WorldConfig,
        {k: tuple(v) if isinstance(v, list) else v for k, v in data.pop("world", {}).items()},
        "data.world",
    )
    for name in ("train_files", "test_files"):
        data[name] = _tuple(data.get(name, ()))
    rl = dict(c["rl"])
    # `rl.layout` ("packed" | "paths") is BatchLayout.kind; the other layout keys keep their names.
    layout_kind = _enum(LayoutKind, rl.pop("layout", LayoutKind.PACKED), "rl.layout")
    layout_keys = {f.name for f in dataclasses.fields(BatchLayout)} - {"kind"}
    layout = {k: rl.pop(k) for k in list(rl) if k in layout_keys}
    layout["kind"] = layout_kind
    if "length_buckets" in layout:
        layout["length_buckets"] = tuple(layout["length_buckets"])
    # Blocks that others are derived from go first, so a bad value is reported under its own key.
    agent = _make(AgentConfig, c["agent"], "agent")
    run = _make(RunSpec, c["run"], "run")
    sft = dict(c.get("sft", {}))
    sft_optim = _make(
        OptimConfig, sft.pop("optim", {}), "sft.optim", total_steps=max(1, sft.get("steps", 0) or 1)
    )
    # Demonstrations must look like rollouts: same passages per search, same tool-call limit.
    sft_script = _make(
        ScriptConfig,
        sft.pop("script", {}),
        "sft.script",
        top_k=agent.top_k,
        max_tool_calls=agent.max_tool_calls,
    )
    return TrainConfig(
        model=_make(ModelSpec, model, "model"),
        data=_make(DataSpec, data, "data", world=world),
        retriever=_make(RetrieverSpec, c["retriever"], "retriever"),
        agent=agent,
        observation=_make(ObservationConfig, c["observation"], "observation"),
        tree=_make(TreeSearchConfig, c["tree"], "tree"),
        loss=_make(LossConfig, rl, "rl"),
        optim=_make(OptimConfig, c["optim"], "optim", total_steps=run.steps),
        layout=_make(BatchLayout, layout, "rl"),
        sft=_make(SFTSpec, sft, "sft", optim=sft_optim, script=sft_script),
        run=run,
        mesh=_make(MeshConfig, {"shape": tuple(c["mesh"]["shape"])}, "mesh"),
        rollout=_make(SchedulerConfig, c.get("rollout", {}), "rollout"),
        kv_cache=_make(KVCacheConfig, c.get("kv_cache", {}), "kv_cache"),
        reward=_make(RewardConfig, c.get("reward", {}), "reward"),
        template=c.get("template", "search_agent"),
    )
