"""Multi-hop questions composed by following relation chains through the synthetic world.

A k-hop question starts at an entity S, follows k-1 relations to bridging entities e1 .. e(k-1),
and asks one last relation or attribute of e(k-1). The agent must search S (its passage names e1),
then e1, ... then e(k-1) (whose passage holds the answer): k searches. For example (3 hops):

    "In which city was the founder of the organisation that published The Bells of Tovar born?"
    gold_queries  = ("The Bells of Tovar", "Drima Press", "Kelo Varndi")
    gold_entities = ("Drima Press",        "Kelo Varndi", "Sathimor")      # last = the answer

A sampled chain is kept only if it has no shortcut: all its entities are distinct, and nothing that
hop j yields (gold_entities[j], the answer included) appears, as a whole word, in the question or in
the passage of any earlier hop. So a multi-hop answer is never in the first passage, and each hop
needs the one before it.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence

from treegrpo_jax.data.synthetic_entities import ATTRIBUTES, LINKS, Entity, Kind

__all__ = ["QuestionChain", "compose_questions"]

# Noun phrases for a relation applied to an inner phrase {x}. The first variant reads well around
# a nested phrase ("the founder of the publisher of ..."); the others are relative clauses, used only
# around a bare name so that clauses never stack up inside each other.
_LINK_PHRASES: dict[str, tuple[str, ...]] = {
    "born_in": ("the birthplace of {x}", "the city where {x} was born"),
    "member_of": ("the organisation joined by {x}", "the organisation that {x} belonged to"),
    "founder": ("the founder of {x}", "the person who founded {x}"),
    "based_in": ("the home city of {x}", "the city where {x} is based"),
    "author": ("the author of {x}", "the writer of {x}"),
    "publisher": ("the publisher of {x}", "the organisation that published {x}"),
    "country": ("the country of {x}", "the country where {x} lies"),
    "capital": ("the capital of {x}", "the capital city of {x}"),
}
# Questions asking a relation or an attribute of the phrase {x}.
_QUESTIONS: dict[str, tuple[str, ...]] = {
    "born_in": ("In which city was {x} born?", "Where was {x} born?"),
    "member_of": ("Which organisation was {x} a member of?", "Which organisation did {x} belong to?"),
    "founder": ("Who founded {x}?", "Who was the founder of {x}?"),
    "based_in": ("In which city is {x} based?", "Where is {x} headquartered?"),
    "author": ("Who wrote {x}?", "Who is the author of {x}?"),
    "publisher": ("Which organisation published {x}?", "Who published {x}?"),
    "country": ("In which country is {x}?", "Which country is {x} in?"),
    "capital": ("What is the capital of {x}?", "Which city is the capital of {x}?"),
    "birth_year": ("In what year was {x} born?", "When was {x} born?"),
    "occupation": ("What was the occupation of {x}?", "What did {x} work as?"),
    "founding_year": ("In what year was {x} founded?", "When was {x} founded?"),
    "genre": ("What is the genre of {x}?", "What kind of work is {x}?"),
    "publication_year": ("In what year was {x} published?", "When was {x} published?"),
    "city_founding_year": ("In what year was {x} founded?", "When was {x} founded?"),
    "established_year": ("In what year was {x} established?", "When was {x} established?"),
}
_LINKS_FROM: dict[Kind, tuple[str, ...]] = {
    kind: tuple(name for name, (source, _) in LINKS.items() if source is kind) for kind in Kind
}
_ASKABLE_OF: dict[Kind, tuple[str, ...]] = {
    kind: _LINKS_FROM[kind] + tuple(name for name, owner in ATTRIBUTES.items() if owner is kind)
    for kind in Kind
}
# Sampling stops after this many draws per requested question, then reports a shortfall.
_DRAWS_PER_QUESTION = 200


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuestionChain:
    """A composed question before it becomes a `QARow`.

    Attributes:
        question: the question text.
        answer: the single gold answer (an entity name or an attribute value).
        hops: searches needed.
        gold_queries: entity name to search at each hop.
        gold_entities: what each hop yields (bridging entity names, then the answer).
        path: (start entity index, relation names...), the identity used to avoid duplicates.
    """

    question: str
    answer: str
    hops: int
    gold_queries: tuple[str, ...]
    gold_entities: tuple[str, ...]
    path: tuple[int | str, ...]


def _mentions(text: str, phrase: str) -> bool:
    """Whole-word, case-insensitive containment (so "1823" does not match inside "18234")."""
    return re.search(rf"(?<!\w){re.escape(phrase.lower())}(?!\w)", text.lower()) is not None


def _draw_chain(
    rng: random.Random, hops: int, entities: Sequence[Entity], passages: Sequence[str]
) -> QuestionChain | None:
    """Draws one random chain of `hops` hops; None if it has a cycle or a shortcut."""
    start = entities[rng.randrange(len(entities))]
    chain = [start]
    relations: list[str] = []
    for _ in range(hops - 1):
        links = _LINKS_FROM[chain[-1].kind]
        if not links:
            return None
        relation = rng.choice(links)
        relations.append(relation)
        chain.append(entities[chain[-1].relations[relation]])
    last = rng.choice(_ASKABLE_OF[chain[-1].kind])
    if last in LINKS:
        answer_entity = entities[chain[-1].relations[last]]
        answer = answer_entity.name
        visited = [*chain, answer_entity]
    else:
        answer = chain[-1].attributes[last]
        visited = chain
    if len({e.index for e in visited}) != len(visited):
        return None  # a cycle (e.g. the capital of the country of a capital) answers itself

    phrase = start.mention
    for depth, relation in enumerate(relations):
        variants = _LINK_PHRASES[relation] if depth == 0 else _LINK_PHRASES[relation][:1]
        phrase = rng.choice(variants).format(x=phrase)
    question = rng.choice(_QUESTIONS[last]).format(x=phrase)

    gold_queries = tuple(e.name for e in chain)
    gold_entities = (*gold_queries[1:], answer)
    for j, found in enumerate(gold_entities):
        earlier = [question] + [passages[e.index] for e in chain[:j]]
        if any(_mentions(text, found) for text in earlier):
            return None
    return QuestionChain(
        question=question,
        answer=answer,
        hops=hops,
        gold_queries=gold_queries,
        gold_entities=gold_entities,
        path=(start.index, *relations, last),
    )


def compose_questions(
    entities: Sequence[Entity], passages: Sequence[str], counts: Sequence[int], *, seed: int
) -> list[list[QuestionChain]]:
    """Composes distinct questions for each hop count.

    Args:
        entities: the world's entities.
        passages: passage text per entity (same order), used for the shortcut checks.
        counts: counts[h - 1] questions of h hops.
        seed: world seed; each hop count draws from its own stream.

    Returns:
        For each hop count, its questions in draw order.

    Raises:
        ValueError: if the world is too small to give that many distinct questions of some hop count.
    """
    out: list[list[QuestionChain]] = []
    for hops, count in enumerate(counts, start=1):
        rng = random.Random(f"{seed}:questions:{hops}")
        seen_paths: set[tuple[int | str, ...]] = set()
        seen_questions: set[str] = set()
        chains: list[QuestionChain] = []
        for _ in range(_DRAWS_PER_QUESTION * count):
            if len(chains) == count:
                break
            chain = _draw_chain(rng, hops, entities, passages)
            # One logical question once: rewordings of the same path would leak between train and test.
            if chain is None or chain.path in seen_paths or chain.question in seen_questions:
                continue
            seen_paths.add(chain.path)
            seen_questions.add(chain.question)
            chains.append(chain)
        if len(chains) < count:
            raise ValueError(
                f"WorldConfig.questions_per_hop: found only {len(chains)} distinct {hops}-hop questions of "
                f"{count} asked; ask fewer or add entities"
            )
        out.append(chains)
    return out
