"""Export a training checkpoint as an HF checkpoint (safetensors) that `transformers` loads.

  python launch/export_hf.py --workdir=workdir/tiny --out=exported/tiny [--step=N]

The model config comes from WORKDIR/model_config.json and the tokenizer (when the run saved
one) from WORKDIR/tokenizer/; without --step the latest checkpoint is exported.
"""

from absl import app, flags

from treegrpo_jax.train.export import export_from_workdir

_WORKDIR = flags.DEFINE_string("workdir", None, "The training run's directory.", required=True)
_OUT = flags.DEFINE_string("out", None, "HF checkpoint directory to write.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the latest).")


def main(argv):
    del argv
    step = export_from_workdir(_WORKDIR.value, _OUT.value, _STEP.value)
    print(f"exported step {step} of {_WORKDIR.value} to {_OUT.value}")


def run() -> None:
    """`treegrpo-export-hf` (and `python launch/export_hf.py`)."""
    app.run(main)
