"""Generate a completion with the KV-cache engine.

The program is `treegrpo_jax/launch/generate.py` (its usage is there and in `--help`); an installed
wheel has it as `treegrpo-generate`.
"""

from treegrpo_jax.launch.generate import run

if __name__ == "__main__":
    run()
