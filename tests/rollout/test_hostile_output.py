"""Hostile model output through the real rollout: classified, bounded, never a crash.

A bigram model (`treegrpo_jax.testing.bigram`) replays each case's token script greedily at
every step, so the engine's stop table and caps, the detokeniser, the parser, the retriever
and the observation budget all see it exactly as they would see a policy gone wrong.
"""

import pytest

from treegrpo_jax.rollout.agent import AgentConfig
from treegrpo_jax.testing.bigram import set_successors, successor_table
from treegrpo_jax.testing.hostile import CASES, HostileRig

MAX_STEP = 1024  # "thousands of tags": a step of 1024 atomic <search> tokens


@pytest.fixture(scope="module")
def rig():
    agent = AgentConfig(max_tool_calls=2, max_turns=3, max_step_tokens=MAX_STEP, top_k=2)
    return HostileRig(agent=agent, context_len=2048)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hostile_output_is_classified_and_bounded(rig, case):
    result = rig.check(case)
    assert result.crashed is None, result.crashed
    assert not result.problems, result.problems


def test_the_bigram_model_plays_its_script(rig):
    case = next(c for c in CASES if c.name == "thousands_of_tags")
    trees, _ = rig.run(case)
    steps = [n for t in trees for n in t.nodes[1:]]
    assert max(n.text.count("<search>") for n in steps) == MAX_STEP  # a thousand tags, then the cap
    case = next(c for c in CASES if c.name == "stop_string_split_into_bytes")
    trees, _ = rig.run(case)
    first = trees[0].nodes[1]
    assert first.text.endswith("</search>") and first.query and first.kind == "search"


def test_successor_table_rejects_scripts_a_bigram_cannot_play():
    assert successor_table([5, 6, 7], loop_last=True) == {5: 6, 6: 7, 7: 7}
    with pytest.raises(ValueError, match="two successors"):
        successor_table([5, 6, 5, 7])


def test_set_successors_rewires_the_head_in_place(rig):
    set_successors(rig.model, {3: 9}, default=4)
    nxt = rig.model.lm_head.get_value().argmax(axis=1)
    assert nxt[3] == 9 and set(nxt.tolist()) == {4, 9}
