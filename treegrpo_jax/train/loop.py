"""`train_and_evaluate`: cold start → Tree-GRPO steps → evaluation, checkpoints and logs.

One RL step: the loader's next prompts → tree rollouts on the current weights (the
engine holds the train state's own arrays: no copy) → each tree's unique tokens packed
once (`rl.layout` "packed"; "paths": one row per root-to-leaf path) → advantages over all
leaves and the clipped update (`rl.train_step`) → metrics. Every `eval_every` steps,
greedy EM on the test rows; every `checkpoint_every` steps, an Orbax checkpoint with the
optimizer, the data-loader position and the step. Re-running
the same command resumes from the latest checkpoint. SIGTERM (a preemption notice: ~30 s)
is acted on within one decode call wherever it lands: a rollout or an evaluation stops and
the run saves the last state it can resume exactly (the step's start; an evaluation marked
pending), an update finishes first, a cold start stops with nothing to save (it repeats
exactly); then it exits 0. A SIGKILL loses at most the steps since the
last committed checkpoint, and the re-run repeats them bit for bit. A retrieval server
unreachable for longer than `retriever.max_outage_s` stops the run with a saved checkpoint
(`RetrieverUnavailableError`), never a hang.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time

import jax
import jax.numpy as jnp
import tqdm
from flax import nnx

from treegrpo_jax import native
from treegrpo_jax.data.loader import LoaderConfig, RowLoader
from treegrpo_jax.env.retrieval import RetrieverUnavailableError
from treegrpo_jax.parallel.mesh import make_mesh
from treegrpo_jax.rl.batch import LayoutKind
from treegrpo_jax.rl.train_state import create_train_state
from treegrpo_jax.rl.train_step import jit_train_step
from treegrpo_jax.rollout.render import render_trees
from treegrpo_jax.rollout.tree_search import RolloutCancelled, rollout
from treegrpo_jax.train import multihost, setup
from treegrpo_jax.train.checkpoint import CheckpointConfig, Checkpointer
from treegrpo_jax.train.cold_start import ColdStartCancelled, cold_start
from treegrpo_jax.train.config import ModelSource, TrainConfig
from treegrpo_jax.train.evaluate import format_table, leaf_metrics
from treegrpo_jax.train.export import save_model_config
from treegrpo_jax.train.metrics import MetricsWriter, read_metrics, reduce_across_processes
from treegrpo_jax.train.plots import plot_metrics
from treegrpo_jax.train.progress import LeafBar, count_params, run_header
from treegrpo_jax.train.report import render_training_trees, write_index

log = logging.getLogger(__name__)


class _Preempted:
    """Remembers a SIGTERM; rollouts and the cold start poll it (`__call__`) between engine calls."""

    def __init__(self):
        self.requested = False
        self.at = 0.0
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        del signum, frame
        self.requested, self.at = True, time.perf_counter()

    def __call__(self) -> bool:
        return self.requested

    def exit(self, what: str) -> None:
        tqdm.tqdm.write(f"SIGTERM: {what}; exiting {time.perf_counter() - self.at:.1f} s after the signal")
        raise SystemExit(0)


def train_and_evaluate(cfg: TrainConfig, workdir: str) -> dict[str, float]:
    """Runs (or resumes) the whole job in `workdir`; returns the final evaluation metrics."""
    if cfg.run.distributed:
        multihost.initialize(cfg.run.coordinator_address, cfg.run.num_processes, cfg.run.process_id)
    cfg.check_devices(jax.device_count(), jax.process_count())
    os.makedirs(workdir, exist_ok=True)
    primary = jax.process_index() == 0
    mesh = make_mesh(cfg.mesh) if jax.device_count() > 1 else None
    preempted = _Preempted()

    with multihost.primary_first("setup"):  # process 0 writes the world and the tokenizer once
        data = setup.load_data(cfg, workdir)
        retriever = setup.make_retriever(cfg, data)
        tokenizer = (
            setup.make_tokenizer(cfg, data, retriever, workdir)
            if cfg.model.source == ModelSource.SCRATCH
            else None
        )
    model, model_cfg, tokenizer = setup.make_model(cfg, tokenizer, mesh)
    env = setup.make_env(cfg, tokenizer, retriever)
    if primary:
        save_model_config(workdir, model_cfg)
        setup.save_tokenizer(tokenizer, workdir)
    test_rows = list(data.test[: cfg.data.eval_prompts or None])
    writer = MetricsWriter(
        workdir,
        tensorboard=cfg.run.tensorboard,
        wandb_project=cfg.run.wandb_project or None,
        is_primary=primary,
    )
    ckpt = Checkpointer(
        workdir, CheckpointConfig(keep=cfg.run.keep_checkpoints, every_steps=cfg.run.checkpoint_every)
    )
    plots_dir = os.path.join(workdir, "plots")
    os.makedirs(plots_dir, exist_ok=True)

    g = cfg.tree.leaves_per_prompt
    slots = cfg.run.rollout_slots or max(
        cfg.run.prompts_per_step * g, len(test_rows) and min(len(test_rows), 256)
    )
    loader = RowLoader(
        data.train,
        LoaderConfig(batch_size=cfg.run.prompts_per_step // jax.process_count(), seed=cfg.run.seed),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )

    def make_engine(state):
        # Each process samples its own prompts, from a process-local copy of the weights.
        model = nnx.merge(state.graphdef, multihost.local_params(state.params))
        return setup.make_engine(
            model,
            tokenizer,
            num_slots=slots,
            max_len=cfg.run.context_len,
            kv_dtype=cfg.model.kv_dtype,
            kernels=cfg.model.kernels,
            kv_cache=cfg.kv_cache,
        )

    def log_metrics(step, metrics):
        writer.write(step, metrics)

    def run_eval(step, engine):
        mine = len(test_rows[jax.process_index() :: jax.process_count()])  # this host's questions
        with LeafBar(mine, f"eval (step {step})", unit="q") as bar:
            metrics, trees = multihost.evaluate_sharded(
                engine,
                env,
                test_rows,
                cfg.agent,
                seed=cfg.run.seed,
                scheduler=cfg.rollout,
                should_stop=preempted,
                progress=bar,
            )
        log_metrics(step, metrics)
        if primary and cfg.run.render_trees:
            render_trees(
                trees[: cfg.run.render_trees], os.path.join(plots_dir, f"eval_trees_step{step:05d}.png")
            )
        tqdm.tqdm.write(f"[step {step}] eval EM {100 * metrics['eval/em']:.1f}\n{format_table(metrics)}")
        return metrics

    def save_now(step, state, extra, reference=None):
        # The state is exactly checkpoint `step` (the update of `step + 1` has not started):
        # save it, so re-running the same command loses nothing.
        ckpt.save(step, state, extra, reference=reference, force=True)
        ckpt.wait()
        writer.close()

    def stop_for_sigterm(step, state, extra, reference=None):
        save_now(step, state, extra, reference)
        preempted.exit(
            f"saved step {step}{' (evaluation pending)' if extra.get('eval_pending') else ''}; "
            "re-run the same command to resume"
        )

    def stop_for_outage(error, step, state, extra, reference=None):
        save_now(step, state, extra, reference)
        raise RetrieverUnavailableError(
            f"{error}. Saved checkpoint step {step} in {ckpt.directory}: bring the retrieval server "
            "back and re-run the same command to resume."
        ) from error

    latest = ckpt.latest_step()
    if primary:
        tqdm.tqdm.write(
            run_header(
                cfg,
                model_cfg,
                count_params(model),
                train_rows=len(data.train),
                test_rows=len(data.test),
                eval_rows=len(test_rows),
                retriever=setup.describe_retriever(retriever),
                workdir=workdir,
                mesh=mesh,
                kv_dtype=setup.kv_dtype_for_backend(cfg.model.kv_dtype),
                kernels=native.resolve(cfg.model.kernels).value,
                resumed_from=latest,
            )
        )
    ref_params = None
    if latest is None:
        if cfg.sft.steps:
            try:
                params, demo_reward = cold_start(
                    model,
                    tokenizer,
                    env,
                    data.train,
                    cfg.sft,
                    mesh=mesh,
                    length_buckets=cfg.layout.length_buckets,
                    seed=cfg.run.seed,
                    on_metrics=lambda s, m: None,
                    should_stop=preempted,
                )
            except ColdStartCancelled as e:
                writer.close()
                preempted.exit(f"{e}; no checkpoint yet: re-running the same command repeats it exactly")
            nnx.update(model, params)
            log.info("cold start done (demonstration reward %.3f)", demo_reward)
        state, shardings = create_train_state(model, cfg.optim, mesh=mesh)
        start, extra = 0, {"loader": loader.get_state()}
        engine = make_engine(state)
        writer.truncate_after(-1)  # a run killed before its first checkpoint starts its log afresh
        if cfg.loss.uses_reference:  # the frozen KL reference: saved once, beside the checkpoints
            ref_params = jax.tree.map(jnp.copy, state.params)
        try:
            run_eval(0, engine)  # EM after the cold start
        except RetrieverUnavailableError as e:
            stop_for_outage(e, 0, state, {**extra, "eval_pending": True}, reference=ref_params)
        except RolloutCancelled:
            stop_for_sigterm(0, state, {**extra, "eval_pending": True}, reference=ref_params)
        ckpt.save(0, state, extra, reference=ref_params, force=True)
    else:
        state, shardings = create_train_state(model, cfg.optim, mesh=mesh)
        state, extra, ref_params = ckpt.restore(
            latest, abstract_state=state, with_reference=cfg.loss.uses_reference
        )
        start = latest
        writer.truncate_after(start)
        engine = make_engine(state)
        log.info("resumed from step %d", start)
    loader.set_state(extra["loader"])
    final_eval: dict[str, float] = {}
    if extra.get("eval_pending"):  # a retriever outage or SIGTERM stopped this step's evaluation
        try:
            final_eval = run_eval(start, engine)
        except RolloutCancelled:
            preempted.exit(f"evaluation of step {start} still pending (checkpoint {start} kept)")
    elif start == cfg.run.steps:  # killed after the last checkpoint: its evaluation is in the log
        final_eval = _logged_eval(writer.path, start)

    # Packed trees keep one host's leaf tables: several processes train on path rows (same update).
    layout_kind = cfg.layout.kind if jax.process_count() == 1 else LayoutKind.PATHS
    step_layout = dataclasses.replace(cfg.layout, kind=layout_kind)
    step_fn = jit_train_step(
        shardings, loss_cfg=cfg.loss, optim_cfg=cfg.optim, mesh=mesh, layout_kind=layout_kind
    )
    root_key = jax.random.key(cfg.run.seed)
    faults = setup.retriever_faults(retriever)
    bar = tqdm.trange(
        start, cfg.run.steps, initial=start, total=cfg.run.steps, desc="Tree-GRPO", dynamic_ncols=True
    )
    for step in bar:
        t0 = time.perf_counter()
        before = {"loader": loader.get_state()}  # checkpoint `step`'s host state
        rows = next(loader)
        first_prompt = jax.process_index() * len(rows)  # this host's first prompt of the step
        base_uid = step * cfg.run.prompts_per_step + first_prompt
        try:
            with LeafBar(len(rows) * g, f"rollout (step {step + 1})") as leaf_bar:
                trees, rstats = rollout(
                    engine,
                    env,
                    rows,
                    cfg.tree,
                    cfg.agent,
                    key=jax.random.fold_in(root_key, step),
                    prompt_uids=[base_uid + i for i in range(len(rows))],
                    scheduler=cfg.rollout,
                    should_stop=preempted,
                    progress=leaf_bar,
                )
        except RetrieverUnavailableError as e:
            stop_for_outage(e, step, state, before)
        except RolloutCancelled:
            stop_for_sigterm(step, state, before)
        t1 = time.perf_counter()
        batch = multihost.step_batch(trees, step_layout, mesh, first_prompt)
        state, train_metrics = step_fn(state, batch, ref_params)
        # The next rollout samples from the updated policy (the same arrays on one process).
        engine.set_params(multihost.local_params(state.params))
        metrics = {f"train/{k}": float(v) for k, v in jax.device_get(train_metrics).items()}
        host = leaf_metrics(trees, "train")  # every host has as many leaves: means of means are exact
        host.update({f"rollout/{k}": float(v) for k, v in rstats.as_dict().items()})
        host["time/rollout_s"], host["time/step_s"] = t1 - t0, time.perf_counter() - t0
        now = setup.retriever_faults(retriever)  # this step's retries, timeouts, bad bodies, ...
        host.update({f"rollout/retriever_{k}": float(now[k] - faults[k]) for k in now})
        faults = now
        metrics.update(
            reduce_across_processes(
                host,
                sum_keys=[k for k in host if k.startswith("rollout/") and not _is_mean(k)],
            )
        )
        metrics["rollout/reprefill_ratio"] = metrics["rollout/reprefill_tokens"] / max(
            1.0, metrics["rollout/prefilled_tokens"]
        )
        # A ratio of the totals over all hosts (not a mean of per-host ratios).
        metrics["rollout/kv_peak_over_unique"] = metrics["rollout/kv_peak_tokens"] / max(
            1.0, metrics["rollout/unique_tokens"]
        )
        done = step + 1
        log_metrics(done, metrics)
        bar.set_postfix(
            reward=f"{metrics['train/reward_mean']:.3f}",
            em=f"{metrics['train/em_mean']:.3f}",
            calls=f"{metrics['train/tool_calls_mean']:.2f}",
        )
        last = done == cfg.run.steps
        if done % cfg.run.eval_every == 0 or last:
            if primary and cfg.run.render_trees:  # how this step's trees branched, and their advantages
                path = os.path.join(plots_dir, f"train_trees_step{done:05d}.png")
                render_training_trees(trees, cfg.loss.estimator.value, path, step=done)
            try:
                final_eval = run_eval(done, engine)
            except RetrieverUnavailableError as e:
                stop_for_outage(e, done, state, {"loader": loader.get_state(), "eval_pending": True})
            except RolloutCancelled:
                stop_for_sigterm(done, state, {"loader": loader.get_state(), "eval_pending": True})
            if primary:
                plot_metrics(os.path.join(workdir, "metrics.jsonl"), plots_dir)
                write_index(workdir, cfg)
        ckpt.save(done, state, {"loader": loader.get_state()}, force=last or preempted.requested)
        if preempted.requested and not last:
            ckpt.wait()
            writer.close()
            preempted.exit(f"saved step {done}; re-run the same command to resume")
    ckpt.wait()
    ckpt.close()
    writer.close()
    if primary:
        plot_metrics(os.path.join(workdir, "metrics.jsonl"), plots_dir)
        with open(os.path.join(workdir, "final_eval.json"), "w") as f:
            json.dump(final_eval, f, indent=2)
        tqdm.tqdm.write(f"run at a glance: {write_index(workdir, cfg)}")
    return final_eval


def _is_mean(key: str) -> bool:
    """Rollout metrics averaged over processes (times, fractions); the others are counts, summed."""
    means = ("/occupancy", "/waste_fraction", "/rows_in_flight", "/kv_peak_over_unique")
    return "time" in key or "wall" in key or key.endswith(means)


def _logged_eval(metrics_path, step: int) -> dict[str, float]:
    """The evaluation logged at `step` (the primary process's log; {} elsewhere or if none)."""
    if not os.path.isfile(metrics_path):
        return {}
    rows = [r for r in read_metrics(metrics_path) if r["step"] == step and "eval/em" in r]
    return {k: v for k, v in rows[-1].items() if k != "step"} if rows else {}
