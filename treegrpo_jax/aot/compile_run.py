"""`treegrpo-compile`: a config's run compiled for a TPU topology; the report, its JSON, the search.

The config is read as `treegrpo-train` reads it, with two differences that change no program:
the data and retriever blocks are left at their defaults (no files, no server), and
`model.path` names a model *shape* (`model/sizes.py`, or an HF directory's `config.json`) rather
than weights. `model.dtype=auto` is bf16, as on any TPU.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import numpy as np
from absl import flags
from ml_collections import ConfigDict

from treegrpo_jax.aot import targets
from treegrpo_jax.aot.programs import kv_bytes_per_token, rollout_slots, rows_per_micro, run_programs
from treegrpo_jax.aot.report import ProgramReport, compile_program, phases, predicted_step_s, table
from treegrpo_jax.aot.targets import Chip, GiB
from treegrpo_jax.model.build import abstract_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.sizes import model_shape
from treegrpo_jax.parallel.mesh import make_mesh
from treegrpo_jax.rl.train_state import abstract_train_state
from treegrpo_jax.train.config import ModelSource, TrainConfig, from_config_dict
from treegrpo_jax.train.config_dict import default_config_dict


def config_dict_from_flags() -> ConfigDict:
    config = flags.FLAGS.config
    if config is None:
        print("error: --config=FILE[:variants] is required", file=sys.stderr)
        sys.exit(2)
    return config


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s (its largest shard each)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def abstract_opt_state(cfg: TrainConfig, model_cfg: ModelConfig, mesh):
    graphdef, params = abstract_model(model_cfg)
    state, _ = abstract_train_state(graphdef, params, cfg.optim, mesh=mesh)
    return state.opt_state


def target_config(config: ConfigDict) -> tuple[TrainConfig, ModelConfig]:
    """(TrainConfig, the model's shape) for a compile; one-line `ValueError`s for bad values."""
    c = ConfigDict(config.to_dict())
    defaults = default_config_dict()
    c.data, c.retriever = defaults.data, defaults.retriever  # no program depends on them
    c.data.eval_prompts = config.data.eval_prompts
    spec = c.model.path
    if c.model.source == ModelSource.PRETRAINED:
        c.model.path = "smollm2"  # a name the config accepts without a file; the shape comes from `spec`
    cfg = from_config_dict(c)
    dtype = "bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype
    common = dict(
        dtype=dtype,
        param_dtype=cfg.model.param_dtype,
        remat=cfg.model.remat,
        attention_chunk=cfg.model.attention_chunk,
    )
    if cfg.model.source == ModelSource.PRETRAINED:
        if not spec:
            raise ValueError("config.model.path is empty: name a size (e.g. qwen2.5-3b) or an HF directory")
        model_cfg = model_shape(spec, **common)
    else:  # a scratch model: the trained BPE has exactly `tokenizer_vocab` ids
        model_cfg = ModelConfig(vocab_size=cfg.model.tokenizer_vocab, **dict(cfg.model.dims), **common)
    return cfg, model_cfg


def compile_all(cfg: TrainConfig, model_cfg: ModelConfig, devices: list, chip: Chip, only=()) -> dict:
    """Every program compiled; the phases; the predicted step (a JSON-ready dict)."""
    mesh = make_mesh(cfg.mesh, devices)
    reports: list[ProgramReport] = []
    for p in run_programs(cfg, model_cfg, mesh):
        if only and not p.name.startswith(only):
            continue
        r = compile_program(p, chip, len(devices))
        reports.append(r)
        status = "ok" if r.compiled else r.error[:120]
        print(
            f"  {r.name:<16} {r.live_bytes / GiB:7.2f} GiB live  {r.compile_s:5.1f} s  {status}", flush=True
        )
    slots = rollout_slots(cfg)
    kv_dtype = "float32" if cfg.model.kv_dtype == "float32" else "bfloat16"
    cache_bytes = slots * cfg.run.context_len * kv_bytes_per_token(model_cfg, kv_dtype)  # replicated
    opt_bytes = per_device_bytes(abstract_opt_state(cfg, model_cfg, mesh))  # Adam's moments as sharded
    ph = phases(reports, chip, opt_bytes=opt_bytes)
    return {
        "mesh": dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)),
        "model": {"num_params": model_cfg.num_params, **dataclasses.asdict(model_cfg)},
        "rollout_slots": slots,
        "context_len": cfg.run.context_len,
        "prompts_per_step": cfg.run.prompts_per_step,
        "kv_pool_bytes": cache_bytes,
        "programs": [dataclasses.asdict(r) | {"live_bytes": r.live_bytes} for r in reports],
        "phases": [dataclasses.asdict(p) for p in ph],
        "fits": all(p.fits for p in ph),
        "predicted_step_s": predicted_step_s(reports),
        "_table": table(reports, ph, chip),
    }


def _largest_fitting(cfg: TrainConfig, model_cfg, devices, chip, field: str, phase: str, only=()) -> int:
    """Halves `run.<field>` from the config's value until `phase` fits, down to the least the config
    allows (rollout slots: one prompt's leaves); 0 when nothing fits."""
    value = getattr(cfg.run, field) or rollout_slots(cfg)
    floor = cfg.tree.leaves_per_prompt if field == "rollout_slots" else 1
    mine = {"update": ("rl_step",), "rollout": ("decode", "append", "fork")}[phase]
    only = tuple(o for o in only if o.startswith(mine)) or mine  # the programs asked for, of that phase
    rows = None
    while value >= floor:
        try:
            run = dataclasses.replace(cfg.run, **{field: value})
            if field == "prompts_per_step" and run.rollout_slots == 0:
                run = dataclasses.replace(run, rollout_slots=rollout_slots(cfg))
            trial = dataclasses.replace(cfg, run=run)
        except ValueError as e:  # the config's own checks (e.g. prompts per mini-batch)
            print(f"search: stops before run.{field}={value}: {e}")
            return 0
        if field == "prompts_per_step":  # fewer prompts help only while they mean fewer rows
            if rows_per_micro(trial) == rows:
                print(f"search: {rows} rows per micro-batch is the least `rl.row_multiple` allows")
                return 0
            rows = rows_per_micro(trial)
        print(f"search: run.{field}={value}", flush=True)
        result = compile_all(trial, model_cfg, devices, chip, only=only)
        if all(p["fits"] for p in result["phases"] if p["phase"] == phase):
            return value
        value = floor if value // 2 < floor < value else value // 2
    return 0


def main(
    config: ConfigDict, *, topology: str, chip: Chip, num_slices: int, json_path: str, search: bool, only
) -> int:
    try:
        cfg, model_cfg = target_config(config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    devices = targets.topology_devices(topology, num_slices)
    try:
        cfg.check_devices(len(devices), 1)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{topology} × {num_slices}: {len(devices)} devices on {targets.hosts(devices)} host(s); "
        f"{chip.describe()}\n"
        f"model {model_cfg.num_params / 1e9:.2f}B params ({model_cfg.param_dtype} weights, {model_cfg.dtype} "
        f"compute, remat={model_cfg.remat.value}); {cfg.run.prompts_per_step} prompts × "
        f"{cfg.tree.leaves_per_prompt} leaves per step, layout {cfg.layout.kind.value}",
        flush=True,
    )
    result = compile_all(cfg, model_cfg, devices, chip, only=only)
    result.update(
        topology=topology, num_slices=num_slices, hosts=targets.hosts(devices), chip=dataclasses.asdict(chip)
    )
    print(result.pop("_table"))
    print(f"predicted RL step (roofline bound): {result['predicted_step_s']:.2f} s")
    if not result["fits"] and search:
        found, trial = {}, cfg
        failed = {p["phase"] for p in result["phases"] if not p["fits"]}
        for field, phase in (("rollout_slots", "rollout"), ("prompts_per_step", "update")):
            if phase in failed or field == "prompts_per_step" and found:
                found[field] = _largest_fitting(trial, model_cfg, devices, chip, field, phase, only)
                print(f"largest run.{field} whose {phase} fits: {found[field]}")
                if found[field]:
                    trial = dataclasses.replace(
                        trial, run=dataclasses.replace(trial.run, **{field: found[field]})
                    )
        if all(found.values()):  # the two together, compiled once more: the plan that fits
            run = dataclasses.replace(cfg.run, **({"rollout_slots": rollout_slots(cfg)} | found))
            print(f"the run with {found}:", flush=True)
            plan = compile_all(dataclasses.replace(cfg, run=run), model_cfg, devices, chip, only=only)
            print(plan.pop("_table"))
            print(f"predicted RL step (roofline bound): {plan['predicted_step_s']:.2f} s")
            found["plan"] = plan
        result["largest_fitting"] = found
    if json_path:
        result.pop("_table", None)
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, default=str)
    plan = result.get("largest_fitting", {}).get("plan")
    if result["fits"]:
        print("fits")
    elif plan and plan["fits"]:
        found = {k: v for k, v in result["largest_fitting"].items() if k != "plan"}
        print(f"DOES NOT FIT as configured; fits with {found}")
    else:
        print("DOES NOT FIT (see the phases above)")
    return 0 if result["fits"] else 1
