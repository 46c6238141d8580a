"""The ConfigDict side of the config boundary: defaults from the dataclasses, and runs that describe
themselves.

* `default_config_dict()` — every field of every `TrainConfig` block, with the dataclasses' own
  defaults (one source of defaults: a config file states only what differs), so
  `--config.<block>.<field>=` works for every field;
* `to_config_dict(cfg)` — the inverse of `train.config.from_config_dict` (a round trip is exact);
* `save_run_config` / `load_run_config` — the resolved config as `WORKDIR/config.json`;
* `config_changes(old, new)` — the keys whose values differ between two configs.

Fields that are derived, not chosen, never appear: `optim.total_steps` (= `run.steps`),
`sft.optim.total_steps` (= `sft.steps`), `sft.script.top_k` / `max_tool_calls` (the agent's),
`rl.mode`, and `rl.kind` (spelled `rl.layout`).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import os
from typing import Any

from ml_collections import ConfigDict

CONFIG_FILE = "config.json"
# Keys a resumed run may change without `run.allow_config_change`: a process's own identity, and
# where the job's coordinator listens (a restarted job often gets another host or port).
_PER_PROCESS_KEYS = ("run.process_id", "run.coordinator_address", "run.allow_config_change")
# Dataclass fields that are comma-separated text in a config (so `--config.data.train_files=a,b`).
_TEXT_LISTS = ("data.train_files", "data.test_files")
_DERIVED = {
    "optim": ("total_steps",),
    "sft.optim": ("total_steps",),
    "sft.script": ("top_k", "max_tool_calls"),
    "rl": ("mode", "kind"),
}


class ConfigChangedError(ValueError):
    """A resume whose config differs from the one its checkpoints were trained with."""


def _blocks() -> dict[str, tuple[type, ...]]:
    """Config block → the dataclasses its keys fill (imported late: config.py imports this module)."""
    from treegrpo_jax.env.observation import ObservationConfig
    from treegrpo_jax.env.reward_fn import RewardConfig
    from treegrpo_jax.parallel.mesh import MeshConfig
    from treegrpo_jax.rl.batch import BatchLayout
    from treegrpo_jax.rl.loss import LossConfig
    from treegrpo_jax.rl.optim import OptimConfig
    from treegrpo_jax.rollout.agent import AgentConfig
    from treegrpo_jax.rollout.page_pool import KVCacheConfig
    from treegrpo_jax.rollout.scheduler import SchedulerConfig
    from treegrpo_jax.rollout.tree_search import TreeSearchConfig
    from treegrpo_jax.train import config

    return {
        "model": (config.ModelSpec,),
        "data": (config.DataSpec,),
        "retriever": (config.RetrieverSpec,),
        "agent": (AgentConfig,),
        "observation": (ObservationConfig,),
        "tree": (TreeSearchConfig,),
        "rl": (LossConfig, BatchLayout),
        "optim": (OptimConfig,),
        "sft": (config.SFTSpec,),
        "run": (config.RunSpec,),
        "mesh": (MeshConfig,),
        "rollout": (SchedulerConfig,),
        "kv_cache": (KVCacheConfig,),
        "reward": (RewardConfig,),
    }


# TrainConfig attribute of each block (the `rl` block is two of them).
_ATTRS = {"rl": ("loss", "layout")}


def _plain(value: Any, key: str) -> Any:
    """A dataclass value as a config value: enums by name, dims as a dict, file lists as text."""
    if isinstance(value, enum.Enum):
        return value.value
    if key in _TEXT_LISTS:
        return ",".join(value)
    if key == "model.dims":
        return dict(value)
    if dataclasses.is_dataclass(value):
        return _fields_dict((type(value),), key, lambda f: getattr(value, f.name))
    return value


def _fields_dict(classes: tuple[type, ...], key: str, value_of) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.name not in _DERIVED.get(key, ()):
                out[f.name] = _plain(value_of(f), f"{key}.{f.name}")
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # every block field has a default (a test walks them)


def default_config_dict() -> ConfigDict:
    """Every block and field of a TrainConfig at the dataclasses' defaults (plus `template`)."""
    c = {key: _fields_dict(classes, key, _default) for key, classes in _blocks().items()}
    c["rl"]["layout"] = _default(_field(_blocks()["rl"][1], "kind")).value  # BatchLayout.kind
    c["template"] = "search_agent"
    return ConfigDict(c)


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def to_config_dict(cfg) -> ConfigDict:
    """The ConfigDict that `from_config_dict` turns back into `cfg` (a `TrainConfig`)."""
    c: dict[str, Any] = {}
    for key, classes in _blocks().items():
        attrs = _ATTRS.get(key, (key,))
        c[key] = {}
        for cls, attr in zip(classes, attrs, strict=True):
            value = getattr(cfg, attr)
            c[key].update(_fields_dict((cls,), key, lambda f, v=value: getattr(v, f.name)))
    c["rl"]["layout"] = cfg.layout.kind.value
    c["template"] = cfg.template
    return ConfigDict(c)


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d))  # tuples → lists, as they come back from the file


def save_run_config(workdir: str, cfg) -> str:
    """Writes `cfg` (a TrainConfig) to WORKDIR/config.json atomically; returns the path."""
    path = os.path.join(workdir, CONFIG_FILE)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable(to_config_dict(cfg).to_dict()), f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_run_config(workdir: str) -> ConfigDict | None:
    """WORKDIR/config.json as a ConfigDict (None when the run never wrote one)."""
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return ConfigDict(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable run config: {e}") from None


def flat_keys(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": value} for every leaf of a nested dict (a dict-valued field such as
    `model.dims` counts as one leaf)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key != "model.dims":
            out.update(flat_keys(v, f"{key}."))
        else:
            out[key] = v
    return out


def config_changes(old: dict, new: dict) -> list[str]:
    """`key: old → new` for every key (but a process's own) whose value differs. A key the old
    config lacks and the new one holds at its default is a field added since the run was written
    (e.g. `rollout.retrieval_sync`): not a change, so an older workdir still resumes."""
    a, b = flat_keys(_jsonable(old)), flat_keys(_jsonable(new))
    defaults = flat_keys(_jsonable(default_config_dict().to_dict()))
    changes = []
    for key in sorted(set(a) | set(b)):
        if key in _PER_PROCESS_KEYS or a.get(key) == b.get(key):
            continue
        if key not in a and key in defaults and b[key] == defaults[key]:
            continue
        changes.append(f"{key}: {a.get(key, '(absent)')!r} → {b.get(key, '(absent)')!r}")
    return changes


def check_run_config(workdir: str, cfg, *, resuming: bool, write: bool = True) -> list[str]:
    """Compares `cfg` with WORKDIR/config.json when `resuming` (the workdir has checkpoints),
    then (if `write`) saves `cfg` there. Returns the changed keys; raises ConfigChangedError
    naming them unless `cfg.run.allow_config_change`. A workdir without checkpoints takes
    the new config silently (a run that failed before its first save is re-run freely)."""
    saved = load_run_config(workdir) if resuming else None
    changes = [] if saved is None else config_changes(saved.to_dict(), to_config_dict(cfg).to_dict())
    if changes and not cfg.run.allow_config_change:
        raise ConfigChangedError(
            f"{workdir} holds a run trained with another config; changed: {'; '.join(changes)}. "
            f"Resume with the same config (or omit --config to use {workdir}/{CONFIG_FILE}), "
            "or pass --config.run.allow_config_change=True"
        )
    if write:
        save_run_config(workdir, cfg)
    return changes


def nearest_keys(key: str, config: ConfigDict, n: int = 3) -> list[str]:
    """The `n` valid keys of `config` closest to `key` (for "no such key" errors)."""
    keys = list(flat_keys(config.to_dict()))
    block = key.split(".")[0]
    close = difflib.get_close_matches(key, keys, n=n, cutoff=0.5)
    in_block = [k for k in keys if k.startswith(f"{block}.")][:n]
    return close or in_block or sorted(config.keys())  # an unknown block: name the blocks
