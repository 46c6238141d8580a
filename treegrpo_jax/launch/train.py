"""Train with Tree-GRPO.

  python launch/train.py --config=configs/multihop.py:tiny --workdir=workdir/tiny

Every field can be set: `--config.<block>.<field>=VALUE` (e.g. `--config.optim.b2=0.95`).
Re-running the same command resumes from the latest checkpoint in --workdir; so does
`python launch/train.py --workdir=W` alone, with the run's own W/config.json.
"""

import logging
import signal
import sys

from absl import app, flags

from treegrpo_jax.train import cli
from treegrpo_jax.train.checkpoint import (
    CheckpointMismatchError,
    CheckpointWriteError,
    DamagedCheckpointError,
)
from treegrpo_jax.train.config_dict import ConfigChangedError
from treegrpo_jax.train.loop import train_and_evaluate

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, logs and plots go here.", required=True)


def main(argv):
    del argv
    # Orbax logs every checkpoint phase at INFO through absl; keep the console to the progress
    # bars, eval tables and warnings.
    logging.getLogger("absl").setLevel(logging.WARNING)
    try:
        train_and_evaluate(cli.train_config(_CONFIG.value, _WORKDIR.value), _WORKDIR.value)
        # Done and saved: a SIGTERM while the interpreter winds down (JAX's and Orbax's atexit
        # work) must not turn a finished run into a killed one (exit -15) for the job's supervisor.
        # Ignored, not handled: Python resets its own handlers to the default as it finalizes, and
        # the random-moment trials of benchmarks/resilience.py caught SIGTERMs landing there.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except (ConfigChangedError, CheckpointMismatchError, CheckpointWriteError, DamagedCheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run() -> None:
    """`treegrpo-train` (and `python launch/train.py`)."""
    app.run(main, flags_parser=cli.parse_flags)
