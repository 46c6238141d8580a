"""Tests for the synthetic world: determinism, hop structure, no shortcuts, BM25 findability."""

import collections
import json
import re

import bm25s
import numpy as np
import pytest

from treegrpo_jax.data import Kind, WorldConfig, build_world, read_jsonl, write_world
from treegrpo_jax.data.synthetic_entities import ATTRIBUTES, LINKS
from treegrpo_jax.data.synthetic_world import main

SMALL = WorldConfig(
    seed=3,
    num_countries=4,
    num_cities=12,
    num_people=30,
    num_organisations=10,
    num_works=20,
    questions_per_hop=(40, 40, 40, 40),
    test_fraction=0.25,
)


# The `:tiny,hard` world's knobs: 5-hop questions and namesake distractors.
HARD = WorldConfig(questions_per_hop=(150, 150, 150, 150, 150), distractors=0.5)


@pytest.fixture(scope="module")
def world():
    return build_world(WorldConfig())  # the default sizes, as the tiny config uses them


@pytest.fixture(scope="module")
def hard_world():
    return build_world(HARD)


@pytest.fixture(scope="module")
def variant_world():
    return build_world(WorldConfig(facts_variant=2))  # a counterfactual copy (sft.world_variants)


@pytest.fixture(scope="module", params=["default", "hard", "variant"])
def any_world(request, world, hard_world, variant_world):
    return {"default": world, "hard": hard_world, "variant": variant_world}[request.param]


def _all_rows(world):
    return world.train + world.test


def test_same_seed_gives_identical_files_other_seed_differs(tmp_path):
    write_world(SMALL, tmp_path / "a")
    write_world(SMALL, tmp_path / "b")
    write_world(WorldConfig(**{**SMALL.__dict__, "seed": 4}), tmp_path / "c")
    for name in ("corpus.jsonl", "train.jsonl", "test.jsonl"):
        a = (tmp_path / "a" / name).read_bytes()
        assert a == (tmp_path / "b" / name).read_bytes()
        assert a != (tmp_path / "c" / name).read_bytes()


def test_default_sizes(world):
    assert len(world.entities) == len(world.passages) == 350
    assert len(world.train) == 2880 and len(world.test) == 320
    for hops in range(1, 5):
        assert sum(r.hops == hops for r in world.test) == 80
        assert sum(r.hops == hops for r in _all_rows(world)) == 800
    assert not {r.question for r in world.train} & {r.question for r in world.test}
    assert len({r.id for r in _all_rows(world)}) == 3200


def _invented_words(entity):
    """The syllable-made words of a name (not the shared "Guild", "The ... of")."""
    words = entity.name.split()
    if entity.kind is Kind.ORGANISATION:
        return words[:1]
    if entity.kind is Kind.WORK:
        return words[-1:]
    return words


def test_names_are_unique_and_never_inside_one_another(world):
    names = [e.name.lower() for e in world.entities]
    assert len(set(names)) == len(names)
    for a in names:
        for b in names:
            assert a == b or a not in b, (a, b)
    words = sorted((w.lower() for e in world.entities for w in _invented_words(e)), key=len)
    assert len(set(words)) == len(words)
    for i, short in enumerate(words):
        for long in words[i + 1 :]:
            assert short not in long, (short, long)


def test_corpus_layout_title_then_text(tmp_path):
    world = write_world(SMALL, tmp_path)
    lines = (tmp_path / "corpus.jsonl").read_text("utf-8").splitlines()
    assert len(lines) == len(world.entities)
    for i, line in enumerate(lines):
        record = json.loads(line)
        assert list(record) == ["id", "contents"] and record["id"] == str(i)
        title, text = record["contents"].split("\n")
        assert title == world.entities[i].name
        assert text.count(world.entities[i].name) >= 3  # named in every sentence: BM25 finds it
    # The question files read back through the ordinary JSONL reader without a bad row.
    for split in ("train", "test"):
        result = read_jsonl(tmp_path / f"{split}.jsonl")
        assert result.rows == getattr(world, split)


def _yield_of(entity, world, found):
    """True if `found` is what one hop from `entity` gives: a related entity's name or an attribute."""
    related = {world.entities[t].name for t in entity.relations.values()}
    return found in related or found in entity.attributes.values()


def _whole_word(text, phrase):
    return re.search(rf"(?<!\w){re.escape(phrase.lower())}(?!\w)", text.lower()) is not None


def test_gold_paths_follow_relations_and_count_hops(any_world):
    world = any_world
    for row in _all_rows(world):
        assert row.data_source == f"synthetic_{row.hops}hop"
        assert len(row.gold_queries) == len(row.gold_entities) == row.hops
        assert row.gold_entities[-1] == row.golden_answers[0]
        assert row.gold_queries[1:] == row.gold_entities[:-1]  # each bridge is the next query
        assert len(row.gold_relations) == row.hops
        for j, relation in enumerate(row.gold_relations[:-1]):  # each bridge is that relation's target
            here = world.entity_by_name(row.gold_queries[j])
            assert world.entities[here.relations[relation]].name == row.gold_queries[j + 1]
        last = world.entity_by_name(row.gold_queries[-1])
        relation = row.gold_relations[-1]
        gold = world.entities[last.relations[relation]].name if relation in last.relations else None
        assert (gold or last.attributes[relation]) == row.golden_answers[0]
        start = world.entity_by_name(row.gold_queries[0])
        assert start.name in row.question or start.mention in row.question
        for query, found in zip(row.gold_queries, row.gold_entities, strict=True):
            entity = world.entity_by_name(query)
            assert _yield_of(entity, world, found), (row, query, found)
            assert _whole_word(world.passages[entity.index], found)  # the hop's passage holds it


def test_no_shortcuts_multi_hop_answers_not_in_earlier_passages(any_world):
    world = any_world
    multi = [r for r in _all_rows(world) if r.hops > 1]
    assert multi
    for row in multi:
        first = world.passages[world.entity_by_name(row.gold_queries[0]).index]
        assert not _whole_word(first, row.golden_answers[0]), row
        for j, found in enumerate(row.gold_entities):
            for query in row.gold_queries[:j]:
                assert not _whole_word(world.passages[world.entity_by_name(query).index], found), (row, j)
        assert len(set(row.gold_queries) | {row.golden_answers[0]}) == row.hops + 1  # no cycles


def test_relations_are_consistent_with_kinds_and_dates(any_world):
    world = any_world
    for e in world.entities:
        for relation, target in e.relations.items():
            assert (e.kind, world.entities[target].kind) == LINKS[relation]
        for attribute in e.attributes:
            assert ATTRIBUTES[attribute] is e.kind
        if e.kind is Kind.ORGANISATION:
            founder = world.entities[e.relations["founder"]]
            assert int(e.attributes["founding_year"]) > int(founder.attributes["birth_year"])
        if e.kind is Kind.WORK:
            year = int(e.attributes["publication_year"])
            assert year > int(world.entities[e.relations["author"]].attributes["birth_year"])
            assert year >= int(world.entities[e.relations["publisher"]].attributes["founding_year"])
        if e.kind is Kind.COUNTRY:
            capital = world.entities[e.relations["capital"]]
            assert capital.relations["country"] == e.index


@pytest.mark.parametrize("stopwords", [None, "en"])
def test_bm25_with_the_entity_name_ranks_its_passage_first(any_world, stopwords):
    world = any_world
    retriever = bm25s.BM25()
    retriever.index(
        bm25s.tokenize(list(world.passages), stopwords=stopwords, show_progress=False), show_progress=False
    )
    queries = [e.name for e in world.entities]
    results, _ = retriever.retrieve(
        bm25s.tokenize(queries, stopwords=stopwords, show_progress=False), k=1, show_progress=False
    )
    top1 = float(np.mean(results[:, 0] == np.arange(len(queries))))
    assert top1 == 1.0


def test_cli_writes_the_world(tmp_path, capsys):
    main(
        [
            "--out",
            str(tmp_path),
            "--seed=3",
            "--num_people=30",
            "--num_cities=12",
            "--num_countries=4",
            "--num_organisations=10",
            "--num_works=20",
            "--questions_per_hop=40,40,40,40",
            "--test_fraction=0.25",
        ]
    )
    assert "76 passages, 120 train / 40 test" in capsys.readouterr().out
    assert (tmp_path / "train.jsonl").read_bytes() == _written(SMALL, tmp_path / "lib")


def _written(cfg, out):
    write_world(cfg, out)
    return (out / "train.jsonl").read_bytes()


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_people"):
        WorldConfig(num_people=0)
    with pytest.raises(ValueError, match="num_cities"):
        WorldConfig(num_countries=5, num_cities=4)
    with pytest.raises(ValueError, match="questions_per_hop"):
        WorldConfig(questions_per_hop=(1, 1, 1, 1, 1, 1))
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(ValueError, match="distractors"):
            WorldConfig(distractors=bad)
    with pytest.raises(ValueError, match="test_fraction"):
        WorldConfig(test_fraction=1.0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="facts_variant"):
            WorldConfig(facts_variant=bad)
    tiny = WorldConfig(
        num_countries=1,
        num_cities=1,
        num_people=2,
        num_organisations=1,
        num_works=1,
        questions_per_hop=(60,),
    )
    with pytest.raises(ValueError, match="questions_per_hop: found only"):
        build_world(tiny)


def test_namesakes_share_one_name_word_and_like_facts_and_leave_the_rest_unchanged(world, hard_world):
    base = len(world.entities)
    # Everything the default world has is there, unchanged: namesakes come after it.
    for a, b in zip(world.entities, hard_world.entities[:base], strict=False):
        assert (a.name, dict(a.attributes), dict(a.relations)) == (
            b.name,
            dict(b.attributes),
            dict(b.relations),
        )
    assert hard_world.passages[:base] == world.passages
    namesakes = hard_world.entities[base:]
    assert len(namesakes) == sum(HARD.num_namesakes) == 145  # half of 150 people, 40 orgs, 100 works
    originals = {e.name: e for e in world.entities}
    for e in namesakes:
        words = set(_invented_words(e))
        twins = [o for o in world.entities if o.kind is e.kind and words & set(_invented_words(o))]
        assert len(twins) == 1, e.name  # exactly one original shares a name word
        (twin,) = twins
        assert e.name not in originals and len(words & set(_invented_words(twin))) == 1
        country = lambda city: hard_world.entities[city].relations["country"]  # noqa: E731
        if e.kind is Kind.PERSON:
            assert e.attributes["occupation"] == twin.attributes["occupation"]
            assert abs(int(e.attributes["birth_year"]) - int(twin.attributes["birth_year"])) <= 10
            assert country(e.relations["born_in"]) == country(twin.relations["born_in"])
        elif e.kind is Kind.ORGANISATION:
            assert country(e.relations["based_in"]) == country(twin.relations["based_in"])
        else:
            assert e.attributes["genre"] == twin.attributes["genre"]
            assert e.relations["publisher"] == twin.relations["publisher"]
        assert e.index not in {
            t for x in hard_world.entities for t in x.relations.values()
        }  # nothing points here


def test_the_hard_world_asks_five_hops_and_a_partial_name_finds_a_namesake(hard_world):
    five = [r for r in _all_rows(hard_world) if r.hops == 5]
    assert len(five) == 150 and all(len(r.gold_queries) == 5 for r in five)
    # A query with one word of a person's name: BM25 cannot tell them from their namesake.
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(list(hard_world.passages), show_progress=False), show_progress=False)
    base = len(hard_world.entities) - sum(HARD.num_namesakes)
    people = [e for e in hard_world.entities[base:] if e.kind is Kind.PERSON]
    shared = []
    for e in people:
        (word,) = {w for w in e.name.split()} & {
            w for o in hard_world.entities[:base] if o.kind is Kind.PERSON for w in o.name.split()
        }
        shared.append(word)
    results, _ = retriever.retrieve(bm25s.tokenize(shared, show_progress=False), k=2, show_progress=False)
    idx = np.asarray([e.index for e in people])
    assert np.mean((results == idx[:, None]).any(-1)) == 1.0  # the namesake is among the top 2 ...
    assert 0.2 < np.mean(results[:, 0] == idx) < 0.8  # ... and first about half the time


def test_a_facts_variant_keeps_every_name_and_redraws_the_facts(world, variant_world):
    names = [e.name for e in world.entities]
    assert names == [e.name for e in variant_world.entities]
    assert [e.kind for e in world.entities] == [e.kind for e in variant_world.entities]
    pairs = list(zip(world.entities, variant_world.entities, strict=True))
    for attribute in ("birth_year", "occupation", "founding_year", "genre", "publication_year"):
        owners = [(a, b) for a, b in pairs if attribute in a.attributes]
        changed = sum(a.attributes[attribute] != b.attributes[attribute] for a, b in owners)
        assert changed > 0.5 * len(owners), attribute  # most facts differ (a few agree by chance)
    moved = sum(a.relations != b.relations for a, b in pairs)
    assert moved > 0.5 * len(pairs)
    # The passages say the variant's facts: a person's passage names its own birth year.
    person = next(b for _, b in pairs if "birth_year" in b.attributes)
    assert person.attributes["birth_year"] in variant_world.passages[person.index]
    # Variant 0 is the world itself (default worlds stay byte-identical).
    assert build_world(WorldConfig(facts_variant=0)).passages == world.passages


def test_verdict_world_has_1500_test_questions_none_seen_in_training():
    """`:tiny,hard,verdict` (benchmarks/verdict.py): 300 test questions per hop count, 3,000 train,
    and no test question also a train question (the larger split is the point of the variant)."""
    from treegrpo_jax.configs import multihop
    from treegrpo_jax.train.config import from_config_dict

    cfg = from_config_dict(multihop.get_config("tiny,hard,verdict"))
    assert cfg.data.eval_prompts == 1500
    w = build_world(cfg.data.world)
    assert (len(w.train), len(w.test)) == (3000, 1500)
    assert sorted(collections.Counter(r.hops for r in w.test).values()) == [300] * 5
    assert not {r.question for r in w.test} & {r.question for r in w.train}
