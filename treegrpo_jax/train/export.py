"""Export a saved policy as an HF checkpoint; the run's model config and tokenizer on disk.

A run directory holds what an export needs besides the checkpoint itself:

* `WORKDIR/model_config.json`: the resolved `ModelConfig`, written by the trainer with
  `save_model_config`. It is `dataclasses.asdict(cfg)` as JSON, which round-trips every field
  exactly (compute dtype and RoPE scaling included), unlike the HF config.json mapping,
  which has no compute dtype. (Not `config.json`: that name would make the workdir look like
  an HF checkpoint directory, and is the usual name of the run's full config dump.)
* `WORKDIR/tokenizer/`: an HF tokenizer directory (optional), e.g. the one
  `train_bpe_tokenizer(out_dir=...)` writes, or the pretrained model's tokenizer.

`export_hf` reads only the `params` item of a checkpoint (no optimizer state), builds the
decoder in the requested shardings and writes it with `save_hf`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import TYPE_CHECKING

import jax
from flax import nnx

from treegrpo_jax.model.build import abstract_model, param_shardings
from treegrpo_jax.model.config import ModelConfig, RopeScaling
from treegrpo_jax.model.weights_hf import save_hf
from treegrpo_jax.parallel.rules import DEFAULT_RULES, Rules
from treegrpo_jax.train.checkpoint import CheckpointConfig, Checkpointer

if TYPE_CHECKING:  # the tokenizer module imports transformers (and torch): seconds, only when needed
    from treegrpo_jax.model.tokenizer import Tokenizer

__all__ = [
    "MODEL_CONFIG_FILE",
    "TOKENIZER_DIR",
    "export_from_workdir",
    "export_hf",
    "load_model_config",
    "load_tokenizer",
    "save_model_config",
]

MODEL_CONFIG_FILE = "model_config.json"
TOKENIZER_DIR = "tokenizer"


def save_model_config(workdir: str | pathlib.Path, cfg: ModelConfig) -> pathlib.Path:
    """Writes `cfg` to `WORKDIR/model_config.json` (primary process only; atomic replace).

    Args:
      workdir: the run directory (created if needed).
      cfg: the resolved model config of the run.

    Returns:
      The file's path.
    """
    path = pathlib.Path(workdir) / MODEL_CONFIG_FILE
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(cfg), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)  # a kill mid-write never leaves a truncated config behind
    return path


def load_model_config(workdir: str | pathlib.Path) -> ModelConfig:
    """Reads the `ModelConfig` that `save_model_config` wrote.

    Raises:
      FileNotFoundError: the workdir has no model_config.json.
      ValueError: the file does not describe a ModelConfig (one line naming the problem).
    """
    path = pathlib.Path(workdir) / MODEL_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {workdir} a training run's workdir?")
    fields = json.loads(path.read_text())
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    required = {f.name for f in dataclasses.fields(ModelConfig) if f.default is dataclasses.MISSING}
    required -= {"rope_scaling"}  # has a default factory
    unknown, missing = sorted(set(fields) - known), sorted(required - set(fields))
    if unknown or missing:
        raise ValueError(
            f"{path}: not a ModelConfig of this version: unknown fields {unknown}, missing fields {missing}"
        )
    try:
        fields["rope_scaling"] = RopeScaling(**fields.get("rope_scaling", {}))
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:  # a field of the wrong type or value
        raise ValueError(f"{path}: {e}") from None


def load_tokenizer(workdir: str | pathlib.Path) -> Tokenizer | None:
    """The tokenizer saved under `WORKDIR/tokenizer/`, or None when there is none."""
    directory = pathlib.Path(workdir) / TOKENIZER_DIR
    if not directory.is_dir():
        return None
    from treegrpo_jax.model.tokenizer import Tokenizer

    return Tokenizer.from_hf_dir(directory)


def restore_model(
    workdir: str | pathlib.Path,
    model_cfg: ModelConfig,
    step: int | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
):
    """The policy of checkpoint `step` (None: the latest) of the run in `workdir`.

    Returns:
      (Decoder, the restored step). Parameters are restored straight into their shardings
      on `mesh` (None: one device).
    """
    graphdef, abstract = abstract_model(model_cfg)
    shardings = param_shardings(abstract, mesh, rules)
    # Variables kept as leaves: the shardings tree has one sharding where `abstract` has a Param.
    abstract = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        abstract,
        shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    # Synchronous: an export only reads, and must not leave background threads behind.
    ckpt = Checkpointer(workdir, CheckpointConfig(keep=None, async_save=False))
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
        params = ckpt.restore_params(step, abstract_params=abstract)
    finally:
        ckpt.close()
    return nnx.merge(graphdef, params), step


def export_hf(
    workdir: str | pathlib.Path,
    step: int | None,
    out_dir: str | pathlib.Path,
    model_cfg: ModelConfig,
    tokenizer: Tokenizer | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
) -> int:
    """Writes checkpoint `step` of the run in `workdir` as an HF checkpoint directory.

    Args:
      workdir: the run directory (checkpoints under `WORKDIR/checkpoints`).
      step: the checkpoint step; None for the latest.
      out_dir: the HF directory to write (config.json, safetensors, generation_config.json,
        and the tokenizer's files when `tokenizer` is given).
      model_cfg: the run's model config (see `load_model_config`).
      tokenizer: saved alongside when given.
      mesh: where to restore the parameters (None: one device; multi-host runs pass their
        mesh, and every process must call this).
      rules: logical-axis rules of the parameters.

    Returns:
      The exported step.
    """
    model, step = restore_model(workdir, model_cfg, step, mesh=mesh, rules=rules)
    save_hf(model, model_cfg, out_dir)
    if tokenizer is not None and jax.process_index() == 0:
        tokenizer.backend.save_pretrained(str(out_dir))
    logging.info("export: wrote step %d of %s to %s", step, workdir, out_dir)
    return step


def export_from_workdir(
    workdir: str | pathlib.Path, out_dir: str | pathlib.Path, step: int | None = None
) -> int:
    """`export_hf` with the model config and tokenizer the run saved in `workdir` (the CLI).

    Returns:
      The exported step.
    """
    return export_hf(workdir, step, out_dir, load_model_config(workdir), load_tokenizer(workdir))
