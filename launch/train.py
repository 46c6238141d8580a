"""Train with Tree-GRPO.

  python launch/train.py --config=configs/multihop.py:tiny --workdir=workdir/tiny

Re-running the same command resumes from the latest checkpoint in --workdir.
"""

import logging

from absl import app, flags
from ml_collections import config_flags

from treegrpo_jax.train.config import from_config_dict
from treegrpo_jax.train.loop import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (e.g. configs/multihop.py:tiny).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, logs and plots go here.", required=True)


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Orbax logs every checkpoint phase at INFO through absl; keep the console to the progress
    # bars, eval tables and warnings.
    logging.getLogger("absl").setLevel(logging.WARNING)
    train_and_evaluate(from_config_dict(_CONFIG.value), _WORKDIR.value)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
