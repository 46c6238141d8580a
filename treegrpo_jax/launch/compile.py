"""Compile a run for a TPU topology on this host, and say whether it fits and how fast it should be.

  python launch/compile.py --config=configs/multihop.py --topology=v5e:2x4 \
    --config.model.path=qwen2.5-3b [--num_slices=N] [--json=report.json] [--search]

Every program the run compiles (`treegrpo_jax/aot/programs.py`) is compiled for the topology by
the TPU compiler (libtpu, found by `aot.targets.find_libtpu`) with abstract inputs in their real
shardings: nothing is allocated and no TPU is needed. `--config.model.path` is a named size
(`qwen2.5-3b`, `qwen2.5-7b`, `llama3.2-3b`, ... : `model/sizes.py`) or an HF directory whose
`config.json` is read (no weights). The data and retriever blocks do not change any program and
are not read. Exit status 1 when the run does not fit (with `--search`: after printing the largest
`run.prompts_per_step` and `run.rollout_slots` that fit, found by compiling), 2 on a bad flag.
"""

import sys

from absl import app, flags

from treegrpo_jax.aot import targets

_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "TPU topology, e.g. v5e:2x4, v6e:2x4, v5p:2x2x1.", required=True
)
_NUM_SLICES = flags.DEFINE_integer("num_slices", 1, "Slices of that topology (multi-slice over DCN).")
_JSON = flags.DEFINE_string("json", "", "Write the report here as JSON.")
_SEARCH = flags.DEFINE_bool(
    "search", False, "When it does not fit: halve prompts_per_step / rollout_slots until each phase fits."
)
_PROGRAMS = flags.DEFINE_string(
    "programs", "", "Only programs whose name starts with one of these (comma-separated)."
)


def main(argv):
    del argv
    from treegrpo_jax.aot import compile_run  # noqa: PLC0415  (after the compile-only environment)

    try:
        chip = targets.parse_topology(_TOPOLOGY.value)
    except targets.TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    code = compile_run.main(
        compile_run.config_dict_from_flags(),
        topology=_TOPOLOGY.value,
        chip=chip,
        num_slices=_NUM_SLICES.value,
        json_path=_JSON.value,
        search=_SEARCH.value,
        only=tuple(p for p in _PROGRAMS.value.split(",") if p),
    )
    sys.exit(code)


def run() -> None:
    """`treegrpo-compile` (and `python launch/compile.py`)."""
    try:
        targets.prepare_process()  # before JAX starts a backend: CPU here, libtpu to compile with
    except targets.TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from treegrpo_jax.train import cli  # noqa: PLC0415

    cli.define_config_flag()
    app.run(main, flags_parser=cli.parse_flags)
