"""benchmarks/tunix_peer.py at toy sizes: our weights through Tunix' GRPO learner and back."""

import importlib.util
import json
import pathlib
import sys

import pytest

from tests.train.toy import multihop, toy_config_dict
from treegrpo_jax.rl.train_state import create_train_state
from treegrpo_jax.train import setup
from treegrpo_jax.train.checkpoint import Checkpointer
from treegrpo_jax.train.config import from_config_dict
from treegrpo_jax.train.export import save_model_config

pytest.importorskip("tunix")

_ROOT = pathlib.Path(__file__).parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _ROOT / f"benchmarks/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and the peer's `import budget_sweep` look it up there
    spec.loader.exec_module(module)
    return module


sweep = _load("budget_sweep")
peer = _load("tunix_peer")


def _toy(variant):
    """The toy `:tiny` config with the variant's chain shape; no KL (the sweep's `:tiny` has none)."""
    c = toy_config_dict()
    c.tree = multihop.get_config(f"tiny,{variant}").tree
    c.rl.kl_coef = 0.0
    return c


def _cold_start(workdir: pathlib.Path) -> pathlib.Path:
    """A cold-start workdir laid out like the sweep's, with an untrained toy model (no SFT, no eval)."""
    cfg = from_config_dict(_toy(""))
    data = setup.load_data(cfg, str(workdir))  # writes world/
    retriever = setup.make_retriever(cfg, data)
    tokenizer = setup.make_tokenizer(cfg, data, retriever, str(workdir))  # writes tokenizer/
    model, model_cfg, _ = setup.make_model(cfg, tokenizer, None)
    save_model_config(workdir, model_cfg)
    state, _ = create_train_state(model, cfg.optim, mesh=None)
    ckpt = Checkpointer(workdir)
    ckpt.save(0, state, {}, force=True)
    ckpt.wait()
    ckpt.close()
    (workdir / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/em": 0.0}) + "\n")
    return workdir


@pytest.mark.slow
def test_trains_with_tunix_and_evaluates_with_ours(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "budget_sweep", sweep)  # the module the peer imports at run time
    monkeypatch.setattr(sweep, "base_config", _toy)
    cold = _cold_start(tmp_path / "cold_start")
    out = tmp_path / "out"
    args = ["--steps=1", "--prompts_per_step=2", "--group=2", "--eval_prompts=4", "--max_concurrency=4"]
    peer.main([f"--cold_start={cold}", f"--out={out}", *args])
    r = json.loads((out / "result.json").read_text())
    assert r["parity_max_abs_logit_diff"] < 1e-4  # Tunix' Qwen2 computes our function
    assert r["steps"] == 1 and r["optimizer_updates"] == 1  # toy: one mini-batch per step
    assert 0.0 <= r["em"] <= 1.0 and set(r["em_by_hops"]) == {"1", "2", "3", "4"}
    assert r["em_cold_start"] == 0.0 and r["wall_s"] > 0 and len(r["reward_curve"]) == 1
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    # Every episode ends through our environment (an answer or the forced step), 2 prompts × 2.
    assert sorted(e["group"] for e in episodes) == [0, 0, 1, 1]
    assert all(1 <= len(e["steps"]) <= 6 and all(len(s) > 0 for s in e["steps"]) for e in episodes)
