"""Train with Tree-GRPO.

The program is `treegrpo_jax/launch/train.py` (its usage is there and in `--help`); an installed
wheel has it as `treegrpo-train`.
"""

from treegrpo_jax.launch.train import run

if __name__ == "__main__":
    run()
