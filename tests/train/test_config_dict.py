"""The ConfigDict boundary: every dataclass field is a `--config.<key>=` override, a config round
trips exactly (also through WORKDIR/config.json), a missing key gets one line with the nearest
keys, and a resume with a changed config is refused unless allowed."""

import dataclasses
import enum
import json
import os
import subprocess
import sys

import pytest

from treegrpo_jax.rl.batch import BatchLayout
from treegrpo_jax.train import cli
from treegrpo_jax.train.config import from_config_dict
from treegrpo_jax.train.config_dict import (
    _DERIVED,
    CONFIG_FILE,
    ConfigChangedError,
    _blocks,
    check_run_config,
    config_changes,
    default_config_dict,
    flat_keys,
    load_run_config,
    nearest_keys,
    save_run_config,
    to_config_dict,
)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MULTIHOP = os.path.join(_ROOT, "configs", "multihop.py")
_TINY = f"--config={_MULTIHOP}:tiny"

# Fields whose next value of their type is invalid (strings that are not enums, ints with a
# divisibility or power-of-two rule): a changed value the field accepts.
_TEXT = {
    "rl.num_minibatches": "4",
    "run.prompts_per_step": "16",
    "run.rollout_slots": "12",
    "run.context_len": "512",
    "rollout.quantum": "64",
    "kv_cache.page_size": "32",
    "kv_cache.layout": "paged",
    "model.dtype": "bfloat16",
    "model.param_dtype": "bfloat16",
    "model.kv_dtype": "bfloat16",
    "model.kernels": "xla",
    "model.remat": "layer",
    "tree.rule": "entropy",
    "template": "search_agent",
}
# Overrides whose changed value is invalid on `:tiny` alone: the error must name the key's block.
_REJECTED = {
    "data.kind",  # files: needs data.train_files
    "model.source",  # pretrained needs model.path
    "retriever.corpus",  # no such file
    "retriever.kind",  # http needs retriever.url
    "reward.fn",  # module:function that does not exist
    "run.coordinator_address",  # needs run.distributed
    "run.num_processes",
    "run.process_id",
}


def _typed_fields(classes, prefix):
    """key → (field, default) for every chosen (non-derived) field, nested dataclasses walked."""
    out = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.name in _DERIVED.get(prefix, ()):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            key = f"{prefix}.{f.name}"
            if dataclasses.is_dataclass(default):
                out.update(_typed_fields((type(default),), key))
            else:
                out[key] = default
    return out


def _every_field():
    fields = {}
    for block, classes in _blocks().items():
        fields.update(_typed_fields(classes, block))
    fields["rl.layout"] = BatchLayout().kind  # BatchLayout.kind is spelled rl.layout
    return fields


def _changed(key, default, current):
    """A value that differs from `current` (the `:tiny` value) of the field's type, as CLI text."""
    if key in _TEXT:
        return _TEXT[key]
    if isinstance(default, enum.Enum):
        return next(m.value for m in type(default) if m.value != current)
    if isinstance(current, bool):
        return str(not current)
    if isinstance(current, int):
        return str(current + 1)
    if isinstance(current, float):
        return repr(current * 0.5 + 0.07)
    if isinstance(current, list):
        if key == "mesh.shape":
            return "(1, -1, 1)"
        return repr(tuple(current) + (2 * current[-1],))  # stays increasing (length buckets)
    if key in ("data.train_files", "data.test_files", "retriever.corpus", "model.path"):
        return "/nonexistent/file.jsonl"
    if key == "reward.fn":
        return "no_such_module:score"
    if key == "retriever.url":
        return "http://127.0.0.1:1/retrieve"
    if key == "run.coordinator_address":
        return "127.0.0.1:1234"
    if key == "run.profile_steps":
        return "2:3"
    if key == "run.compile_cache_dir":
        return "/tmp/treegrpo_jit_cache"
    return f"{current} (edited)"  # free text (observation messages, wandb project)


def _json(d):
    return json.loads(json.dumps(d))  # tuples as lists, as in config.json


def test_every_dataclass_field_is_a_key_of_every_config():
    fields = set(_every_field())
    assert len(fields) > 100
    assert fields == set(flat_keys(default_config_dict().to_dict())) - {"template"}
    tiny = set(flat_keys(cli.config_from_argv(["prog", _TINY]).to_dict()))
    assert fields - tiny == set(), "fields a config file cannot set"
    assert tiny - fields == {"template"}, "config keys that no field reads"


def test_every_field_is_overridable_from_the_command_line():
    tiny = flat_keys(_json(to_config_dict(from_config_dict(cli.config_from_argv(["prog", _TINY]))).to_dict()))
    landed, rejected = set(), {}
    for key, default in _every_field().items():
        if key == "model.dims":
            continue  # a dict: its own test below
        text = _changed(key, default, tiny[key])
        config = cli.config_from_argv(["prog", _TINY, f"--config.{key}={text}"])
        try:
            cfg = from_config_dict(config)
        except ValueError as e:
            rejected[key] = str(e)
            continue
        got = flat_keys(_json(to_config_dict(cfg).to_dict()))[key]
        want = flat_keys(_json(config.to_dict()))[key]
        assert got == want and got != tiny[key], (key, got, want, tiny[key])
        landed.add(key)
    assert set(rejected) == _REJECTED, {k: rejected.get(k) for k in set(rejected) ^ _REJECTED}
    for key, message in rejected.items():
        block = key.split(".")[0]
        assert message.startswith(f"config.{block}") and "\n" not in message, (key, message)
    assert len(landed) >= 95


def test_model_dims_entries_are_overridable():
    config = cli.config_from_argv(
        ["prog", _TINY, "--config.model.dims.embed_dim=64", "--config.model.dims.num_layers=2"]
    )
    dims = dict(from_config_dict(config).model.dims)
    assert dims["embed_dim"] == 64 and dims["num_layers"] == 2


def test_config_files_state_only_what_differs_from_the_dataclasses():
    paper = flat_keys(cli.config_from_argv(["prog", f"--config={_MULTIHOP}"]).to_dict())
    defaults = flat_keys(default_config_dict().to_dict())
    assert set(paper) == set(defaults)
    differ = {k for k in paper if paper[k] != defaults[k]}
    # The paper's choices (DESIGN.md §1): its data, 4 turns, 8 mini-batches of 8 micro-batches, buckets.
    assert differ == {
        "data.kind",
        "data.eval_prompts",
        "retriever.kind",
        "retriever.timeout_s",
        "agent.max_turns",
        "rl.num_minibatches",
        "rl.num_microbatches",
        "rl.length_buckets",
    }, differ


_VARIANTS = [
    "tiny",
    "tiny,chain",
    "tiny,hard,rule=entropy",
    "tiny,hard,verdict,rule=last",
    "smollm2,cpu",
    "smollm2,cpu,chain,tree_m=6",
    "smollm2,smoke",
]


@pytest.mark.parametrize("variant", _VARIANTS)
def test_round_trip_is_exact_also_through_config_json(variant, tmp_path):
    cfg = from_config_dict(cli.config_from_argv(["prog", f"--config={_MULTIHOP}:{variant}"]))
    assert from_config_dict(to_config_dict(cfg)) == cfg
    save_run_config(str(tmp_path), cfg)
    assert from_config_dict(load_run_config(str(tmp_path))) == cfg
    assert cli.train_config(None, str(tmp_path)) == cfg  # launch/eval.py --workdir=W alone


def test_nearest_keys():
    config = default_config_dict()
    assert nearest_keys("optim.b3", config)[:2] == ["optim.b2", "optim.b1"]
    assert nearest_keys("rl.kl_coeff", config)[0] == "rl.kl_coef"
    assert all(k.startswith("tree.") for k in nearest_keys("tree.zzzzzz", config))
    assert "optim" in nearest_keys("zzz.qqq", config)  # nothing close: the blocks


def _train(*args, cwd=_ROOT):
    return subprocess.run(
        [sys.executable, os.path.join(_ROOT, "launch", "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_launch_train_names_a_missing_key_and_the_nearest_ones_in_one_line(tmp_path):
    r = _train(_TINY, f"--workdir={tmp_path}", "--config.optim.b3=0.9")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    want = "error: --config.optim.b3: the config has no such key (nearest: optim.b2, optim.b1, optim.eps)"
    assert lines == [want]
    assert not os.listdir(tmp_path), "nothing written for a command that was refused"


def test_launch_train_without_config_or_run_config_says_so(tmp_path):
    r = _train(f"--workdir={tmp_path}")
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: no --config given and no {tmp_path}/{CONFIG_FILE} to read it from"


def test_launch_train_bad_value_is_one_line(tmp_path):
    r = _train(_TINY, f"--workdir={tmp_path}", "--config.optim.schedule=linear")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: config.optim") and "schedule" in line and "cosine" in line


def _tiny_cfg(*overrides):
    return from_config_dict(cli.config_from_argv(["prog", _TINY, *(f"--config.{o}" for o in overrides)]))


def test_a_resume_with_a_changed_config_is_refused_and_names_the_keys(tmp_path):
    wd = str(tmp_path)
    cfg = _tiny_cfg()
    assert check_run_config(wd, cfg, resuming=False) == []
    assert from_config_dict(load_run_config(wd)) == cfg
    assert check_run_config(wd, cfg, resuming=True) == []  # the same config resumes
    changed = _tiny_cfg("optim.b2=0.95", "tree.num_picks=3")
    with pytest.raises(ConfigChangedError) as e:
        check_run_config(wd, changed, resuming=True)
    message = str(e.value)
    assert "optim.b2: 0.999 → 0.95" in message and "tree.num_picks: 2 → 3" in message
    assert "allow_config_change" in message and "\n" not in message
    assert from_config_dict(load_run_config(wd)) == cfg, "a refused resume keeps the run's config"
    allowed = _tiny_cfg("optim.b2=0.95", "tree.num_picks=3", "run.allow_config_change=True")
    changes = check_run_config(wd, allowed, resuming=True)
    assert len(changes) == 2 and changes[0].startswith("optim.b2")
    assert from_config_dict(load_run_config(wd)) == allowed, "the resumed run's config is the new one"


def test_a_workdir_without_checkpoints_takes_a_new_config(tmp_path):
    wd = str(tmp_path)
    check_run_config(wd, _tiny_cfg(), resuming=False)
    new = _tiny_cfg("optim.b2=0.95")
    assert check_run_config(wd, new, resuming=False) == []
    assert from_config_dict(load_run_config(wd)) == new


def test_a_process_id_is_not_a_change():
    # process_id differs between the processes of one run (and from run to run of a pod): never a change
    a = _json(to_config_dict(_tiny_cfg()).to_dict())
    b = _json(a)
    b["run"]["process_id"] = 3
    assert config_changes(a, b) == []
    b["run"]["seed"] = 1
    assert config_changes(a, b) == ["run.seed: 0 → 1"]


def test_an_unreadable_run_config_is_a_clear_error(tmp_path):
    (tmp_path / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="is not a readable run config"):
        load_run_config(str(tmp_path))


def test_a_field_added_since_the_run_was_written_is_not_a_change():
    """A workdir written before a field existed resumes when the field is at its default; set
    anywhere else, the field is a change like any other."""
    old = _json(to_config_dict(_tiny_cfg()).to_dict())
    del old["rollout"]["retrieval_sync"]  # a run from before the field
    assert config_changes(old, to_config_dict(_tiny_cfg()).to_dict()) == []
    changed = to_config_dict(_tiny_cfg("rollout.retrieval_sync=0.0")).to_dict()
    assert config_changes(old, changed) == ["rollout.retrieval_sync: '(absent)' → 0.0"]
