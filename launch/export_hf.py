"""Export a checkpoint as an HF checkpoint.

The program is `treegrpo_jax/launch/export_hf.py` (its usage is there and in `--help`); an installed
wheel has it as `treegrpo-export-hf`.
"""

from treegrpo_jax.launch.export_hf import run

if __name__ == "__main__":
    run()
