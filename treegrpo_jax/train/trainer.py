"""The trainer: a run's parts built once, then resume or cold start, RL steps, evaluations, saves.

`train_and_evaluate` (`train/loop.py`, the semantics of a run) is `Trainer(cfg, workdir).run()`.
Each method is one thing a run does; the SIGTERM and retriever-outage rules live in `_stop_*`:

  * `__init__`    data, retriever, tokenizer, model, environment, logs, checkpoints, loader;
  * `start`       resume from the latest checkpoint, or cold start → step-0 evaluation → save 0;
  * `rl_step`     the step's prompts → tree rollouts → one update → metrics;
  * `evaluate`    greedy EM on the test rows (plus pictures);
  * `run`         the loop over steps: evaluate every `eval_every`, save every `checkpoint_every`.
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
from treegrpo_jax.rl.mechanism import mechanism_metrics
from treegrpo_jax.rl.packed import PackedBatch
from treegrpo_jax.rl.shapes import ShapeSet
from treegrpo_jax.rl.train_state import create_train_state
from treegrpo_jax.rl.train_step import jit_train_step
from treegrpo_jax.rollout.render import render_trees
from treegrpo_jax.rollout.tree_search import RolloutCancelled, rollout
from treegrpo_jax.train import multihost, process_stats, setup
from treegrpo_jax.train.breakdown import classify, outcome_counts, write_breakdown
from treegrpo_jax.train.checkpoint import CheckpointConfig, Checkpointer
from treegrpo_jax.train.cold_start import ColdStartCancelled, cold_start
from treegrpo_jax.train.compile_clock import compile_count, compile_seconds
from treegrpo_jax.train.config import ModelSource, TrainConfig
from treegrpo_jax.train.config_dict import check_run_config
from treegrpo_jax.train.evaluate import format_table, leaf_metrics
from treegrpo_jax.train.export import save_model_config
from treegrpo_jax.train.metrics import MetricsWriter, read_metrics, reduce_across_processes
from treegrpo_jax.train.plots import plot_metrics
from treegrpo_jax.train.profiling import StepProfiler, region
from treegrpo_jax.train.progress import LeafBar, count_params, run_header
from treegrpo_jax.train.report import render_training_trees, write_index

log = logging.getLogger(__name__)


class _Preempted:
    """Remembers a SIGTERM; rollouts and the cold start poll it (`__call__`) between engine calls."""

    def __init__(self):
        self.requested = False
        self.at = 0.0
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def restore(self) -> None:
        """Gives SIGTERM back to whoever had it before this run (idempotent)."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum, frame):
        del signum, frame
        self.requested, self.at = True, time.perf_counter()

    def __call__(self) -> bool:
        return self.requested

    def exit(self, what: str) -> None:
        if self.requested:
            after = time.perf_counter() - self.at
            tqdm.tqdm.write(f"SIGTERM: {what}; exiting {after:.1f} s after the signal")
        else:  # stopping with the job: another process received the signal (multihost.any_process)
            tqdm.tqdm.write(f"SIGTERM on another process of the job: {what}; exiting")
        raise SystemExit(0)

    def agreed(self) -> bool:
        """Whether any process of the job received SIGTERM (a collective: see `any_process`)."""
        return multihost.any_process(self.requested)


@dataclasses.dataclass
class RunState:
    """Where the run is: the train state of checkpoint `step`, what resumes with it."""

    state: object  # rl.train_state.TrainState
    step: int
    extra: dict  # the data-loader position (and `eval_pending`)
    reference: object | None  # the frozen KL reference params, or None


class Trainer:
    """One run in `workdir`: `run()` does the whole job and returns the final evaluation."""

    def __init__(self, cfg: TrainConfig, workdir: str):
        if cfg.run.distributed:
            multihost.initialize(cfg.run.coordinator_address, cfg.run.num_processes, cfg.run.process_id)
        cfg.check_devices(jax.device_count(), jax.process_count())
        os.makedirs(workdir, exist_ok=True)
        self.cfg, self.workdir = cfg, workdir
        self.primary = jax.process_index() == 0
        if cfg.run.compile_cache_dir:  # before anything compiles
            setup.enable_compile_cache(cfg.run.compile_cache_dir)
        self.profiler = StepProfiler(cfg.run.profile_steps, workdir)
        self.ckpt = Checkpointer(
            workdir, CheckpointConfig(keep=cfg.run.keep_checkpoints, every_steps=cfg.run.checkpoint_every)
        )
        self._check_run_config()
        self.mesh = make_mesh(cfg.mesh) if jax.device_count() > 1 else None
        self.preempted = _Preempted()
        with multihost.primary_first("setup"):  # process 0 writes the world and the tokenizer once
            self.data = setup.load_data(cfg, workdir)
            self.retriever = setup.make_retriever(cfg, self.data)
            tokenizer = (
                setup.make_tokenizer(cfg, self.data, self.retriever, workdir)
                if cfg.model.source == ModelSource.SCRATCH
                else None
            )
        self.model, self.model_cfg, self.tokenizer = setup.make_model(cfg, tokenizer, self.mesh)
        self.env = setup.make_env(cfg, self.tokenizer, self.retriever)
        if self.primary:
            save_model_config(workdir, self.model_cfg)
            setup.save_tokenizer(self.tokenizer, workdir)
        self.test_rows = list(self.data.test[: cfg.data.eval_prompts or None])
        self.writer = MetricsWriter(
            workdir,
            tensorboard=cfg.run.tensorboard,
            wandb_project=cfg.run.wandb_project or None,
            is_primary=self.primary,
        )
        self.plots_dir = os.path.join(workdir, "plots")
        os.makedirs(self.plots_dir, exist_ok=True)
        g = cfg.tree.leaves_per_prompt
        self.slots = cfg.run.rollout_slots or max(
            cfg.run.prompts_per_step * g, len(self.test_rows) and min(len(self.test_rows), 256)
        )
        self.loader = RowLoader(
            self.data.train,
            LoaderConfig(batch_size=cfg.run.prompts_per_step // jax.process_count(), seed=cfg.run.seed),
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        # Packed trees keep one host's leaf tables: several processes train on path rows (same update).
        kind = cfg.layout.kind if jax.process_count() == 1 else LayoutKind.PATHS
        self.layout = dataclasses.replace(cfg.layout, kind=kind)
        # The batch shapes the train step has been compiled for: a step pads up to one of them
        # when that is cheap rather than compile again (`rl.shapes`).
        self.shapes = ShapeSet(self.layout.shape_waste)
        self.engine = None
        self.shardings = None
        self.faults: dict[str, int] = {}

    # ------------------------------------------------------------------ parts
    def _make_engine(self, state):
        # Each process samples its own prompts, from a process-local copy of the weights.
        model = nnx.merge(state.graphdef, multihost.local_params(state.params))
        cfg = self.cfg
        return setup.make_engine(
            model,
            self.tokenizer,
            num_slots=self.slots,
            max_len=cfg.run.context_len,
            kv_dtype=cfg.model.kv_dtype,
            kernels=cfg.model.kernels,
            kv_cache=cfg.kv_cache,
        )

    def _host_state(self) -> dict:
        """What a checkpoint keeps besides the arrays: the loader's position and the compiled batch
        shapes (a resumed run pads its batches exactly as the uninterrupted run would)."""
        return {"loader": self.loader.get_state(), "shapes": self.shapes.get_state()}

    def _check_run_config(self) -> None:
        """A resume runs the config its checkpoints were trained with (WORKDIR/config.json)."""
        changes = check_run_config(
            self.workdir, self.cfg, resuming=self.ckpt.latest_step() is not None, write=self.primary
        )
        if changes:
            log.warning("resuming with a changed config (run.allow_config_change): %s", "; ".join(changes))

    def _header(self, resumed_from: int | None) -> str:
        cfg = self.cfg
        return run_header(
            cfg,
            self.model_cfg,
            count_params(self.model),
            train_rows=len(self.data.train),
            test_rows=len(self.data.test),
            eval_rows=len(self.test_rows),
            retriever=setup.describe_retriever(self.retriever),
            workdir=self.workdir,
            mesh=self.mesh,
            kv_dtype=setup.kv_dtype_for_backend(cfg.model.kv_dtype),
            kernels=native.resolve(cfg.model.kernels).value,
            resumed_from=resumed_from,
        )

    def evaluate(self, step: int) -> dict[str, float]:
        """Greedy EM of the current policy on the test rows; logged, pictured, printed."""
        cfg = self.cfg
        mine = len(self.test_rows[jax.process_index() :: jax.process_count()])  # this host's questions
        with region("evaluation"), LeafBar(mine, f"eval (step {step})", unit="q") as bar:
            metrics, trees = multihost.evaluate_sharded(
                self.engine,
                self.env,
                self.test_rows,
                cfg.agent,
                seed=cfg.run.seed,
                scheduler=cfg.rollout,
                should_stop=self.preempted,
                progress=bar,
            )
        # Why each answer was right or wrong (stopped early, misread, ...), at every evaluation:
        # each process classifies its own questions (rows p, p+n, ...) and the counts add up.
        mine = self.test_rows[jax.process_index() :: jax.process_count()]
        outcomes = [classify(r, t, self.tokenizer.decode) for r, t in zip(mine, trees, strict=True)]
        counts = outcome_counts(outcomes)
        summed = reduce_across_processes(counts, sum_keys=counts)
        total = max(sum(summed.values()), 1.0)
        metrics.update({k: v / total for k, v in summed.items()})
        if jax.process_count() == 1:  # the per-question file: one process holds every question
            write_breakdown(self.workdir, step, outcomes)
        self.writer.write(step, metrics)
        if self.primary and cfg.run.render_trees:
            path = os.path.join(self.plots_dir, f"eval_trees_step{step:05d}.png")
            render_trees(trees[: cfg.run.render_trees], path)
        tqdm.tqdm.write(f"[step {step}] eval EM {100 * metrics['eval/em']:.1f}\n{format_table(metrics)}")
        return metrics

    def _evaluate_or_stop(self, run: RunState) -> dict[str, float]:
        """`evaluate(run.step)`; a SIGTERM or an outage saves `run` with the evaluation pending."""
        try:
            return self.evaluate(run.step)
        except RetrieverUnavailableError as e:
            self._stop_for_outage(e, run, eval_pending=True)
        except RolloutCancelled:
            self._stop_for_sigterm(run, eval_pending=True)

    # ------------------------------------------------------------- stopping
    def _save_now(self, run: RunState, extra: dict) -> None:
        # The state is exactly checkpoint `step` (the update of `step + 1` has not started):
        # save it, so re-running the same command loses nothing.
        self.ckpt.save(run.step, run.state, extra, reference=run.reference, force=True)
        self.ckpt.wait()
        self.writer.close()

    def _stop_for_sigterm(self, run: RunState, *, eval_pending: bool = False) -> None:
        extra = {**run.extra, "eval_pending": True} if eval_pending else run.extra
        self._save_now(run, extra)
        self.preempted.exit(
            f"saved step {run.step}{' (evaluation pending)' if eval_pending else ''}; "
            "re-run the same command to resume"
        )

    def _stop_for_outage(self, error: Exception, run: RunState, *, eval_pending: bool = False) -> None:
        extra = {**run.extra, "eval_pending": True} if eval_pending else run.extra
        self._save_now(run, extra)
        raise RetrieverUnavailableError(
            f"{error}. Saved checkpoint step {run.step} in {self.ckpt.directory}: bring the retrieval "
            "server back and re-run the same command to resume."
        ) from error

    # ---------------------------------------------------------------- start
    def start(self) -> tuple[RunState, dict[str, float]]:
        """Resumes from the latest checkpoint, or cold-starts and evaluates step 0 (then saves
        it). Returns the run's position and the evaluation already known for it ({} if none)."""
        cfg, latest = self.cfg, self.ckpt.latest_step()
        if self.primary:
            tqdm.tqdm.write(self._header(latest))
        if latest is None:
            if cfg.sft.steps:
                try:
                    params, demo_reward = cold_start(
                        self.model,
                        self.tokenizer,
                        self.env,
                        self.data.train,
                        cfg.sft,
                        mesh=self.mesh,
                        length_buckets=cfg.layout.length_buckets,
                        seed=cfg.run.seed,
                        on_metrics=lambda s, m: None,
                        # Polled once per SFT step on every process: the stop is taken together.
                        should_stop=self.preempted.agreed,
                        sources=setup.demonstration_sources(cfg, self.data, self.retriever),
                    )
                except ColdStartCancelled as e:
                    self.writer.close()
                    self.preempted.exit(
                        f"{e}; no checkpoint yet: re-running the same command repeats it exactly"
                    )
                nnx.update(self.model, params)
                log.info("cold start done (demonstration reward %.3f)", demo_reward)
            state, self.shardings = create_train_state(self.model, cfg.optim, mesh=self.mesh)
            reference = None
            if cfg.loss.uses_reference:  # the frozen KL reference: saved once, beside the checkpoints
                reference = jax.tree.map(jnp.copy, state.params)
            run = RunState(state=state, step=0, extra=self._host_state(), reference=reference)
            self.engine = self._make_engine(state)
            self.writer.truncate_after(-1)  # a run killed before its first checkpoint starts its log afresh
            self._evaluate_or_stop(run)  # EM after the cold start
            self.ckpt.save(0, state, run.extra, reference=reference, force=True)
        else:
            state, self.shardings = create_train_state(self.model, cfg.optim, mesh=self.mesh)
            # A damaged newest step (truncated or deleted files) is moved aside with a warning and
            # the previous readable step resumes; never a silent cold start.
            latest, (state, extra, reference) = self.ckpt.restore_latest_good(
                abstract_state=state, with_reference=cfg.loss.uses_reference
            )
            run = RunState(state=state, step=latest, extra=extra, reference=reference)
            self.writer.truncate_after(latest)
            self.engine = self._make_engine(state)
            log.info("resumed from step %d", latest)
        self.loader.set_state(run.extra["loader"])
        # Older checkpoints have no shape list: the run then starts a new one (only padding differs).
        self.shapes.set_state(run.extra.get("shapes", []))
        final_eval: dict[str, float] = {}
        if run.extra.get("eval_pending"):  # a retriever outage or SIGTERM stopped this step's evaluation
            try:
                final_eval = self.evaluate(run.step)
            except RolloutCancelled:
                self.preempted.exit(
                    f"evaluation of step {run.step} still pending (checkpoint {run.step} kept)"
                )
        elif run.step == cfg.run.steps:  # killed after the last checkpoint: its evaluation is in the log
            final_eval = _logged_eval(self.writer.path, run.step)
        return run, final_eval

    # ------------------------------------------------------------- RL step
    def rl_step(self, run: RunState, step_fn, root_key) -> tuple[RunState, dict[str, float], list]:
        """Step `run.step + 1`: this host's prompts → trees → the update; returns the new position,
        the step's metrics (reduced over hosts) and this host's trees."""
        cfg, step = self.cfg, run.step
        t0, compiled0, compiles0 = time.perf_counter(), compile_seconds(), compile_count()
        before = RunState(run.state, step, self._host_state(), None)  # checkpoint `step`
        rows = next(self.loader)
        first_prompt = jax.process_index() * len(rows)  # this host's first prompt of the step
        base_uid = step * cfg.run.prompts_per_step + first_prompt
        try:
            rollout_bar = LeafBar(len(rows) * cfg.tree.leaves_per_prompt, f"rollout (step {step + 1})")
            with region("rollout"), rollout_bar as leaf_bar:
                trees, rstats = rollout(
                    self.engine,
                    self.env,
                    rows,
                    cfg.tree,
                    cfg.agent,
                    key=jax.random.fold_in(root_key, step),
                    prompt_uids=[base_uid + i for i in range(len(rows))],
                    scheduler=cfg.rollout,
                    should_stop=self.preempted,
                    progress=leaf_bar,
                )
            cancelled = False
        except RetrieverUnavailableError as e:
            self._stop_for_outage(e, before)
        except RolloutCancelled:
            cancelled = True
        # Every process decides here together: one process's SIGTERM stops the step everywhere
        # (the others' finished rollouts are dropped), so no process waits in the update alone.
        if self.preempted.agreed() or cancelled:
            self._stop_for_sigterm(before)
        t1 = time.perf_counter()
        with region("batch"):
            batch = multihost.step_batch(trees, self.layout, self.mesh, first_prompt, self.shapes)
        with region("update"):
            # The pool is empty between rollouts: its memory goes to the step (made again at the
            # next engine call), which is what lets a long-context step fit beside a wide pool.
            self.engine.release_kv()
            state, train_metrics = step_fn(run.state, batch, run.reference)
            # The next rollout samples from the updated policy (the same arrays on one process).
            self.engine.set_params(multihost.local_params(state.params))
            metrics = {f"train/{k}": float(v) for k, v in jax.device_get(train_metrics).items()}
        host = leaf_metrics(trees, "train")  # every host has as many leaves: means of means are exact
        # What the update computes over: token slots of the padded batch and the real tokens in
        # them (packed trees: unique tokens; paths: every path's) — their ratio is the padding.
        host["batch/slots"], host["batch/tokens"] = _batch_fill(batch)
        host.update({f"rollout/{k}": float(v) for k, v in rstats.as_dict().items()})
        t2 = time.perf_counter()
        host["time/rollout_s"], host["time/update_s"], host["time/step_s"] = t1 - t0, t2 - t1, t2 - t0
        # New batch shapes recompile the step; this is how much of the step that was.
        host["time/compile_s"] = compile_seconds() - compiled0
        host["time/compiles"] = float(compile_count() - compiles0)
        host["batch/shapes"] = float(len(self.shapes.shapes))  # train-step shapes compiled so far
        # Why the step learns or not: how much of it carries a non-zero advantage (`rl.mechanism`).
        host.update(mechanism_metrics(trees, cfg.loss.estimator, cfg.loss.credit))
        now = setup.retriever_faults(self.retriever)  # this step's retries, timeouts, bad bodies, ...
        host.update({f"rollout/retriever_{k}": float(now[k] - self.faults[k]) for k in now})
        self.faults = now
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
        # This process's memory, threads, files, mappings and programs (the primary's are logged).
        metrics.update(process_stats.sample())
        done = RunState(state, step + 1, self._host_state(), run.reference)
        return done, metrics, trees

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, float]:
        """The whole job; whichever way it ends (done, SIGTERM, an error), nothing of it keeps
        running: pending saves commit, Orbax's and the metric writers' threads stop, and SIGTERM
        goes back to its previous handler."""
        try:
            return self._run()
        finally:
            self.ckpt.close()
            self.writer.close()
            self.preempted.restore()

    def _run(self) -> dict[str, float]:
        cfg = self.cfg
        run, final_eval = self.start()
        step_fn = jit_train_step(
            self.shardings,
            loss_cfg=cfg.loss,
            optim_cfg=cfg.optim,
            mesh=self.mesh,
            layout_kind=self.layout.kind,
        )
        self.faults = setup.retriever_faults(self.retriever)  # step deltas exclude the step-0 evaluation
        root_key = jax.random.key(cfg.run.seed)
        bar = tqdm.trange(
            run.step,
            cfg.run.steps,
            initial=run.step,
            total=cfg.run.steps,
            desc="Tree-GRPO",
            dynamic_ncols=True,
        )
        with self.profiler.stopping_on_exit():
            final_eval = self._steps(run, bar, step_fn, root_key, final_eval)
        self.ckpt.wait()
        self.ckpt.close()
        self.writer.close()
        if self.primary:
            plot_metrics(os.path.join(self.workdir, "metrics.jsonl"), self.plots_dir)
            with open(os.path.join(self.workdir, "final_eval.json"), "w") as f:
                json.dump(final_eval, f, indent=2)
            tqdm.tqdm.write(f"run at a glance: {write_index(self.workdir, cfg)}")
        return final_eval

    def _steps(self, run: RunState, bar, step_fn, root_key, final_eval: dict) -> dict[str, float]:
        """The RL steps left: each step, its evaluation when due, its checkpoint."""
        cfg = self.cfg
        for _ in bar:
            self.profiler.before(run.step + 1)
            run, metrics, trees = self.rl_step(run, step_fn, root_key)
            done = run.step
            self.writer.write(done, metrics)
            bar.set_postfix(
                reward=f"{metrics['train/reward_mean']:.3f}",
                em=f"{metrics['train/em_mean']:.3f}",
                calls=f"{metrics['train/tool_calls_mean']:.2f}",
            )
            last = done == cfg.run.steps
            if done % cfg.run.eval_every == 0 or last:
                if self.primary and cfg.run.render_trees:  # how this step's trees branched
                    path = os.path.join(self.plots_dir, f"train_trees_step{done:05d}.png")
                    render_training_trees(trees, cfg.loss.estimator.value, path, step=done)
                # An interrupted evaluation saves without the reference (saved once, at step 0).
                final_eval = self._evaluate_or_stop(dataclasses.replace(run, reference=None))
                if self.primary:
                    plot_metrics(os.path.join(self.workdir, "metrics.jsonl"), self.plots_dir)
                    write_index(self.workdir, cfg)
            stop = self.preempted.agreed()  # a SIGTERM on any process, taken by all together
            with region("checkpoint"):
                self.ckpt.save(done, run.state, run.extra, force=last or stop)
            self.profiler.after(done, run.state.params)
            process_stats.release_if_near_limit()  # XLA:CPU's mapping limit (process_stats.py)
            if stop and not last:
                self.ckpt.wait()
                self.writer.close()
                self.preempted.exit(f"saved step {done}; re-run the same command to resume")
        return final_eval


# One program per batch shape, compiled beside the step's own (eager ops would make two).
_count_real = jax.jit(lambda x: jnp.sum(x > 0))


def _batch_fill(batch) -> tuple[float, float]:
    """(token slots, real tokens) of the step's global batch: the same on every process."""
    real = batch.segment if isinstance(batch, PackedBatch) else batch.valid
    return float(batch.tokens.size), float(_count_real(real))


def _is_mean(key: str) -> bool:
    """Rollout metrics averaged over processes (times, fractions); the others are counts, summed."""
    means = ("/occupancy", "/waste_fraction", "/rows_in_flight", "/kv_peak_over_unique", "/pick_depth")
    return "time" in key or "wall" in key or key.endswith(means)


def _logged_eval(metrics_path, step: int) -> dict[str, float]:
    """The evaluation logged at `step` (the primary process's log; {} elsewhere or if none)."""
    if not os.path.isfile(metrics_path):
        return {}
    rows = [r for r in read_metrics(metrics_path) if r["step"] == step and "eval/em" in r]
    return {k: v for k, v in rows[-1].items() if k != "step"} if rows else {}
