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

from treegrpo_jax.train.config import TrainConfig
from treegrpo_jax.train.trainer import Trainer


def train_and_evaluate(cfg: TrainConfig, workdir: str) -> dict[str, float]:
    """Runs (or resumes) the whole job in `workdir`; returns the final evaluation metrics."""
    return Trainer(cfg, workdir).run()
