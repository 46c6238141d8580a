"""The training reward is a part of the environment: by name, or a user's callable, end to end."""

import numpy as np
import pytest

from tests.train import custom_reward
from tests.train.toy import toy_config_dict
from treegrpo_jax.env.reward_fn import EMFormatReward, F1Reward, RewardConfig, make_reward
from treegrpo_jax.env.rewards import score_trajectory
from treegrpo_jax.train.config import from_config_dict
from treegrpo_jax.train.loop import train_and_evaluate
from treegrpo_jax.train.metrics import read_metrics

STEPS = ["<think> x </think>\n<search> Paris </search>", "<think> so </think>\n<answer> the Paris </answer>"]


def test_named_rewards():
    assert make_reward() == EMFormatReward()
    assert (
        make_reward(RewardConfig(kind="em_format"))(STEPS, ["paris"])
        == score_trajectory(STEPS, ["paris"]).reward
        == 1.0
    )
    assert make_reward(RewardConfig(kind="f1"))(STEPS, ["Paris France"]) == pytest.approx(2 / 3)  # p=1, r=1/2
    assert isinstance(make_reward(RewardConfig(kind="f1")), F1Reward)


def test_bad_reward_configs_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"allowed: \['em_format', 'f1', 'callable'\]"):
        RewardConfig(kind="bleu")
    with pytest.raises(ValueError, match="'package.module:function'"):
        RewardConfig(kind="callable", fn="tests.train.custom_reward")
    with pytest.raises(ValueError, match="cannot be loaded"):
        RewardConfig(kind="callable", fn="tests.train.custom_reward:missing")
    bad = make_reward(RewardConfig(kind="callable", fn="tests.train.custom_reward:not_a_float"))
    with pytest.raises(ValueError, match="returned 'high'.*finite float"):
        bad(STEPS, ["paris"])


def test_a_custom_reward_trains_end_to_end_without_touching_rollout_code(tmp_path):
    """`reward.kind=callable` through `train_and_evaluate`: every leaf is scored by the user's
    function (training metrics are its values), while evaluation stays EM."""
    c = toy_config_dict(steps=1)
    c.reward.update(kind="callable", fn="tests.train.custom_reward:odd_steps")
    cfg = from_config_dict(c)
    custom_reward.CALLS.clear()
    train_and_evaluate(cfg, str(tmp_path))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    (train,) = [r for r in rows if "train/reward_mean" in r]
    n_eval, n_train = cfg.data.eval_prompts, cfg.run.prompts_per_step * cfg.tree.leaves_per_prompt
    # Leaves are scored in order: the step-0 evaluation, the RL step's rollout, the final evaluation.
    assert len(custom_reward.CALLS) == 2 * n_eval + n_train
    train_values = custom_reward.CALLS[n_eval : n_eval + n_train]
    assert set(train_values) <= {0.0, 1.0}
    np.testing.assert_allclose(train["train/reward_mean"], np.mean(train_values), rtol=1e-6)
    assert all("eval/em" in r for r in rows if "eval/reward_mean" in r)
