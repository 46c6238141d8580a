"""Compile a run for a TPU topology on this host (no TPU needed).

The program is `treegrpo_jax/launch/compile.py` (its usage is there and in `--help`); an installed
wheel has it as `treegrpo-compile`.
"""

from treegrpo_jax.launch.compile import run

if __name__ == "__main__":
    run()
