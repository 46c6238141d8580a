"""Scripted demonstrations: they parse, score as intended, honour the mistake rates, and tokenize
segment by segment with the loss mask exactly on the generated spans."""

import collections
import dataclasses
import math

import pytest

from treegrpo_jax.data import WorldConfig, build_world
from treegrpo_jax.env import scripted_agent
from treegrpo_jax.env.actions import ActionKind, Answer, Search, parse_action
from treegrpo_jax.env.bm25 import BM25Retriever
from treegrpo_jax.env.prompt import PromptConfig, prompt_text
from treegrpo_jax.env.rewards import is_well_formed, training_reward
from treegrpo_jax.env.scripted_agent import (
    CharTokenizer,
    Mistake,
    ScriptConfig,
    make_demonstrations,
    read_demonstrations,
    tokenize_demonstration,
    write_demonstrations,
)
from treegrpo_jax.model.bpe_train import train_bpe_tokenizer

PERFECT = dict(wrong_answer_rate=0.0, misspelled_query_rate=0.0, skip_think_rate=0.0, guess_rate=0.0)
ONLY = {m: {**PERFECT, f"{m.value}_rate": 1.0} for m in list(Mistake)[1:]}
EXPECTED_REWARD = {
    Mistake.WRONG_ANSWER: 0.2,
    Mistake.MISSPELLED_QUERY: 1.0,
    Mistake.SKIP_THINK: 0.8,
    Mistake.GUESS: 0.2,
}


@pytest.fixture(scope="module")
def world():
    return build_world(WorldConfig())


@pytest.fixture(scope="module")
def retriever(world):
    return BM25Retriever.from_texts(list(world.passages))


@pytest.fixture(scope="module")
def tokenizer(world):
    return train_bpe_tokenizer([*world.passages, *(r.question for r in world.train)], vocab_size=1024)


@pytest.fixture(scope="module")
def rows_by_hops(world):
    by_hops = collections.defaultdict(list)
    for row in world.train:
        by_hops[row.hops].append(row)
    return {h: rows[:8] for h, rows in sorted(by_hops.items())}


def _make(rows, retriever, tokenizer, **cfg):
    return make_demonstrations(rows, retriever=retriever, tokenizer=tokenizer, cfg=ScriptConfig(**cfg))


def _assert_steps_parse_as_intended(demo):
    for i, step in enumerate(demo.steps):
        last = i == len(demo.steps) - 1
        assert step.action is (ActionKind.ANSWER if last else ActionKind.SEARCH)
        expected = Answer(text=step.content) if last else Search(query=step.content)
        # After the tool-call limit the rollout parses with search disabled; an answer still parses.
        forced = last and demo.hit_tool_limit
        assert parse_action(step.generated, search_allowed=not forced) == expected
        assert bool(step.observation) is not last
    assert demo.answer == demo.steps[-1].content
    assert demo.reward == training_reward(demo.generated_steps, demo.golden_answers)
    assert demo.well_formed == is_well_formed(demo.generated_steps)


def test_perfect_demonstrations_follow_the_gold_path(rows_by_hops, retriever, tokenizer):
    assert set(rows_by_hops) == {1, 2, 3, 4}
    for hops, rows in rows_by_hops.items():
        for row, demo in zip(rows, _make(rows, retriever, tokenizer, **PERFECT), strict=True):
            _assert_steps_parse_as_intended(demo)
            assert demo.mistake is Mistake.NONE
            assert (demo.reward, demo.correct, demo.well_formed) == (1.0, True, True)
            assert [s.content for s in demo.steps] == [*row.gold_queries, row.golden_answers[0]]
            # Each hop's passage really was retrieved: what it yields is in the observation.
            for step, found in zip(demo.steps, row.gold_entities, strict=False):
                assert found in step.observation
                assert step.observation.startswith("\n\n<information>Doc 1 (Title: ")
            assert demo.hit_tool_limit is (hops == 4)
            assert demo.steps[-2].observation.endswith(PromptConfig().forced_answer) is (hops == 4)
            assert demo.prompt == PromptConfig().render(row.question)


@pytest.mark.parametrize("mistake", list(EXPECTED_REWARD), ids=lambda m: m.value)
def test_each_mistake_scores_as_intended(mistake, rows_by_hops, retriever, tokenizer):
    # Up to 3 hops, so even a misspelled query's extra search fits the 4-search limit.
    rows = [row for hops in (1, 2, 3) for row in rows_by_hops[hops]]
    for row, demo in zip(rows, _make(rows, retriever, tokenizer, **ONLY[mistake]), strict=True):
        _assert_steps_parse_as_intended(demo)
        assert demo.mistake is mistake
        assert demo.reward == EXPECTED_REWARD[mistake]
        searches = [s.content for s in demo.steps if s.action is ActionKind.SEARCH]
        if mistake is Mistake.WRONG_ANSWER:
            assert not demo.correct and demo.well_formed
            assert searches == list(row.gold_queries[: len(searches)])
            assert 1 <= len(searches) <= max(1, row.hops - 1)
            assert demo.answer in (*row.gold_entities[:-1], row.gold_queries[0])
        elif mistake is Mistake.MISSPELLED_QUERY:
            assert demo.correct and demo.well_formed
            assert len(searches) == row.hops + 1
            typo = next(i for i, q in enumerate(searches) if q not in row.gold_queries)
            assert searches[:typo] + searches[typo + 1 :] == list(row.gold_queries)
            assert searches[typo].lower() != row.gold_queries[typo].lower()
        elif mistake is Mistake.SKIP_THINK:
            assert demo.correct and not demo.well_formed
            assert sum("<think>" not in s.generated for s in demo.steps) == 1
        else:
            assert not demo.correct and demo.well_formed and searches == []
            assert demo.answer.isdigit() == row.golden_answers[0].isdigit()


def test_wrong_answer_stops_early(rows_by_hops, retriever, tokenizer):
    rows = rows_by_hops[3] + rows_by_hops[4]
    for row, demo in zip(rows, _make(rows, retriever, tokenizer, **ONLY[Mistake.WRONG_ANSWER]), strict=True):
        j = len(demo.steps) - 2  # Index of the last search.
        assert 0 <= j < row.hops - 1
        assert demo.answer == row.gold_entities[j]


def _think(step):
    return step.generated.split("<think> ")[1].split(" </think>")[0]


def test_thinks_name_the_relation_each_passage_must_give(rows_by_hops, retriever, tokenizer):
    # The first think is the plan; the step that reads a passage sits next to words saying which
    # fact to take from it.
    for hops in (1, 2, 3):
        rows = rows_by_hops[hops]
        for row, demo in zip(rows, _make(rows, retriever, tokenizer, **PERFECT), strict=True):
            nouns = [scripted_agent._RELATION_NOUNS[r] for r in row.gold_relations]
            q, found = row.gold_queries, row.gold_entities
            fact = [f"{n[0].upper()}{n[1:]} of {q[i]} is {found[i]}." for i, n in enumerate(nouns)]
            plan = f"{nouns[0]} of {q[0]}" + "".join(f", then {n}" for n in nouns[1:]) + "."
            assert _think(demo.steps[0]).endswith(plan)
            for i in range(1, hops):
                said = _think(demo.steps[i])
                assert said.startswith(fact[i - 1]) and said.endswith(f"{nouns[i]} of {q[i]}.")
            assert _think(demo.steps[-1]) == fact[-1]


def test_rows_without_relations_get_generic_thinks(rows_by_hops, retriever, tokenizer):
    rows = [dataclasses.replace(r, gold_relations=()) for r in rows_by_hops[2]]
    for row, demo in zip(rows, _make(rows, retriever, tokenizer, **PERFECT), strict=True):
        assert not any(noun in demo.transcript() for noun in ("Now I need", "First I need", "I need the"))
        assert demo.correct and demo.answer == row.golden_answers[0]


def test_tool_limit_forces_an_answer(rows_by_hops, retriever, tokenizer):
    rows = rows_by_hops[3] + rows_by_hops[4]
    for row, demo in zip(rows, _make(rows, retriever, tokenizer, **PERFECT, max_tool_calls=2), strict=True):
        _assert_steps_parse_as_intended(demo)
        assert demo.hit_tool_limit and len(demo.steps) == 3
        assert demo.steps[1].observation.endswith(PromptConfig().forced_answer)
        assert demo.answer == row.gold_entities[1] and demo.reward == 0.2


def test_mistake_rates_are_honoured(world, retriever, tokenizer):
    rows = world.train[:500]
    cfg = dict(wrong_answer_rate=0.2, misspelled_query_rate=0.15, skip_think_rate=0.1, guess_rate=0.05)
    demos = _make(rows, retriever, CharTokenizer(), **cfg)
    counts = collections.Counter(d.mistake for d in demos)
    for mistake in EXPECTED_REWARD:
        p = cfg[f"{mistake.value}_rate"]
        # Seeded, so deterministic; 4 binomial standard deviations would hold for almost any seed.
        assert abs(counts[mistake] - p * len(rows)) <= 4 * math.sqrt(len(rows) * p * (1 - p)), counts
    again = _make(rows, retriever, CharTokenizer(), **cfg)
    assert again == demos
    other_seed = _make(rows, retriever, CharTokenizer(), **cfg, seed=1)
    assert [d.mistake for d in other_seed] != [d.mistake for d in demos]


def test_a_rows_demonstration_does_not_depend_on_its_batch(world, retriever, tokenizer):
    rows = world.train[:40]
    cfg = {**ONLY[Mistake.MISSPELLED_QUERY]}
    assert _make(rows[10:20], retriever, tokenizer, **cfg) == _make(rows, retriever, tokenizer, **cfg)[10:20]


@pytest.mark.parametrize("chat", [True, False])
def test_tokenized_mask_covers_exactly_the_generated_spans(world, retriever, tokenizer, chat):
    demos = _make(world.train[:30], retriever, tokenizer)
    for demo in demos:
        tok = tokenize_demonstration(demo, tokenizer, chat=chat)
        prompt = prompt_text(demo.prompt, tokenizer, chat=chat)
        assert prompt.startswith("<|im_start|>user\n") is chat
        segments = [(prompt, False)]
        for step in demo.steps:
            segments.append((step.generated, True))
            if step.observation:
                segments.append((step.observation, False))
        # Each span is its own segment's tokens: nothing re-tokenized across a boundary.
        assert [(tokenizer.decode(ids), trained) for ids, trained in tok.spans] == segments
        assert [ids for ids, _ in tok.spans] == [tuple(tokenizer.encode(text)) for text, _ in segments]
        assert tokenizer.decode(tok.tokens) == prompt + "".join(
            s.generated + s.observation for s in demo.steps
        )
        assert len(tok.loss_mask) == len(tok.tokens)
        trained = [t for t, m in zip(tok.tokens, tok.loss_mask, strict=True) if m]
        assert trained == [t for s in demo.steps for t in tokenizer.encode(s.generated)]
        # The sequence ends on the last answer's closing tag: no EOS (the stop string ends the step).
        assert tok.loss_mask[-1] == 1 and tokenizer.decode(tok.tokens[-1:]) == "</answer>"
        assert not set(tok.tokens[-3:]) & set(tokenizer.eos_ids)


def test_char_tokenizer_drafts_have_the_plain_prompt(world, retriever):
    demo = _make(world.train[:1], retriever, CharTokenizer())[0]
    tok = tokenize_demonstration(demo, CharTokenizer())
    assert CharTokenizer().decode(tok.spans[0][0]) == demo.prompt
    assert demo.transcript().startswith(demo.prompt) and demo.transcript().endswith("</answer>")


def test_write_read_round_trip(world, retriever, tokenizer, tmp_path):
    demos = _make(world.train[:60], retriever, tokenizer)
    path = tmp_path / "demos.jsonl"
    write_demonstrations(demos, path)
    assert read_demonstrations(path) == demos
    write_demonstrations(read_demonstrations(path), tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()


@pytest.mark.parametrize(
    "bad",
    [
        dict(wrong_answer_rate=-0.1),
        dict(guess_rate=1.5),
        dict(skip_think_rate=True),
        dict(wrong_answer_rate=0.6, misspelled_query_rate=0.5),
        dict(top_k=0),
        dict(max_tool_calls=1.5),
    ],
)
def test_script_config_validates(bad):
    with pytest.raises(ValueError, match="ScriptConfig"):
        ScriptConfig(**bad)


def test_rows_without_a_gold_path_are_rejected(world, retriever):
    row = world.train[0]
    broken = dataclasses.replace(row, gold_queries=row.gold_queries[:-1])
    with pytest.raises(ValueError, match="gold path"):
        _make([broken], retriever, CharTokenizer())


def test_five_hop_demonstrations_in_the_hard_world_search_every_hop():
    """`:tiny,hard`: 5-hop questions with 5 searches allowed, and namesake passages in the corpus:
    a perfect demonstration still retrieves each hop's own passage (its full name ranks first)."""
    hard = build_world(WorldConfig(questions_per_hop=(0, 0, 0, 0, 40), distractors=0.5))
    retriever = BM25Retriever.from_texts(list(hard.passages))
    tok = train_bpe_tokenizer([*hard.passages, *(r.question for r in hard.train)], vocab_size=1024)
    rows = [r for r in hard.train if r.hops == 5][:8]
    for row, demo in zip(rows, _make(rows, retriever, tok, **PERFECT, max_tool_calls=5), strict=True):
        _assert_steps_parse_as_intended(demo)
        assert [s.content for s in demo.steps] == [*row.gold_queries, row.golden_answers[0]]
        assert demo.reward == 1.0 and demo.hit_tool_limit
        for step, found in zip(demo.steps, row.gold_entities, strict=False):
            assert found in step.observation
