"""Multi-host pieces of the training loop: start-up, per-host rollouts, global batches, reductions.

With several JAX processes (TPU pod slices, multi-node GPU, or CPU processes in the tests),
training is one SPMD program over a global mesh, but rollouts are not: each process samples
its own prompts for as many decode steps as its own trajectories need, so it must sample
from a *process-local* copy of the weights (a jitted call on global arrays would need every
process to take part). Everything else follows from that:

- `local_params`: the addressable copy of replicated weights (no copy at all), or an
  all-gather of weights sharded across processes (FSDP / tensor parallel over hosts).
- `place_batch`: every process builds its rows, the processes agree on one padded shape
  (longest bucket, most rows) and the global batch is assembled with
  `jax.make_array_from_process_local_data`, process p's rows in the p-th block.
- `evaluate_sharded`: process p evaluates every n-th test row from p; EM per data source is
  reduced from sums and counts, so it equals a one-process evaluation of the same rows.
- `primary_first`: files derived once per run (synthetic world, trained tokenizer) are
  written by process 0 while the others wait, then read by all.
- `any_process`: a stop decision (SIGTERM reaches one process of a preempted job, or only
  some) taken by all processes together at the same point, so none is left waiting in a
  collective that the others have left.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from treegrpo_jax.data.rows import QARow
from treegrpo_jax.rl.batch import (
    BatchLayout,
    LayoutKind,
    PathBatch,
    PathRow,
    batch_shardings,
    build_batch,
    rows_from_trees,
    shard_batch,
)
from treegrpo_jax.rl.layouts import batch_from_trees
from treegrpo_jax.rl.shapes import ShapeSet, pad_path_batch
from treegrpo_jax.rollout.agent import AgentConfig, AgentEnv
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.tree import Tree
from treegrpo_jax.rollout.tree_search import RolloutCancelled
from treegrpo_jax.train.evaluate import em_by_source, evaluate


def initialize(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1) -> None:
    """`jax.distributed.initialize`, explicit (all three set) or auto-detected (TPU pod, SLURM)."""
    if coordinator_address:
        jax.distributed.initialize(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
        )
    else:
        jax.distributed.initialize()


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any. A collective: every process must call
    it at the same point of the run (once per SFT step, after each rollout, at each step's end)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag], np.int32))))


@contextlib.contextmanager
def primary_first(name: str) -> Iterator[bool]:
    """Runs the body on process 0 first, then on the others (after a barrier).

    Yields nothing useful; use it as `with primary_first("setup"): ...` around code that
    writes a file the first time and reads it afterwards.
    """
    if jax.process_count() == 1:
        yield True
        return
    primary = jax.process_index() == 0
    if not primary:
        multihost_utils.sync_global_devices(f"{name}:primary-done")
    yield primary
    if primary:
        multihost_utils.sync_global_devices(f"{name}:primary-done")


def local_params(params):
    """A process-local copy of `params` for sampling (the same arrays when they are local already)."""

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if x.sharding.is_fully_replicated:
            return x.addressable_data(0)  # this host's replica: no copy
        return jnp.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, params)


def global_prompt_ids(rows: Sequence[PathRow], offset: int) -> list[PathRow]:
    """Shifts local prompt ids (row indices) by this host's first prompt: unique across hosts."""
    return [dataclasses.replace(r, prompt_id=r.prompt_id + offset) for r in rows]


def step_batch(
    trees: Sequence[Tree],
    layout: BatchLayout,
    mesh: Mesh | None,
    first_prompt: int,
    shapes: ShapeSet | None = None,
):
    """The step's global batch from this host's trees, in `layout.kind` (`rl.layouts` registry).

    One process: `batch_from_trees` placed on the mesh. Several: path rows only (packed trees
    keep one host's leaf tables), prompt ids made global, each host's rows a block of the batch.
    `shapes` (the run's compiled shapes) pads the batch up to one of them when that is cheap.
    """
    if jax.process_count() == 1:
        batch = batch_from_trees(trees, layout)
        return shard_batch(shapes.fit(batch) if shapes else batch, mesh)
    if layout.kind != LayoutKind.PATHS:
        raise ValueError("several JAX processes train on path rows: use rl.layout='paths'")
    rows = global_prompt_ids(rows_from_trees(trees), first_prompt)
    return place_batch(build_batch(rows, layout), mesh, shapes)


def place_batch(batch: PathBatch, mesh: Mesh | None, shapes: ShapeSet | None = None) -> PathBatch:
    """Puts this host's rows into the step's global batch (`shard_batch` with one process).

    Hosts agree on the largest row count and length bucket, pad to them (then to a compiled
    shape of `shapes`, the same on every host), and each host's rows become the p-th block of
    the global rows axis.
    """
    if jax.process_count() == 1:
        return shard_batch(shapes.fit(batch) if shapes else batch, mesh)
    if mesh is None:
        raise ValueError("several JAX processes need a mesh over all their devices")
    *lead, b = batch.row_shape
    sizes = multihost_utils.process_allgather(np.asarray([b, batch.seq_len], np.int32))
    b_max, t_max = (int(v) for v in np.asarray(sizes).reshape(-1, 2).max(axis=0))
    batch = pad_path_batch(batch, b_max, t_max)
    if shapes is not None:
        batch = shapes.fit(batch)
    shardings = batch_shardings(mesh, row_dims=len(lead) + 1)
    n = jax.process_count()

    def assemble(local, sharding):
        shape = list(local.shape)
        shape[len(lead)] *= n
        return jax.make_array_from_process_local_data(sharding, local, tuple(shape))

    return jax.tree.map(assemble, batch, shardings)


def evaluate_sharded(
    engine: Engine, env: AgentEnv, rows: Sequence[QARow], agent: AgentConfig, *, seed: int = 0, **kw
) -> tuple[dict[str, float], list]:
    """`evaluate` over all hosts: host p takes rows p, p+n, …; returns global metrics, local trees.

    `kw` goes to `evaluate` (the rollout driver, `should_stop`).
    """
    n, p = jax.process_count(), jax.process_index()
    if n == 1:
        return evaluate(engine, env, rows, agent, seed=seed, **kw)
    mine = list(rows[p::n])
    try:
        metrics, trees = evaluate(engine, env, mine, agent, seed=seed, **kw)
        cancelled = False
    except RolloutCancelled:
        cancelled = True
    if any_process(cancelled):  # a SIGTERM on any process stops every process's evaluation
        raise RolloutCancelled("evaluation stopped: a process of the job received SIGTERM")
    sources = sorted({r.data_source for r in rows})
    per_source = em_by_source(mine, trees)
    k = len(mine)
    # Sums, so that hosts with different row counts weigh each row equally.
    local = [metrics[key] * k for key in _MEAN_KEYS] + [k, metrics["eval/wall_s"]]
    for s in sources:
        local += list(per_source.get(s, (0.0, 0)))
    total = np.asarray(multihost_utils.process_allgather(np.asarray(local, np.float64).view(np.uint32)))
    sums = total.reshape(n, -1).view(np.float64).sum(axis=0)
    count = max(sums[len(_MEAN_KEYS)], 1.0)
    out = {key: float(sums[i] / count) for i, key in enumerate(_MEAN_KEYS)}
    out["eval/wall_s"] = float(sums[len(_MEAN_KEYS) + 1] / n)
    for i, s in enumerate(sources):
        em_sum, num = sums[len(_MEAN_KEYS) + 2 + 2 * i : len(_MEAN_KEYS) + 4 + 2 * i]
        out[f"eval/em/{s}"] = float(em_sum / max(num, 1.0))
    return out, trees


_MEAN_KEYS = ("eval/em", "eval/reward_mean", "eval/tool_calls_mean", "eval/response_tokens_mean")
