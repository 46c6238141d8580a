"""Evaluate a checkpoint (latest by default) on the config's test sets; prints EM per source.

python launch/eval.py --config=configs/multihop.py:tiny --workdir=workdir/tiny [--step=N]
"""

import logging

from absl import app, flags
from ml_collections import config_flags

from treegrpo_jax.train.config import from_config_dict
from treegrpo_jax.train.eval_main import evaluate_checkpoint

_CONFIG = config_flags.DEFINE_config_file("config", None, "The training config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The training workdir.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    evaluate_checkpoint(from_config_dict(_CONFIG.value), _WORKDIR.value, step=_STEP.value)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
