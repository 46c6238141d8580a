"""Cold-start batching: length-grouped batches cover the demonstrations once per epoch."""

import numpy as np

from treegrpo_jax.train.cold_start import _length_grouped_batches


def test_length_grouped_batches_are_an_epoch_with_less_padding():
    rng = np.random.default_rng(0)
    lengths = rng.integers(60, 400, size=1000)
    batches = _length_grouped_batches(lengths, 8, np.random.default_rng(1))
    flat = np.concatenate(batches)
    assert all(len(b) == 8 for b in batches)
    assert len(np.unique(flat)) == len(flat) == 1000  # 1000 = whole pools of 128 + a 104-row pool
    grouped_pad = np.mean([lengths[b].max() for b in batches])
    random_pad = np.mean([lengths[b].max() for b in np.split(rng.permutation(1000), 125)])
    assert grouped_pad < 0.8 * random_pad
    again = _length_grouped_batches(lengths, 8, np.random.default_rng(1))
    assert all((a == b).all() for a, b in zip(batches, again, strict=True))  # seeded


def test_world_variants_take_turns_and_read_their_own_passages():
    """`sft.world_variants=2`: demonstrations alternate world / copy 1 / copy 2; each copy's
    observations are its own passages (its facts), and no copy repeats a test question's words."""
    import dataclasses

    from tests.train.toy import toy_config
    from treegrpo_jax.data.synthetic_world import build_world
    from treegrpo_jax.env.scripted_agent import CharTokenizer
    from treegrpo_jax.train import setup
    from treegrpo_jax.train.cold_start import collect_demonstrations

    base = toy_config()
    cfg = dataclasses.replace(
        base,
        sft=dataclasses.replace(base.sft, world_variants=2, demonstrations=30),
        observation=dataclasses.replace(
            base.observation, passage_tokens=600, max_tokens=700
        ),  # whole passages
    )
    world = build_world(cfg.data.world)
    data = setup.Data(tuple(world.train), tuple(world.test), world, "")
    retriever = setup.make_retriever(cfg, data)
    sources = setup.demonstration_sources(cfg, data, retriever)
    assert len(sources) == 3 and sources[0][0] == data.train
    test_questions = {r.question for r in data.test}
    for rows, _ in sources[1:]:
        assert rows and not test_questions & {r.question for r in rows}
        assert all(r.id.startswith("variant") for r in rows)
    env = setup.make_env(cfg, CharTokenizer(), retriever)
    demos = collect_demonstrations(sources, cfg.sft, CharTokenizer(), env)
    assert [d.id for d in demos] == [sources[i % 3][0][i // 3].id for i in range(30)]
    # A copy's demonstration shows the copy's passage of the entity it searched, not the world's.
    variant_world = build_world(dataclasses.replace(cfg.data.world, facts_variant=1))
    checked = 0
    for demo, row in zip(demos[1::3], sources[1][0], strict=False):
        shown = demo.steps[0].observation
        if "<information>" not in shown or row.gold_queries[0] not in shown:
            continue  # a guess, or a misspelled first search
        entity = variant_world.entity_by_name(row.gold_queries[0])
        mine, real = variant_world.passages[entity.index], world.passages[entity.index]
        assert mine.split("\n", 1)[1] in shown
        if mine != real:
            assert real.split("\n", 1)[1] not in shown
            checked += 1
    assert checked >= 3
