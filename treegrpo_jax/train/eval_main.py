"""`launch/eval.py`: evaluate a saved checkpoint on the config's test rows."""

from __future__ import annotations

import json
import os

import jax
from flax import nnx

from treegrpo_jax.model.build import abstract_model, param_shardings
from treegrpo_jax.parallel.mesh import make_mesh
from treegrpo_jax.train import setup
from treegrpo_jax.train.breakdown import classify, format_breakdown, write_breakdown
from treegrpo_jax.train.checkpoint import Checkpointer
from treegrpo_jax.train.config import TrainConfig
from treegrpo_jax.train.evaluate import evaluate, format_table
from treegrpo_jax.train.export import load_model_config, load_tokenizer
from treegrpo_jax.train.progress import LeafBar


def evaluate_checkpoint(
    cfg: TrainConfig, workdir: str, *, step: int | None = None, with_breakdown: bool = False
) -> dict[str, float]:
    """Restores the policy of `step` (default: latest) from `workdir`, prints and returns EM per source.

    `with_breakdown`: also classify every answer (`train/breakdown.py`), print the table and write
    `WORKDIR/eval_step<N>_breakdown.json` (the tables and one record per question)."""
    mesh = make_mesh(cfg.mesh) if jax.device_count() > 1 else None
    model_cfg = load_model_config(workdir)
    tokenizer = load_tokenizer(workdir)
    if tokenizer is None:
        raise FileNotFoundError(f"{workdir}/tokenizer is missing: is {workdir} a training run's workdir?")
    ckpt = Checkpointer(workdir)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints")
    graphdef, abstract = abstract_model(model_cfg)
    shardings = param_shardings(abstract, mesh)
    abstract = jax.tree.map(
        lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh),
        nnx.to_pure_dict(abstract),
        nnx.to_pure_dict(shardings),
    )
    params = ckpt.restore_params(step, abstract_params=abstract)
    ckpt.close()
    state = nnx.State(params) if not isinstance(params, nnx.State) else params
    model = nnx.merge(graphdef, state)
    data = setup.load_data(cfg, workdir)
    env = setup.make_env(cfg, tokenizer, setup.make_retriever(cfg, data))
    rows = list(data.test[: cfg.data.eval_prompts or None])
    engine = setup.make_engine(
        model,
        tokenizer,
        num_slots=min(len(rows), 256),
        max_len=cfg.run.context_len,
        kv_dtype=cfg.model.kv_dtype,
        kernels=cfg.model.kernels,
        kv_cache=cfg.kv_cache,
    )
    with LeafBar(len(rows), f"eval (checkpoint {step})", unit="q") as bar:
        metrics, trees = evaluate(engine, env, rows, cfg.agent, seed=cfg.run.seed, progress=bar)
    print(f"checkpoint step {step}, {len(rows)} questions\n{format_table(metrics)}")
    with open(os.path.join(workdir, f"eval_step{step}.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    if with_breakdown:
        outcomes = [classify(r, t, tokenizer.decode) for r, t in zip(rows, trees, strict=True)]
        tables = write_breakdown(workdir, step, outcomes)
        print(format_breakdown(tables))
        print(f"breakdown: {os.path.join(workdir, f'eval_step{step}_breakdown.json')}")
    return metrics
