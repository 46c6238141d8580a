"""Cold-start SFT on scripted demonstrations, through the RL train step's SFT mode."""

from __future__ import annotations

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


def cold_start(model, tokenizer, env, rows, sft, *, mesh, length_buckets, seed: int, on_metrics=None):
    """Trains `model` on `sft.demonstrations` scripted trajectories for `sft.steps` steps.

    Returns the trained params (an nnx.State in the model's shardings) and the mean
    demonstration reward (how imperfect the demonstrations were).
    """
    demos = make_demonstrations(
        list(rows[: sft.demonstrations]),
        retriever=env.retriever,
        tokenizer=tokenizer,
        cfg=sft.script,
        prompt=env.prompt,
        observation=env.observation,
    )
    path_rows = [
        demonstration_row(tokenize_demonstration(d, tokenizer).spans, prompt_id=i)
        for i, d in enumerate(demos)
    ]
    state, shardings = create_train_state(model, sft.optim, mesh=mesh)
    step_fn = jit_train_step(shardings, loss_cfg=sft_loss_config(), optim_cfg=sft.optim, mesh=mesh)
    layout = BatchLayout(length_buckets=length_buckets, row_multiple=sft.batch_rows)
    rng = np.random.default_rng(seed)
    order: list[int] = []
    bar = tqdm.trange(sft.steps, desc="cold-start SFT", dynamic_ncols=True)
    for step in bar:
        if len(order) < sft.batch_rows:
            order += list(rng.permutation(len(path_rows)))
        idx, order = order[: sft.batch_rows], order[sft.batch_rows :]
        batch = shard_batch(build_batch([path_rows[i] for i in idx], layout), mesh)
        state, metrics = step_fn(state, batch, None)
        if step % 10 == 0 or step == sft.steps - 1:
            m = jax.device_get(metrics)
            bar.set_postfix(nll=f"{float(m['loss']):.3f}")
            if on_metrics:
                on_metrics(step, {f"sft/{k}": float(v) for k, v in m.items()})
    return state.params, float(np.mean([d.reward for d in demos]))
