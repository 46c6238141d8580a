"""The synthetic world's entities, their attributes and relations, and one passage per entity.

Five kinds: countries and cities (places), people, organisations and works. Relations are all
functional in the direction they are asked (a person has one birthplace, a work one author), so every
composed question has exactly one answer:

    person --born_in--> city          person --member_of--> organisation
    organisation --founder--> person  organisation --based_in--> city
    work --author--> person           work --publisher--> organisation
    city --country--> country         country --capital--> city

Dates are kept plausible (an organisation is founded after its founder's birth, a work is published
after its author's birth and after its publisher's founding) so that the text reads like a history.

Distractors (`WorldConfig.distractors`, off by default): a share of the people, organisations and
works get a *namesake*, an entity of the same kind whose name shares one word with theirs ("Kelo
Varndi" / "Kelo Tarvim", "the Drima Guild" / "the Drima Press", "The Bells of Tovar" / "The Songs of
Tovar") and whose facts are alike (the same occupation or genre, a birthplace or seat in the same
country, a year close by). A search that drops or garbles a word of the name then finds a
plausible passage with the wrong facts. Namesakes come after all other entities and relate to them
(nothing relates to a namesake), so the world without them is unchanged, byte for byte.

A passage is the entity's name on the first line, then three or four sentences that each contain
the name (so BM25 with the name as the query ranks it first) and state the entity's own attributes
and relations. Other passages mention a name only where they relate to it, once.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import types
from collections.abc import Mapping

from treegrpo_jax.data.synthetic_names import NameWords, template_words

__all__ = [
    "ATTRIBUTES",
    "LINKS",
    "MAX_HOPS",
    "Entity",
    "Kind",
    "WorldConfig",
    "make_entities",
    "render_passage",
]

# The longest question the world composes: 5 hops (searches) at most.
MAX_HOPS = 5


class Kind(enum.Enum):
    """Entity kinds."""

    COUNTRY = "country"
    CITY = "city"
    PERSON = "person"
    ORGANISATION = "organisation"
    WORK = "work"


# relation name -> (source kind, target kind)
LINKS: dict[str, tuple[Kind, Kind]] = {
    "born_in": (Kind.PERSON, Kind.CITY),
    "member_of": (Kind.PERSON, Kind.ORGANISATION),
    "founder": (Kind.ORGANISATION, Kind.PERSON),
    "based_in": (Kind.ORGANISATION, Kind.CITY),
    "author": (Kind.WORK, Kind.PERSON),
    "publisher": (Kind.WORK, Kind.ORGANISATION),
    "country": (Kind.CITY, Kind.COUNTRY),
    "capital": (Kind.COUNTRY, Kind.CITY),
}
# attribute name -> kind that has it
ATTRIBUTES: dict[str, Kind] = {
    "birth_year": Kind.PERSON,
    "occupation": Kind.PERSON,
    "founding_year": Kind.ORGANISATION,
    "genre": Kind.WORK,
    "publication_year": Kind.WORK,
    "city_founding_year": Kind.CITY,
    "established_year": Kind.COUNTRY,
}

_OCCUPATIONS = (
    "painter",
    "chemist",
    "poet",
    "architect",
    "astronomer",
    "composer",
    "sculptor",
    "historian",
    "engineer",
    "physician",
    "botanist",
    "cartographer",
    "philosopher",
    "mathematician",
)
_GENRES = (
    "mystery",
    "satire",
    "romance",
    "tragedy",
    "comedy",
    "fable",
    "memoir",
    "epic",
    "elegy",
    "thriller",
)
_ORG_TYPES = (
    "Guild",
    "Press",
    "Society",
    "Academy",
    "Institute",
    "Company",
    "Circle",
    "Foundation",
    "Union",
    "Lodge",
)
_TITLE_NOUNS = (
    "Lanterns",
    "Songs",
    "Letters",
    "Gardens",
    "Voyage",
    "Shadows",
    "Bells",
    "Rivers",
    "Mirrors",
    "Winters",
)
_FEATURES = (
    "harbour",
    "bridges",
    "markets",
    "towers",
    "gardens",
    "archives",
    "festivals",
    "libraries",
    "orchards",
    "fountains",
)

_PASSAGE_TEMPLATES = {
    Kind.PERSON: (
        (
            "{n} was {a_occupation} born in {born_in} in {birth_year}.",
            "Born in {born_in} in {birth_year}, {n} worked as {a_occupation}.",
        ),
        ("{n} was a member of {member_of}.", "{n} belonged to {member_of}."),
        ("{n} is still remembered for a life of quiet work.", "Letters written by {n} survive to this day."),
    ),
    Kind.ORGANISATION: (
        ("{n} is based in {based_in}.", "{n} has its headquarters in {based_in}."),
        ("{n} was founded in {founding_year} by {founder}.", "{founder} founded {n} in {founding_year}."),
        ("{n} is known for its {feature}.", "Visitors to {n} admire its {feature}."),
    ),
    Kind.WORK: (
        ("{n} is {a_genre} written by {author}.", "{n} is {a_genre} by {author}."),
        (
            "{n} was published by {publisher} in {publication_year}.",
            "{publisher} published {n} in {publication_year}.",
        ),
        ("{n} remains widely read.", "Critics still argue about {n}."),
    ),
    Kind.CITY: (
        ("{n} is a city in {country}.", "{n} is a city located in {country}."),
        ("{n} was founded in {city_founding_year}.", "The city of {n} dates from {city_founding_year}."),
        ("{n} is known for its {feature}.", "Travellers to {n} praise its {feature}."),
    ),
    Kind.COUNTRY: (
        ("{n} is a country whose capital is {capital}.", "The capital of {n} is {capital}."),
        ("{n} was established in {established_year}.", "The state of {n} dates from {established_year}."),
        ("{n} is known for its {feature}.", "People in {n} take pride in its {feature}."),
    ),
}
# A city that is a capital says so: the inverse of `capital`, stated where a reader expects it.
_CAPITAL_SENTENCE = "{n} is the capital of {country}."


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorldConfig:
    """Size and seed of the synthetic world.

    Attributes:
        seed: fixes every name, fact, passage and question.
        num_countries / num_cities / num_people / num_organisations / num_works: entity counts.
        questions_per_hop: how many questions with 1, 2, ... hops (length 1 to `MAX_HOPS`).
        test_fraction: share of each hop count's questions that go to `test.jsonl`.
        distractors: share (0 to 1) of the people, organisations and works given a namesake.
        facts_variant: 0 is the world itself; k > 0 keeps every name and re-draws every fact,
            relation from stream k (a counterfactual copy, worded alike: the cold start
            demonstrates on such copies so that reading a passage, not recalling it, is what
            predicts an answer; `SFTSpec.world_variants`).
    """

    seed: int = 0
    num_countries: int = 10
    num_cities: int = 50
    num_people: int = 150
    num_organisations: int = 40
    num_works: int = 100
    questions_per_hop: tuple[int, ...] = (800, 800, 800, 800)
    test_fraction: float = 0.1
    distractors: float = 0.0
    facts_variant: int = 0

    def __post_init__(self):
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"WorldConfig.seed must be a non-negative int, got {self.seed!r}")
        for name in ("num_countries", "num_cities", "num_people", "num_organisations", "num_works"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"WorldConfig.{name} must be a positive int, got {value!r}")
        if self.num_cities < self.num_countries:
            raise ValueError(
                f"WorldConfig.num_cities ({self.num_cities}) must be >= num_countries "
                f"({self.num_countries}): every country needs a capital"
            )
        counts = self.questions_per_hop
        if (
            not isinstance(counts, tuple)
            or not 1 <= len(counts) <= MAX_HOPS
            or any(not isinstance(c, int) or c < 0 for c in counts)
            or sum(counts) == 0
        ):
            raise ValueError(
                f"WorldConfig.questions_per_hop must be a tuple of 1 to {MAX_HOPS} non-negative ints "
                f"(1-hop first) with a positive sum, got {counts!r}"
            )
        if not 0.0 <= self.test_fraction < 1.0:
            raise ValueError(f"WorldConfig.test_fraction must be in [0, 1), got {self.test_fraction!r}")
        if (
            isinstance(self.facts_variant, bool)
            or not isinstance(self.facts_variant, int)
            or self.facts_variant < 0
        ):
            raise ValueError(f"WorldConfig.facts_variant must be an int >= 0, got {self.facts_variant!r}")
        d = self.distractors
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0.0 <= d <= 1.0:
            raise ValueError(f"WorldConfig.distractors must be a number in [0, 1], got {d!r}")

    @property
    def num_namesakes(self) -> tuple[int, int, int]:
        """Namesakes of people, organisations and works."""
        counts = (self.num_people, self.num_organisations, self.num_works)
        return tuple(round(self.distractors * n) for n in counts)

    @property
    def num_entities(self) -> int:
        """Total entities (= passages)."""
        return (
            self.num_countries
            + self.num_cities
            + self.num_people
            + self.num_organisations
            + self.num_works
            + sum(self.num_namesakes)
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entity:
    """One entity of the world; its index is also its passage's corpus id.

    Attributes:
        index: position in `World.entities`.
        kind: what it is.
        name: its unique name (the search query that finds its passage).
        attributes: attribute name -> value (years as decimal strings).
        relations: relation name -> index of the related entity.
    """

    index: int
    kind: Kind
    name: str
    attributes: Mapping[str, str]
    relations: Mapping[str, int]

    @property
    def mention(self) -> str:
        """How running text refers to it: organisations take an article ("the Vorn Guild")."""
        return f"the {self.name}" if self.kind is Kind.ORGANISATION else self.name


def _reserved_words() -> set[str]:
    texts = [t for templates in _PASSAGE_TEMPLATES.values() for pair in templates for t in pair]
    texts += [_CAPITAL_SENTENCE, *_OCCUPATIONS, *_GENRES, *_ORG_TYPES, *_TITLE_NOUNS, *_FEATURES]
    # Question templates use a few more words; adding common English ones keeps names clear of them.
    texts.append("which what who where year city country organisation founder author publisher capital")
    return template_words(*texts)


def make_entities(cfg: WorldConfig) -> tuple[Entity, ...]:
    """Draws every entity with its attributes and relations, deterministically from `cfg.seed`.

    Args:
        cfg: sizes and seed.

    Returns:
        Entities ordered countries, cities, people, organisations, works.
    """
    # Named streams (PRNG discipline): changing how facts are drawn does not change the names.
    names = NameWords(random.Random(f"{cfg.seed}:names"), _reserved_words())
    rng = random.Random(f"{cfg.seed}:facts")

    # Two syllables mostly; places get a third now and then so they sound unlike people.
    countries = [names.draw(2, 3) for _ in range(cfg.num_countries)]
    cities = [names.draw(2, 3) for _ in range(cfg.num_cities)]
    people = [f"{names.draw(2, 2)} {names.draw(2, 2)}" for _ in range(cfg.num_people)]
    orgs = [f"{names.draw(2, 2)} {rng.choice(_ORG_TYPES)}" for _ in range(cfg.num_organisations)]
    works = [f"The {rng.choice(_TITLE_NOUNS)} of {names.draw(2, 2)}" for _ in range(cfg.num_works)]
    if cfg.facts_variant:  # the names above stay; every fact below comes from another stream
        rng = random.Random(f"{cfg.seed}:facts:{cfg.facts_variant}")

    country0 = 0
    city0 = country0 + cfg.num_countries
    person0 = city0 + cfg.num_cities
    org0 = person0 + cfg.num_people
    work0 = org0 + cfg.num_organisations

    # Cities: the first `num_countries` give every country one city; the rest fall anywhere.
    city_country = [
        i if i < cfg.num_countries else rng.randrange(cfg.num_countries) for i in range(cfg.num_cities)
    ]
    capitals = []
    for c in range(cfg.num_countries):
        capitals.append(rng.choice([i for i, cc in enumerate(city_country) if cc == c]))
    established = [rng.randint(900, 1500) for _ in countries]
    city_years = [
        min(1700, established[city_country[i]] + rng.randint(0, 400)) for i in range(cfg.num_cities)
    ]

    birth_years = [rng.randint(1700, 1950) for _ in people]
    occupations = [rng.choice(_OCCUPATIONS) for _ in people]
    born_in = [rng.randrange(cfg.num_cities) for _ in people]
    founders = [rng.randrange(cfg.num_people) for _ in orgs]
    org_years = [birth_years[f] + rng.randint(25, 60) for f in founders]
    org_cities = [rng.randrange(cfg.num_cities) for _ in orgs]
    member_of = [rng.randrange(cfg.num_organisations) for _ in people]

    authors, publishers, work_years, genres = [], [], [], []
    for _ in works:
        author = rng.randrange(cfg.num_people)
        year = birth_years[author] + rng.randint(20, 70)
        open_orgs = [o for o, y in enumerate(org_years) if y <= year]
        if open_orgs:
            publisher = rng.choice(open_orgs)
        else:  # no organisation old enough: publish the year after the oldest one was founded
            publisher = min(range(len(org_years)), key=org_years.__getitem__)
            year = org_years[publisher] + 1
        authors.append(author)
        publishers.append(publisher)
        work_years.append(year)
        genres.append(rng.choice(_GENRES))

    entities: list[Entity] = []

    def add(kind: Kind, name: str, attributes: dict[str, str], relations: dict[str, int]) -> None:
        # Read-only views: the dataclass is frozen, and so should be what it holds.
        entities.append(
            Entity(
                index=len(entities),
                kind=kind,
                name=name,
                attributes=types.MappingProxyType(attributes),
                relations=types.MappingProxyType(relations),
            )
        )

    for i, name in enumerate(countries):
        add(Kind.COUNTRY, name, {"established_year": str(established[i])}, {"capital": city0 + capitals[i]})
    for i, name in enumerate(cities):
        add(
            Kind.CITY,
            name,
            {"city_founding_year": str(city_years[i])},
            {"country": country0 + city_country[i]},
        )
    for i, name in enumerate(people):
        attributes = {"birth_year": str(birth_years[i]), "occupation": occupations[i]}
        add(Kind.PERSON, name, attributes, {"born_in": city0 + born_in[i], "member_of": org0 + member_of[i]})
    for i, name in enumerate(orgs):
        relations = {"founder": person0 + founders[i], "based_in": city0 + org_cities[i]}
        add(Kind.ORGANISATION, name, {"founding_year": str(org_years[i])}, relations)
    for i, name in enumerate(works):
        attributes = {"genre": genres[i], "publication_year": str(work_years[i])}
        add(Kind.WORK, name, attributes, {"author": person0 + authors[i], "publisher": org0 + publishers[i]})
    assert len(entities) == work0 + cfg.num_works
    _add_namesakes(cfg, entities, names, add)
    return tuple(entities)


def _add_namesakes(cfg: WorldConfig, entities: list[Entity], names: NameWords, add) -> None:
    """Appends the namesakes (`WorldConfig.distractors`): same kind, one name word shared, like facts.

    They draw from their own stream, after every other name, so the rest of the world is the same
    with or without them.
    """
    if not any(cfg.num_namesakes):
        return
    rng = random.Random(f"{cfg.seed}:namesakes")
    by_kind = {kind: [e for e in entities if e.kind is kind] for kind in Kind}
    cities_in = {}
    for city in by_kind[Kind.CITY]:
        cities_in.setdefault(city.relations["country"], []).append(city.index)

    def near_city(city: int) -> int:  # another city of the same country when it has one
        same = [c for c in cities_in[entities[city].relations["country"]] if c != city]
        return rng.choice(same) if same else city

    def other(kind: Kind, index: int) -> int:
        return rng.choice([e.index for e in by_kind[kind] if e.index != index])

    kinds = (Kind.PERSON, Kind.ORGANISATION, Kind.WORK)
    for kind, count in zip(kinds, cfg.num_namesakes, strict=True):
        for original in rng.sample(by_kind[kind], count):
            a, r = dict(original.attributes), dict(original.relations)
            if kind is Kind.PERSON:
                first, last = original.name.split(" ")
                new = names.draw(2, 2)
                name = f"{first} {new}" if rng.random() < 0.5 else f"{new} {last}"
                a["birth_year"] = str(int(a["birth_year"]) + rng.randint(-10, 10))
                r = {
                    "born_in": near_city(r["born_in"]),
                    "member_of": other(Kind.ORGANISATION, r["member_of"]),
                }
            elif kind is Kind.ORGANISATION:
                word, org_type = original.name.split(" ")
                name = f"{word} {rng.choice([t for t in _ORG_TYPES if t != org_type])}"
                founder = other(Kind.PERSON, r["founder"])
                a["founding_year"] = str(
                    int(entities[founder].attributes["birth_year"]) + rng.randint(25, 60)
                )
                r = {"founder": founder, "based_in": near_city(r["based_in"])}
            else:
                noun = original.name.split(" ")[1]
                name = original.name.replace(
                    f"The {noun} of", f"The {rng.choice([n for n in _TITLE_NOUNS if n != noun])} of"
                )
                author = other(Kind.PERSON, r["author"])
                year = max(
                    int(entities[author].attributes["birth_year"]) + rng.randint(20, 70),
                    int(entities[r["publisher"]].attributes["founding_year"]) + 1,
                )
                a["publication_year"] = str(year)
                r = {"author": author, "publisher": r["publisher"]}
            # Unique by construction: each original is drawn once and its own words are unique.
            assert all(e.name != name for e in entities), name
            add(kind, name, a, r)


def _with_article(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _capitalise(sentence: str) -> str:
    return sentence[0].upper() + sentence[1:]


def render_passage(entity: Entity, entities: tuple[Entity, ...], *, seed: int) -> str:
    """Returns the passage of `entity`: its name on the first line, then its sentences.

    Args:
        entity: whose passage.
        entities: the whole world (to name related entities).
        seed: world seed; each passage draws its wording from its own stream.

    Returns:
        "Name\\nSentence. Sentence. ..." (Search-R1 corpus layout: title line, then text).
    """
    rng = random.Random(f"{seed}:passage:{entity.index}")
    values = {"n": entity.mention, "feature": rng.choice(_FEATURES), **entity.attributes}
    for name in ("occupation", "genre"):
        if name in values:
            values[f"a_{name}"] = _with_article(values[name])
    for relation, target in entity.relations.items():
        values[relation] = entities[target].mention
    sentences = [_capitalise(rng.choice(pair).format(**values)) for pair in _PASSAGE_TEMPLATES[entity.kind]]
    if entity.kind is Kind.CITY:
        country = entities[entity.relations["country"]]
        if entities[country.relations["capital"]].index == entity.index:
            sentences.insert(1, _capitalise(_CAPITAL_SENTENCE.format(**values)))
    return f"{entity.name}\n{' '.join(sentences)}"
