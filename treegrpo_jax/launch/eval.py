"""Evaluate a checkpoint (latest by default) on the config's test sets; prints EM per source.

python launch/eval.py --workdir=workdir/tiny [--step=N] [--breakdown]

The run's own config (WORKDIR/config.json) is used unless `--config=` (and overrides) is given.
"""

from absl import app, flags

from treegrpo_jax.train import cli
from treegrpo_jax.train.eval_main import evaluate_checkpoint

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "The training workdir.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_BREAKDOWN = flags.DEFINE_bool(
    "breakdown", False, "Classify every answer (read, stopped early, wrong search, ...) per hop count."
)


def main(argv):
    del argv
    cfg = cli.train_config(_CONFIG.value, _WORKDIR.value)
    evaluate_checkpoint(cfg, _WORKDIR.value, step=_STEP.value, with_breakdown=_BREAKDOWN.value)


def run() -> None:
    """`treegrpo-eval` (and `python launch/eval.py`)."""
    app.run(main, flags_parser=cli.parse_flags)
