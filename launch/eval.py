"""Evaluate a checkpoint.

The program is `treegrpo_jax/launch/eval.py` (its usage is there and in `--help`); an installed
wheel has it as `treegrpo-eval`.
"""

from treegrpo_jax.launch.eval import run

if __name__ == "__main__":
    run()
