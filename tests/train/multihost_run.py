"""One process of a toy `:tiny` run (see test_multihost.py).

Usage: python -m tests.train.multihost_run WORKDIR PROCESS_ID NUM_PROCESSES PORT

N=1 runs alone (no jax.distributed); N>1 joins a job of N processes coordinated on 127.0.0.1:PORT.
"""

import sys

from tests.train.toy import toy_config_dict
from treegrpo_jax.train.config import from_config_dict
from treegrpo_jax.train.loop import train_and_evaluate


def main(workdir: str, process_id: int, num_processes: int, port: int) -> None:
    c = toy_config_dict(steps=2)
    c.run.update(eval_every=2, checkpoint_every=2, tensorboard=False)
    if num_processes > 1:
        c.run.update(
            distributed=True,
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=num_processes,
            process_id=process_id,
        )
    train_and_evaluate(from_config_dict(c), workdir)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
