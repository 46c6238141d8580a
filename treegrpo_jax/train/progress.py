"""What a person watching a run sees: the header that says what will run, and the bars.

Every phase that makes someone wait gets a bar or a line: weight loading (`model.weights_hf`),
the BM25 index (`setup.make_retriever`), the cold start (`cold_start`), each RL step's rollout
(leaves done) and each evaluation (questions done, EM so far), both here.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import tqdm
from flax import nnx

from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.rollout.tree import Node


def count_params(model) -> int:
    """Parameters of an NNX model (every `nnx.Param`, embeddings included)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _millions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def run_header(
    cfg, model_cfg: ModelConfig, num_params: int, *, train_rows: int, test_rows: int, eval_rows: int,
    retriever: str, workdir: str, mesh, kv_dtype: str, kernels: str, resumed_from: int | None,
) -> str:  # fmt: skip
    """The first lines of a run: model, data, tree shape, devices and mesh, workdir."""
    t, r = cfg.tree, cfg.run
    name = cfg.model.path or f"scratch {dict(cfg.model.dims)}"
    devices = jax.devices()
    mesh_txt = (
        "one device (no mesh)"
        if mesh is None
        else " × ".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.devices.shape, strict=True))
    )
    lines = [
        f"model    {name}: {_millions(num_params)} parameters, {model_cfg.num_layers} layers, "
        f"vocab {model_cfg.vocab_size}; compute {model_cfg.dtype}, params {model_cfg.param_dtype}, "
        f"K/V {kv_dtype}, kernels {kernels}",
        f"data     {cfg.data.kind}: {train_rows} train / {test_rows} test questions "
        f"({eval_rows} per evaluation); retriever {retriever}",
        f"tree     M={t.num_trees} N={t.num_picks} L={t.num_rounds}: {t.leaves_per_prompt} leaves "
        f"per prompt, {r.prompts_per_step} prompts per step, {r.steps} steps, context {r.context_len}; "
        f"cold start {cfg.sft.steps if cfg.sft else 0} SFT steps",
        f"devices  {len(devices)} × {devices[0].platform} ({devices[0].device_kind}) on "
        f"{jax.process_count()} process(es); mesh {mesh_txt}",
        f"workdir  {workdir}"
        # The newest *committed* step; if it turns out damaged, the checkpointer's warning names
        # the older step actually resumed from.
        + (f" (resuming: newest checkpoint step {resumed_from})" if resumed_from is not None else "")
        + f"; config in {workdir}/config.json",
    ]
    return "\n".join(lines)


@dataclasses.dataclass
class LeafBar:
    """A tqdm bar fed by `rollout(progress=...)`: leaves done, and reward / EM so far.

    For an evaluation (one chain per question) a leaf is a question: pass `unit="q"`.
    """

    total: int
    desc: str
    unit: str = "leaf"
    position: int | None = None

    def __post_init__(self):
        self.bar = tqdm.tqdm(
            total=self.total,
            desc=self.desc,
            unit=self.unit,
            dynamic_ncols=True,
            leave=False,
            position=self.position,
        )

    def __call__(self, leaves: list[Node]) -> None:
        if len(leaves) == self.bar.n:
            return
        self.bar.n = len(leaves)
        if leaves:
            em = np.mean([leaf.em for leaf in leaves])
            reward = np.mean([leaf.reward for leaf in leaves])
            self.bar.set_postfix(em=f"{100 * em:.1f}", reward=f"{reward:.3f}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> LeafBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
