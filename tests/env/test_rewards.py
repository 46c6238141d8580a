"""Rewards: every branch of the docs/DESIGN.md §1 table on hand-written trajectories, EM/F1, format check."""

import random

import pytest

from treegrpo_jax.env.rewards import (
    AnswerMetric,
    RewardTable,
    em,
    evaluation_reward,
    f1,
    final_answer,
    is_well_formed,
    normalize_answer,
    score_trajectory,
    split_trajectory,
    step_action_tag,
    training_reward,
)

GOLDS = ["Paris", "City of Paris"]
S1 = "<think>I need the capital of France.</think>\n<search>capital of France</search>"
S2 = "<think>The passage says Paris.</think>\n<answer>Paris</answer>"
WRONG = "<think>The passage says Lyon.</think>\n<answer>Lyon</answer>"

GOLDEN = [
    # (name, steps, reward)
    ("correct well-formed, one step", [S2], 1.0),
    ("correct well-formed, search then answer", [S1, S2], 1.0),
    (
        "correct well-formed, gold alias and normalisation",
        [S1, "<think>t</think><answer> the city of PARIS. </answer>"],
        1.0,
    ),
    ("correct malformed: no think", [S1, "<answer>Paris</answer>"], 0.8),
    ("correct malformed: empty think", [S1, "<think> </think><answer>Paris</answer>"], 0.8),
    ("correct malformed: upper-case tag", [S1, "<think>t</think><ANSWER>Paris</ANSWER>"], 0.8),
    ("correct malformed: text after answer", [S1, S2 + " because it is"], 0.8),
    ("correct malformed: text before think", [S1, "So " + S2], 0.8),
    ("correct malformed: invalid step in the middle", [S1, "<think>hmm</think> no action", S2], 0.8),
    ("correct malformed: think after action", [S1, "<answer>Paris</answer><think>t</think>"], 0.8),
    ("correct malformed: model wrote an observation", [S1, "<information>x</information>" + S2], 0.8),
    ("correct malformed: search step without think", ["<search>q</search>", S2], 0.8),
    ("correct malformed: nested think", [S1, "<think>a<think>b</think></think><answer>Paris</answer>"], 0.8),
    ("correct malformed: answer then more steps, last answer used", [WRONG, S1, S2], 0.8),
    ("wrong well-formed", [S1, WRONG], 0.2),
    ("wrong well-formed, one step", [WRONG], 0.2),
    ("wrong malformed", [S1, "<answer>Lyon</answer>"], 0.1),
    ("wrong malformed: empty answer", [S1, "<think>t</think><answer></answer>"], 0.1),
    ("wrong malformed: loose tag spelling", [S1, "<think>t</think>< answer >Lyon</ answer >"], 0.1),
    ("no answer: only searches", [S1, S1], 0.0),
    ("no answer: unclosed answer", [S1, "<think>t</think><answer>Paris"], 0.0),
    ("no answer: plain text", ["Paris"], 0.0),
    # First-tag rule: this step is a search (the engine would have stopped at </search>).
    (
        "no answer: search before answer in one step",
        ["<think>t</think><search>q</search><answer>Paris</answer>"],
        0.0,
    ),
    ("no answer: empty trajectory", [], 0.0),
    ("no answer: last step is a search after an answer-less path", [S1], 0.0),
]


@pytest.mark.parametrize("name, steps, reward", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_training_rewards(name, steps, reward):
    assert training_reward(steps, GOLDS) == reward


def test_breakdown_explains_reward():
    b = score_trajectory([S1, WRONG], GOLDS)
    assert (b.answer, b.correct, b.well_formed, b.reward) == ("Lyon", False, True, 0.2)
    b = score_trajectory([S1], GOLDS)
    assert (b.answer, b.correct, b.reward) == (None, False, 0.0)


def test_whole_text_form_matches_step_list():
    obs = "\n\n<information>Doc 1 (Title: Paris) Paris is the capital.</information>\n\n"
    text = S1 + obs + S2
    assert split_trajectory(text) == [S1, S2]
    assert training_reward(text, GOLDS) == 1.0
    assert training_reward(S1 + obs + "<answer>Paris</answer>", GOLDS) == 0.8
    # An unclosed information block swallows the rest (it was never the model's text).
    assert split_trajectory(S1 + "<information> dangling") == [S1]


def test_custom_reward_table():
    table = RewardTable(correct_well_formed=2.0)
    assert score_trajectory([S2], GOLDS, table=table).reward == 2.0
    with pytest.raises(ValueError, match="wrong_malformed"):
        RewardTable(wrong_malformed=float("nan"))


def test_format_check():
    assert is_well_formed([S1, S2])
    assert not is_well_formed([S1])
    assert not is_well_formed([S2, S2])
    assert step_action_tag(S1) == "search"
    assert step_action_tag(S2) == "answer"
    assert step_action_tag("<think>a</think>") is None
    assert step_action_tag("<think>a</think><search>b</answer>") is None
    assert step_action_tag("x" * 100_000) is None


@pytest.mark.parametrize(
    "raw, norm",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  an   Apple\n", "apple"),
        ("U.S.A.", "usa"),
        ("Theatre of the Absurd", "theatre of absurd"),
        ("A", ""),
        ("rock-'n'-roll", "rocknroll"),
        ("Émile Zola", "émile zola"),
    ],
)
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_em():
    assert em("the eiffel tower", ["Eiffel Tower"]) == 1.0
    assert em("Eiffel", ["Eiffel Tower"]) == 0.0
    assert em("paris", "Paris") == 1.0  # A single gold string is accepted.
    assert em("x", []) == 0.0
    assert em("", ["The"]) == 0.0  # An empty prediction never matches.


def test_f1():
    assert f1("Paris France", ["Paris"]) == pytest.approx(2 / 3)
    assert f1("Paris", ["Lyon", "Paris"]) == 1.0
    assert f1("the", ["the"]) == 0.0
    assert f1("x b c", ["b c d"]) == pytest.approx(2 / 3)
    assert f1("x", []) == 0.0


def test_evaluation_reward_is_pure_em():
    # Format does not matter at evaluation.
    assert evaluation_reward([S1, "<answer>Paris</answer>"], GOLDS) == 1.0
    assert evaluation_reward([S1, WRONG], GOLDS) == 0.0
    assert evaluation_reward([S1], GOLDS) == 0.0
    assert evaluation_reward(
        ["<answer>Paris France</answer>"], GOLDS, metric=AnswerMetric.F1
    ) == pytest.approx(2 / 3)


def test_final_answer_uses_last_answer_step():
    assert final_answer([WRONG, S2]) == "Paris"
    assert final_answer([S1]) is None


def test_reward_fuzz_never_raises_and_stays_in_table():
    rng = random.Random(0)
    frags = [
        "<think>",
        "</think>",
        "<search>",
        "</search>",
        "<answer>",
        "</answer>",
        "Paris",
        "Lyon",
        " ",
        "\n",
    ]
    allowed = {1.0, 0.8, 0.2, 0.1, 0.0}
    for _ in range(3000):
        steps = [
            "".join(rng.choice(frags) for _ in range(rng.randint(0, 10))) for _ in range(rng.randint(0, 4))
        ]
        assert training_reward(steps, GOLDS) in allowed
        assert training_reward("\n".join(steps), GOLDS) in allowed
