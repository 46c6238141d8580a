"""The embedded default world: a generated multi-hop QA task that runs offline.

`build_world(cfg)` draws fictional entities (countries, cities, people, organisations, works) with
invented names, their attributes and relations (`synthetic_entities.py`), one passage per entity,
and 1- to 4-hop questions composed along relation chains (`synthetic_questions.py`), each with its
gold answer and gold search path. Everything follows from `cfg.seed` through string-seeded
`random.Random` streams (whose algorithm Python keeps stable): the same seed gives byte-identical
files.

`write_world(cfg, out_dir)` writes
    corpus.jsonl  {"id", "contents"}        contents = name on the first line, then the text
    train.jsonl   {"id", "question", "golden_answers", "data_source", "hops", "gold_queries",
    test.jsonl     "gold_entities",        data_source = "synthetic_<k>hop"
                   "gold_relations"}

Command line:
    python -m treegrpo_jax.data.synthetic_world --out=DIR --seed=S [--num_people=N ...]

Default sizes (seed 0): 350 entities (10 countries, 50 cities, 150 people, 40 organisations, 100 works)
= 350 passages; 800 questions per hop count (1-4 hops), 10% of each to test: 2,880 train and 320
test questions. Generation takes well under a second. The harder knobs: `questions_per_hop` of
length 5 (5-hop questions) and `distractors` (namesake passages, `synthetic_entities.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
from collections.abc import Sequence
from pathlib import Path

from treegrpo_jax.data.rows import QARow
from treegrpo_jax.data.synthetic_entities import Entity, WorldConfig, make_entities, render_passage
from treegrpo_jax.data.synthetic_questions import compose_questions

__all__ = ["World", "WorldConfig", "build_world", "main", "write_world"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class World:
    """A generated world.

    Attributes:
        config: what it was built from.
        entities: all entities; `entities[i]`'s passage is `passages[i]` with corpus id `str(i)`.
        passages: passage text per entity ("Name\\ntext").
        train: training questions (hop counts mixed, shuffled).
        test: held-out questions (same world, different questions).
    """

    config: WorldConfig
    entities: tuple[Entity, ...]
    passages: tuple[str, ...]
    train: tuple[QARow, ...]
    test: tuple[QARow, ...]

    def corpus_rows(self) -> list[dict[str, str]]:
        """Returns the corpus as `{"id", "contents"}` dicts (Search-R1 corpus layout)."""
        return [{"id": str(i), "contents": text} for i, text in enumerate(self.passages)]

    @functools.cached_property
    def _by_name(self) -> dict[str, Entity]:
        return {entity.name: entity for entity in self.entities}

    def entity_by_name(self, name: str) -> Entity:
        """Returns the entity called `name` (raises KeyError if none)."""
        return self._by_name[name]


def build_world(cfg: WorldConfig) -> World:
    """Generates the world described by `cfg`.

    Args:
        cfg: sizes, question counts, split and seed.

    Returns:
        The world, with train and test questions as `QARow`s.

    Raises:
        ValueError: if the world is too small for the requested number of questions.
    """
    entities = make_entities(cfg)
    passages = tuple(render_passage(e, entities, seed=cfg.seed) for e in entities)
    per_hop = compose_questions(entities, passages, cfg.questions_per_hop, seed=cfg.seed)

    split_rng = random.Random(f"{cfg.seed}:split")
    train_chains, test_chains = [], []
    for chains in per_hop:
        # Chains come in random draw order, so a prefix is a random subset; rounding keeps every
        # hop count in test as soon as it has a handful of questions.
        num_test = round(cfg.test_fraction * len(chains))
        test_chains.extend(chains[:num_test])
        train_chains.extend(chains[num_test:])
    split_rng.shuffle(train_chains)
    split_rng.shuffle(test_chains)

    def to_rows(split: str, chains: Sequence) -> tuple[QARow, ...]:
        return tuple(
            QARow(
                id=f"synthetic_{split}_{i}",
                question=c.question,
                golden_answers=(c.answer,),
                data_source=f"synthetic_{c.hops}hop",
                hops=c.hops,
                gold_queries=c.gold_queries,
                gold_entities=c.gold_entities,
                gold_relations=tuple(str(r) for r in c.path[1:]),
            )
            for i, c in enumerate(chains)
        )

    return World(
        config=cfg,
        entities=entities,
        passages=passages,
        train=to_rows("train", train_chains),
        test=to_rows("test", test_chains),
    )


def _write_jsonl(path: Path, records: Sequence[dict]) -> None:
    # Fixed key order, no ASCII escaping, "\n" endings: the bytes depend on the seed alone.
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_world(cfg: WorldConfig, out_dir: str | Path) -> World:
    """Builds the world and writes `corpus.jsonl`, `train.jsonl` and `test.jsonl` into `out_dir`.

    Args:
        cfg: the world's config.
        out_dir: created if missing; existing files of those names are replaced.

    Returns:
        The world that was written.
    """
    world = build_world(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "corpus.jsonl", world.corpus_rows())
    _write_jsonl(out / "train.jsonl", [row.to_json_dict() for row in world.train])
    _write_jsonl(out / "test.jsonl", [row.to_json_dict() for row in world.test])
    return world


def _parse_args(argv: Sequence[str] | None) -> tuple[Path, WorldConfig]:
    defaults = WorldConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    for field in dataclasses.fields(WorldConfig):
        default = getattr(defaults, field.name)
        if field.name == "questions_per_hop":
            parser.add_argument(
                "--questions_per_hop",
                default=",".join(map(str, default)),
                help="comma-separated counts for 1, 2, ... hops (default %(default)s)",
            )
        else:
            parser.add_argument(
                f"--{field.name}", type=type(default), default=default, help="default %(default)s"
            )
    args = parser.parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(WorldConfig)}
    try:
        values["questions_per_hop"] = tuple(int(c) for c in args.questions_per_hop.split(","))
    except ValueError:
        parser.error(f"--questions_per_hop must be comma-separated ints, got {args.questions_per_hop!r}")
    try:
        cfg = WorldConfig(**values)
    except ValueError as err:
        parser.error(str(err))
    return Path(args.out), cfg


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point: writes the world and prints its sizes."""
    out, cfg = _parse_args(argv)
    world = write_world(cfg, out)
    k = len(cfg.questions_per_hop)
    hops = [sum(row.hops == h for row in world.train + world.test) for h in range(1, k + 1)]
    print(
        f"wrote {out}: {len(world.passages)} passages, {len(world.train)} train / {len(world.test)} test "
        f"questions (1-{k} hops: {hops})"
    )


if __name__ == "__main__":
    main()
