"""Cold-start SFT on scripted demonstrations, through the RL train step's SFT mode."""

from __future__ import annotations

import itertools
import logging

import jax
import numpy as np
import tqdm

from treegrpo_jax.env.scripted_agent import make_demonstrations, tokenize_demonstration
from treegrpo_jax.rl.batch import BatchLayout, build_batch, shard_batch
from treegrpo_jax.rl.sft import demonstration_row, sft_loss_config
from treegrpo_jax.rl.train_state import create_train_state
from treegrpo_jax.rl.train_step import jit_train_step

log = logging.getLogger(__name__)


class ColdStartCancelled(RuntimeError):
    """`should_stop` asked the cold start to stop (SIGTERM); it repeats exactly when re-run."""


def cold_start(
    model, tokenizer, env, rows, sft, *, mesh, length_buckets, seed: int, on_metrics=None, should_stop=None,
    sources=None,
):  # fmt: skip
    """Trains `model` on `sft.demonstrations` scripted trajectories for `sft.steps` steps.

    `rows` are demonstrated with `env.retriever`; `sources` (optional) replaces them with several
    (rows, retriever) pairs (`setup.demonstration_sources`), which take turns: demonstration i comes
    from source i mod len(sources).

    Returns the trained params (an nnx.State in the model's shardings) and the mean
    demonstration reward (how imperfect the demonstrations were).
    """
    demos = collect_demonstrations(sources or [(rows, env.retriever)], sft, tokenizer, env)
    path_rows = [
        demonstration_row(tokenize_demonstration(d, tokenizer).spans, prompt_id=i)
        for i, d in enumerate(demos)
    ]
    # A demonstration longer than the largest length bucket cannot be batched: leave it out
    # (say how many) rather than fail mid-run on whichever batch first draws it.
    fits = [r for r in path_rows if len(r.tokens) <= max(length_buckets)]
    if len(fits) < len(path_rows):
        log.warning(
            "cold start: %d of %d demonstrations are longer than the largest length bucket (%d tokens) "
            "and are left out; raise config.rl.length_buckets to keep them",
            len(path_rows) - len(fits),
            len(path_rows),
            max(length_buckets),
        )
    if len(fits) < sft.batch_rows:
        raise ValueError(
            f"only {len(fits)} demonstrations fit the largest length bucket ({max(length_buckets)} tokens); "
            f"config.sft.batch_rows={sft.batch_rows} needs at least that many"
        )
    path_rows = fits
    state, shardings = create_train_state(model, sft.optim, mesh=mesh)
    step_fn = jit_train_step(shardings, loss_cfg=sft_loss_config(), optim_cfg=sft.optim, mesh=mesh)
    layout = BatchLayout(length_buckets=length_buckets, row_multiple=sft.batch_rows)
    rng = np.random.default_rng(seed)
    lengths = np.asarray([len(r.tokens) for r in path_rows])
    batches: list[np.ndarray] = []
    bar = tqdm.trange(sft.steps, desc="cold-start SFT", dynamic_ncols=True)
    for step in bar:
        if should_stop is not None and should_stop():
            raise ColdStartCancelled(f"cold start stopped on request at SFT step {step}/{sft.steps}")
        if not batches:
            batches = _length_grouped_batches(lengths, sft.batch_rows, rng)
        idx = batches.pop()
        batch = shard_batch(build_batch([path_rows[i] for i in idx], layout), mesh)
        state, metrics = step_fn(state, batch, None)
        # Wait for the step: dispatch is asynchronous, and a bar that counts dispatched steps ran
        # ten steps ahead of the work and then sat still for minutes (SmolLM2 on CPU).
        jax.block_until_ready(metrics["loss"])
        if step % 10 == 0 or step == sft.steps - 1:
            m = jax.device_get(metrics)
            bar.set_postfix(nll=f"{float(m['loss']):.3f}")
            if on_metrics:
                on_metrics(step, {f"sft/{k}": float(v) for k, v in m.items()})
    return state.params, float(np.mean([d.reward for d in demos]))


def collect_demonstrations(sources, sft, tokenizer, env) -> list:
    """`sft.demonstrations` scripted demonstrations taken in turn from the (rows, retriever)
    `sources`: demonstration i is source i mod len(sources)'s next row, demonstrated with that
    source's retriever (a source that runs out of rows leaves its turns to the others)."""
    k = len(sources)
    per_source = [len(range(j, sft.demonstrations, k)) for j in range(k)]
    made = [
        make_demonstrations(
            list(source_rows[:n]),
            retriever=retriever,
            tokenizer=tokenizer,
            cfg=sft.script,
            prompt=env.prompt,
            observation=env.observation,
        )
        for (source_rows, retriever), n in zip(sources, per_source, strict=True)
    ]
    return [d for group in itertools.zip_longest(*made) for d in group if d is not None]


def _length_grouped_batches(lengths: np.ndarray, rows: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One epoch of batches of similar lengths, in random order.

    A random permutation is cut into pools of 16 batches; each pool is sorted by length and
    cut into batches. A batch is padded to its longest row, and attention costs T², so
    grouping similar lengths roughly halves the cost of an epoch of demonstrations, while
    the pools keep each batch a random draw from the whole set.
    """
    order = rng.permutation(len(lengths))
    pool = 16 * rows
    batches = []
    for start in range(0, len(order) - rows + 1, pool):
        members = order[start : start + pool]
        members = members[np.argsort(lengths[members], kind="stable")]
        batches += [members[i : i + rows] for i in range(0, len(members) - rows + 1, rows)]
    rng.shuffle(batches)
    return batches
