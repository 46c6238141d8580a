"""The config boundary: an ml_collections ConfigDict becomes frozen, validated dataclasses.

Every block of a config file maps to one dataclass. Library code only ever sees the
dataclasses. Unknown keys and bad values fail here with the full key path
(`config.tree.num_picks: ...`), before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any

from ml_collections import ConfigDict

from treegrpo_jax.data.synthetic_world import WorldConfig
from treegrpo_jax.env.observation import ObservationConfig
from treegrpo_jax.env.scripted_agent import ScriptConfig
from treegrpo_jax.parallel.mesh import MeshConfig
from treegrpo_jax.rl.batch import BatchLayout
from treegrpo_jax.rl.loss import LossConfig
from treegrpo_jax.rl.optim import OptimConfig
from treegrpo_jax.rollout.agent import AgentConfig
from treegrpo_jax.rollout.tree_search import TreeSearchConfig


class ModelSource(enum.StrEnum):
    SCRATCH = "scratch"  # a new model of the `dims` below (the tiny synthetic-world policy)
    PRETRAINED = "pretrained"  # `path`: HF directory, .gguf file, or "smollm2"


class DataKind(enum.StrEnum):
    SYNTHETIC = "synthetic"
    FILES = "files"


class RetrieverKind(enum.StrEnum):
    BM25 = "bm25"
    HTTP = "http"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    source: ModelSource = ModelSource.PRETRAINED
    path: str = ""
    dims: tuple[tuple[str, Any], ...] = ()  # ModelConfig fields for SCRATCH (vocab from the tokenizer)
    dtype: str = "float32"
    param_dtype: str = "float32"
    tokenizer_vocab: int = 2048  # SCRATCH: BPE vocabulary trained on the world's text

    def __post_init__(self):
        object.__setattr__(self, "source", _enum(ModelSource, self.source, "model.source"))
        if self.source == ModelSource.PRETRAINED and not self.path:
            raise ValueError(
                "config.model.path is empty: set --config.model.path=/path/to/hf_checkpoint (or a .gguf)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSpec:
    kind: DataKind = DataKind.SYNTHETIC
    train_files: tuple[str, ...] = ()
    test_files: tuple[str, ...] = ()
    skip_bad_rows: bool = False
    eval_prompts: int = 256  # test questions evaluated (the first N, per run; 0 = all)
    world: WorldConfig = dataclasses.field(default_factory=WorldConfig)

    def __post_init__(self):
        object.__setattr__(self, "kind", _enum(DataKind, self.kind, "data.kind"))
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetrieverSpec:
    kind: RetrieverKind = RetrieverKind.BM25
    corpus: str = ""  # BM25 corpus JSONL (synthetic data: the world's corpus)
    url: str = ""  # HTTP: the Search-R1 retrieval server's URL
    timeout_s: float = 10.0
    max_retries: int = 3

    def __post_init__(self):
        object.__setattr__(self, "kind", _enum(RetrieverKind, self.kind, "retriever.kind"))
        if self.kind == RetrieverKind.HTTP and not self.url:
            raise ValueError(
                "config.retriever.url is empty: set --config.retriever.url=http://HOST:PORT/retrieve"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTSpec:
    steps: int = 0  # cold-start SFT steps (0: none)
    batch_rows: int = 32
    demonstrations: int = 2048
    optim: OptimConfig = dataclasses.field(
        default_factory=lambda: OptimConfig(learning_rate=1e-3, warmup_ratio=0.05)
    )
    script: ScriptConfig = dataclasses.field(default_factory=ScriptConfig)


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


def _enum(cls, value, key: str):
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"config.{key}={value!r}; allowed: {[v.value for v in cls]}") from None


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
    layout_keys = {f.name for f in dataclasses.fields(BatchLayout)}
    layout = {k: rl.pop(k) for k in list(rl) if k in layout_keys}
    if "length_buckets" in layout:
        layout["length_buckets"] = tuple(layout["length_buckets"])
    sft = dict(c.get("sft", {}))
    sft_optim = _make(
        OptimConfig, sft.pop("optim", {}), "sft.optim", total_steps=max(1, sft.get("steps", 0) or 1)
    )
    # Demonstrations must look like rollouts: same passages per search, same tool-call limit.
    agent_block = c["agent"]
    sft_script = _make(
        ScriptConfig,
        sft.pop("script", {}),
        "sft.script",
        top_k=agent_block.get("top_k", AgentConfig.top_k),
        max_tool_calls=agent_block.get("max_tool_calls", AgentConfig.max_tool_calls),
    )
    run = c["run"]
    return TrainConfig(
        model=_make(ModelSpec, model, "model"),
        data=_make(DataSpec, data, "data", world=world),
        retriever=_make(RetrieverSpec, c["retriever"], "retriever"),
        agent=_make(AgentConfig, c["agent"], "agent"),
        observation=_make(ObservationConfig, c["observation"], "observation"),
        tree=_make(TreeSearchConfig, c["tree"], "tree"),
        loss=_make(LossConfig, rl, "rl"),
        optim=_make(OptimConfig, c["optim"], "optim", total_steps=run["steps"]),
        layout=_make(BatchLayout, layout, "rl"),
        sft=_make(SFTSpec, sft, "sft", optim=sft_optim, script=sft_script),
        run=_make(RunSpec, run, "run"),
        mesh=_make(MeshConfig, {"shape": tuple(c["mesh"]["shape"])}, "mesh"),
        template=c.get("template", "search_agent"),
    )
