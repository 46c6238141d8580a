"""The config boundary: every variant parses; bad keys and values name themselves."""

import importlib.util
import pathlib

import pytest

from treegrpo_jax.train.config import from_config_dict

_SPEC = importlib.util.spec_from_file_location(
    "multihop", pathlib.Path(__file__).parents[2] / "configs/multihop.py"
)
multihop = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(multihop)


@pytest.mark.parametrize(
    "arg",
    [
        "tiny",
        "tiny,chain",
        "tiny,tree_m=4,tree_n=5",
        "tiny,estimator=intra",
        "smollm2",
        "smollm2,smoke",
        "smollm2,cpu",
        "smollm2,cpu,chain",
    ],
)
def test_variants_parse(arg):
    cfg = from_config_dict(multihop.get_config(arg))
    shape = (cfg.tree.num_trees, cfg.tree.num_picks, cfg.tree.num_rounds)
    want = {
        "tiny,chain": (4, 0, 0),
        "tiny,tree_m=4,tree_n=5": (4, 5, 1),
        "smollm2,smoke": (2, 1, 1),
        "smollm2,cpu,chain": (4, 0, 0),
    }
    assert shape == want.get(arg, (2, 2, 1))
    estimator = "intra" if "estimator=intra" in arg else "grpo" if "chain" in arg else "tree"
    assert cfg.loss.estimator.value == estimator
    assert cfg.sft.script.top_k == cfg.agent.top_k  # demonstrations look like rollouts
    assert cfg.model.remat.value == ("layer" if "cpu" in arg else "none")  # a CPU backward must fit
    assert cfg == from_config_dict(multihop.get_config(arg))  # deterministic, frozen, comparable


def test_chain_variant_is_grpo_baseline():
    cfg = from_config_dict(multihop.get_config("tiny,chain"))
    assert (cfg.tree.num_trees, cfg.tree.num_picks, cfg.tree.num_rounds) == (4, 0, 0)
    assert cfg.tree.leaves_per_prompt == 4
    assert cfg.loss.estimator.value == "grpo"  # the group z-score; "tree" would add r/(1+1e-6) per chain
    assert from_config_dict(multihop.get_config("tiny,chain,estimator=tree")).loss.estimator.value == "tree"


def test_paper_config_needs_paths_with_a_clear_message():
    c = multihop.get_config()
    with pytest.raises(ValueError, match=r"config.model.path is empty: set --config.model.path="):
        from_config_dict(c)
    c.model.path = "smollm2"
    with pytest.raises(ValueError, match=r"config.data.train_files is empty"):
        from_config_dict(c)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.tree.update(num_trees=0), r"config.tree: TreeSearchConfig.num_trees \(M\) must be ≥ 1"),
        (lambda c: c.rl.update(estimator="best"), r"config.rl: .*estimator"),
        (lambda c: c.rl.update(aggregation="sum"), r"config.rl: .*aggregation"),
        (lambda c: c.agent.update(top_p=1.5), r"config.agent: AgentConfig"),
        (lambda c: c.mesh.update(shape=(-1, -1, 1)), r"config.mesh: mesh.shape"),
        (lambda c: c.run.update(prompts_per_step=7), r"prompts_per_step=7 must be divisible"),
        (lambda c: c.model.update(source="magic"), r"config.model.source='magic'; allowed"),
        (lambda c: c.model.update(remat="some"), r"config.model.remat='some'; allowed"),
        (lambda c: c.run.update(rollout_slots=3), r"rollout_slots=3 < leaves per prompt"),
        (lambda c: c.data.world.update(num_people=-1), r"config.data.world"),
    ],
)
def test_bad_values_name_the_key(edit, message):
    c = multihop.get_config("tiny")
    edit(c)
    with pytest.raises(ValueError, match=message):
        from_config_dict(c)


def test_unknown_key_is_rejected():
    c = multihop.get_config("tiny")
    c.unlock()
    c.agent.max_tool_call = 3  # typo
    with pytest.raises(ValueError, match=r"config.agent: unknown key\(s\) \['max_tool_call'\]"):
        from_config_dict(c)


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match="unknown variant 'tree_x=1'"):
        multihop.get_config("tiny,tree_x=1")


def test_singlehop_tiny_keeps_one_hop_questions():
    spec = importlib.util.spec_from_file_location(
        "singlehop", pathlib.Path(__file__).parents[2] / "configs/singlehop.py"
    )
    singlehop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(singlehop)
    cfg = from_config_dict(singlehop.get_config("tiny"))
    assert cfg.data.world.questions_per_hop == (1600, 0, 0, 0)
    assert cfg.sft.script.max_tool_calls == cfg.agent.max_tool_calls == 2


def test_rl_layout_key():
    assert from_config_dict(multihop.get_config("tiny")).layout.kind == "packed"  # the default: exact
    c = multihop.get_config("tiny")
    c.rl.layout = "paths"
    assert from_config_dict(c).layout.kind == "paths"
    c.rl.layout = "tree"
    with pytest.raises(ValueError, match=r"config.rl.layout='tree'; allowed: \['paths', 'packed'\]"):
        from_config_dict(c)


def test_smollm2_variants_use_the_offline_model_and_the_smoke_is_small():
    cfg = from_config_dict(multihop.get_config("smollm2,smoke"))
    assert (cfg.model.source, cfg.model.path, cfg.model.dtype) == ("pretrained", "smollm2", "auto")
    assert (cfg.sft.steps, cfg.run.steps, cfg.run.prompts_per_step, cfg.data.eval_prompts) == (1, 1, 2, 4)
    full = from_config_dict(multihop.get_config("smollm2"))
    assert full.sft.steps > 100 and full.run.steps >= 30 and full.run.context_len == 2048


def test_compute_dtype_auto_is_f32_on_cpu_and_bf16_on_cpu_says_what_it_costs(monkeypatch, caplog):
    from treegrpo_jax.train import setup

    assert setup.compute_dtype_for_backend("auto") == "float32"  # the suite runs on CPU
    assert setup.compute_dtype_for_backend("float32") == "float32" and not caplog.records
    for flags, says in ((["avx512_bf16"], "run natively"), ([], "without bf16 dot instructions")):
        monkeypatch.setattr(setup, "cpu_bf16_flags", lambda flags=flags: flags)
        caplog.clear()
        assert setup.compute_dtype_for_backend("bfloat16") == "bfloat16"  # honoured
        assert says in caplog.text and "model.dtype=auto" in caplog.text
