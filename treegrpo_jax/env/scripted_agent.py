"""Scripted demonstrations for the cold-start SFT of the embedded default (docs/DESIGN.md §2).

A scripted agent answers synthetic-world questions by following each row's gold search path: per
hop one step ``<think> a few words </think>\\n<search> entity </search>``, answered by the *real*
retriever through `format_observation` (the very text the rollout shows), then a final
``<think> ... </think>\\n<answer> answer </answer>``. When the searches reach
``ScriptConfig.max_tool_calls`` the observation text ends with `PromptConfig.forced_answer` (one
observation segment, tokenized as one), as in a rollout, and a plan that needed more searches is cut
there and answers with what it has found.

Deliberate imperfection gives RL something to fix. Each demonstration draws at most one `Mistake`
(the rates are the probabilities of each kind). Every random choice comes from a stream seeded by
``(seed, row id)``, so a row's demonstration does not depend on the other rows in the batch, except
that a GUESS picks its wrong answer among the answers of the rows passed in:

=================  ===========================================================  ======
mistake            what the script does                                         reward
=================  ===========================================================  ======
NONE               follows the gold path                                        1.0
WRONG_ANSWER       stops after hop j < k and answers that hop's bridging        0.2
                   entity (1-hop: answers the entity it searched)
MISSPELLED_QUERY   searches one hop misspelled, then searches it correctly      1.0
SKIP_THINK         one step has no think block (malformed, answer right)        0.8
GUESS              answers at once without searching (another row's answer)     0.2
=================  ===========================================================  ======

(within the tool-call limit; a plan cut by the limit answers a bridging entity: 0.2 or 0.1.)

Tokenization (`tokenize_demonstration`) is segment by segment, as the rollout does it: the prompt
(user message in the chat template) with loss mask 0, each generated step with mask 1, each
observation with mask 0 — never re-tokenizing the concatenated text. No EOS follows the final
answer: the rollout ends a step at the ``</answer>`` stop string, so the model never has to emit one.

Recipe for the tiny setup (the tokenizer does not exist yet when its training text is made, so the
first pass formats observations with `CharTokenizer`)::

    bm25 = BM25Retriever.from_texts(world.passages)
    draft = make_demonstrations(world.train, retriever=bm25, tokenizer=CharTokenizer(), cfg=cfg)
    tok = train_bpe_tokenizer([*world.passages, *(d.transcript() for d in draft)], vocab_size=2048)
    demos = make_demonstrations(world.train, retriever=bm25, tokenizer=tok, cfg=cfg)
    spans = [tokenize_demonstration(d, tok).spans for d in demos]   # -> rl.sft.demonstration_row
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from treegrpo_jax.env.actions import ActionKind
from treegrpo_jax.env.observation import ObservationConfig, TokenizerLike, format_observation
from treegrpo_jax.env.prompt import PromptConfig, PromptTokenizer, prompt_ids
from treegrpo_jax.env.retrieval import Retriever
from treegrpo_jax.env.rewards import em, score_trajectory
from treegrpo_jax.validation import check_int

__all__ = [
    "CharTokenizer",
    "DemoStep",
    "Demonstration",
    "Mistake",
    "ScriptConfig",
    "TokenizedDemonstration",
    "make_demonstrations",
    "read_demonstrations",
    "tokenize_demonstration",
    "write_demonstrations",
]

if TYPE_CHECKING:  # env/ does not import data/ at run time; rows are only read.
    from treegrpo_jax.data.rows import QARow

# A few phrasings per situation: enough variety that the model learns the pattern, not one string.
_FIRST = ("I need to look up {q} first.", "The question starts from {q}. Let me search for it.")
# With the row's relation per hop (synthetic world), the first think lays out the plan, innermost
# relation first ("I need the author of X, then the birthplace, then the country."), and each later
# think names what the next passage must give. The step that reads a passage then sits next to the
# words saying which fact to take, and whether to stop is a look-up in the plan (is the relation just
# resolved followed by ", then ..."?) instead of a fresh parse of the nested question.
_FIRST_REL = ("I need {r} of {q}{rest}.", "First I need {r} of {q}{rest}.")
_NEXT_REL = ("{R} of {p} is {found}. Now I need {r} of {q}.",)
_FINAL_REL = ("{R} of {q} is {a}.",)
# The noun phrase of each synthetic-world relation or attribute (`QARow.gold_relations`).
_RELATION_NOUNS = {
    "born_in": "the birthplace",
    "member_of": "the organisation",
    "founder": "the founder",
    "based_in": "the home city",
    "author": "the author",
    "publisher": "the publisher",
    "country": "the country",
    "capital": "the capital",
    "birth_year": "the birth year",
    "occupation": "the occupation",
    "founding_year": "the founding year",
    "genre": "the genre",
    "publication_year": "the publication year",
    "city_founding_year": "the founding year",
    "established_year": "the founding year",
}
_NEXT = ("The passage names {found}. Next I look up {q}.", "That leads to {found}. Now search for {q}.")
_FINAL = ("The passage gives the answer: {a}.", "So the answer is {a}.")
_RETRY = ("I misspelled that name. Search for {q} again.", "That query had a typo. Let me search {q}.")
_GUESS = ("I think I know this without searching: {a}.",)
_FORCED = ("No searches left. My best answer is {a}.",)


class Mistake(enum.Enum):
    """The deliberate imperfection a demonstration carries (see the module docstring)."""

    NONE = "none"
    WRONG_ANSWER = "wrong_answer"
    MISSPELLED_QUERY = "misspelled_query"
    SKIP_THINK = "skip_think"
    GUESS = "guess"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScriptConfig:
    """How the scripted agent behaves.

    Attributes:
      seed: with the row id, seeds everything random about a demonstration.
      wrong_answer_rate: probability of `Mistake.WRONG_ANSWER`.
      misspelled_query_rate: probability of `Mistake.MISSPELLED_QUERY`.
      skip_think_rate: probability of `Mistake.SKIP_THINK`.
      guess_rate: probability of `Mistake.GUESS`.
      top_k: passages per search.
      max_tool_calls: the rollout's search limit (docs/DESIGN.md §1 uses 3; the synthetic world has
        questions of up to 4 hops, hence 4 here).
    """

    seed: int = 0
    wrong_answer_rate: float = 0.1
    misspelled_query_rate: float = 0.1
    skip_think_rate: float = 0.05
    guess_rate: float = 0.05
    top_k: int = 3
    max_tool_calls: int = 4

    def __post_init__(self):
        for mistake, rate in self.rates().items():
            if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
                raise ValueError(
                    f"ScriptConfig.{mistake.value}_rate must be a number in [0, 1], got {rate!r}"
                )
        if sum(self.rates().values()) > 1.0 + 1e-9:
            raise ValueError(f"ScriptConfig: the mistake rates sum to {sum(self.rates().values())} > 1")
        for name in ("top_k", "max_tool_calls"):
            check_int(f"ScriptConfig.{name}", getattr(self, name), 1)

    def rates(self) -> dict[Mistake, float]:
        """Probability of each mistake, in the order they are drawn."""
        return {
            Mistake.WRONG_ANSWER: self.wrong_answer_rate,
            Mistake.MISSPELLED_QUERY: self.misspelled_query_rate,
            Mistake.SKIP_THINK: self.skip_think_rate,
            Mistake.GUESS: self.guess_rate,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoStep:
    """One agent step of a demonstration.

    Attributes:
      generated: the model's text (think block, then one action tag).
      observation: what the environment appended ("" after the final answer).
      action: the intended action (`parse_action(generated)` gives it).
      content: the intended query or answer text.
    """

    generated: str
    observation: str
    action: ActionKind
    content: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Demonstration:
    """A scripted trajectory for one question, scored with the training reward.

    Attributes:
      id, question, data_source, hops, golden_answers: from the row.
      prompt: the user message (`PromptConfig.render`), before any chat template.
      steps: the agent steps in order; the last one answers.
      answer: the final answer given.
      mistake: the imperfection drawn for this demonstration.
      hit_tool_limit: the searches reached `max_tool_calls` (the forced-answer text was shown).
      reward: `env.rewards` training reward of the generated steps.
      correct: the answer matches a gold answer (EM).
      well_formed: the whole-trajectory format check passed.
    """

    id: str
    question: str
    data_source: str
    hops: int
    golden_answers: tuple[str, ...]
    prompt: str
    steps: tuple[DemoStep, ...]
    answer: str
    mistake: Mistake
    hit_tool_limit: bool
    reward: float
    correct: bool
    well_formed: bool

    @property
    def generated_steps(self) -> list[str]:
        """The model-generated texts, the input form of `env.rewards`."""
        return [s.generated for s in self.steps]

    def transcript(self) -> str:
        """Prompt, then every step's generated text and observation, concatenated (no chat template)."""
        return self.prompt + "".join(s.generated + s.observation for s in self.steps)

    def to_json_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (enums as their values)."""
        out = dataclasses.asdict(self)
        out["golden_answers"] = list(self.golden_answers)
        out["mistake"] = self.mistake.value
        out["steps"] = [{**dataclasses.asdict(s), "action": s.action.value} for s in self.steps]
        return out

    @classmethod
    def from_json_dict(cls, record: dict[str, Any]) -> Demonstration:
        """Inverse of `to_json_dict`."""
        steps = tuple(DemoStep(**{**s, "action": ActionKind(s["action"])}) for s in record["steps"])
        return cls(
            **{
                **record,
                "golden_answers": tuple(record["golden_answers"]),
                "mistake": Mistake(record["mistake"]),
                "steps": steps,
            }
        )


class CharTokenizer:
    """One token per character: a `TokenizerLike` for making demonstration text before a BPE
    tokenizer exists (observation budgets then count characters)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)  # no BOS

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Planned:
    think: str | None  # None: the step skips its think block.
    action: ActionKind
    content: str
    found: str | None = None  # What a search's passage yields (None for a misspelled query).

    def text(self) -> str:
        tag = self.action.value
        head = f"<think> {self.think} </think>\n" if self.think is not None else ""
        return f"{head}<{tag}> {self.content} </{tag}>"


def _misspell(name: str, rng: random.Random) -> str:
    """Drops or swaps an inner letter of every word of 4+ letters, so BM25 (which matches whole
    words) no longer finds the entity by any of its distinctive words."""
    words = name.split(" ")
    for w, word in enumerate(words):
        if len(word) >= 4 and word.isalpha():
            i = rng.randrange(1, len(word) - 2)
            words[w] = (
                word[:i] + word[i + 1 :]
                if rng.random() < 0.5
                else word[:i] + word[i + 1] + word[i] + word[i + 2 :]
            )
    out = " ".join(words)
    return out if out.lower() != name.lower() else name + name[-1]


def _draw_mistake(rng: random.Random, cfg: ScriptConfig) -> Mistake:
    u, edge = rng.random(), 0.0
    for mistake, rate in cfg.rates().items():
        edge += rate
        if u < edge:
            return mistake
    return Mistake.NONE


def _plan(
    row: QARow, mistake: Mistake, rng: random.Random, cfg: ScriptConfig, guesses: Sequence[str]
) -> list[_Planned]:
    """The steps of one demonstration (the last answers); observations come later."""
    queries, found, gold = row.gold_queries, row.gold_entities, row.golden_answers[0]
    nouns = _relation_nouns(row)

    def first(i: int) -> str:
        if nouns is None:
            return rng.choice(_FIRST).format(q=queries[i])
        rest = "".join(f", then {noun}" for noun in nouns[i + 1 :])
        return rng.choice(_FIRST_REL).format(r=nouns[i], q=queries[i], rest=rest)

    def bridge(i: int) -> str:  # the think before searching hop i > 0
        if nouns is None:
            return rng.choice(_NEXT).format(found=found[i - 1], q=queries[i])
        r_prev = nouns[i - 1]
        return rng.choice(_NEXT_REL).format(
            R=r_prev[0].upper() + r_prev[1:], p=queries[i - 1], found=found[i - 1], r=nouns[i], q=queries[i]
        )

    def final(i: int, a: str) -> str:  # the answer step after reading hop i's passage
        if nouns is None:
            return rng.choice(_FINAL).format(a=a)
        r = nouns[i]
        return rng.choice(_FINAL_REL).format(R=r[0].upper() + r[1:], q=queries[i], a=a)

    searches = []
    for i, (q, f) in enumerate(zip(queries, found, strict=True)):
        think = first(i) if i == 0 else bridge(i)
        searches.append(_Planned(think=think, action=ActionKind.SEARCH, content=q, found=f))
    answer, think = gold, final(len(queries) - 1, gold)
    if mistake is Mistake.WRONG_ANSWER:
        j = rng.randrange(len(queries) - 1) if len(queries) > 1 else 0
        searches = searches[: j + 1]
        # 1 hop: no bridging entity to stop at, so the agent mistakes the subject for the answer.
        answer = found[j] if len(queries) > 1 else queries[0]
        think = final(j, answer) if len(queries) > 1 else rng.choice(_FINAL).format(a=answer)
    elif mistake is Mistake.MISSPELLED_QUERY:
        i = rng.randrange(len(queries))
        typo = dataclasses.replace(searches[i], content=_misspell(queries[i], rng), found=None)
        searches[i] = dataclasses.replace(searches[i], think=rng.choice(_RETRY).format(q=queries[i]))
        searches.insert(i, typo)
    elif mistake is Mistake.GUESS:
        # Another row's answer of the same kind (a year for a year), never one that is right here.
        pool = [g for g in guesses if g.isdigit() == gold.isdigit() and not em(g, row.golden_answers)]
        answer = rng.choice(pool) if pool else queries[0]
        searches, think = [], rng.choice(_GUESS).format(a=answer)
    if len(searches) > cfg.max_tool_calls:
        # As in a rollout: after the last allowed search only an answer is accepted.
        searches = searches[: cfg.max_tool_calls]
        known = [s.found for s in searches if s.found is not None]
        answer = known[-1] if known else queries[0]
        think = rng.choice(_FORCED).format(a=answer)
    steps = [*searches, _Planned(think=think, action=ActionKind.ANSWER, content=answer)]
    if mistake is Mistake.SKIP_THINK:
        k = rng.randrange(len(steps))
        steps[k] = dataclasses.replace(steps[k], think=None)
    return steps


def _relation_nouns(row: QARow) -> tuple[str, ...] | None:
    """The noun phrase of each hop's relation, or None when the row does not name them all."""
    relations = getattr(row, "gold_relations", ())
    if len(relations) != len(row.gold_queries) or any(r not in _RELATION_NOUNS for r in relations):
        return None
    return tuple(_RELATION_NOUNS[r] for r in relations)


def _check_row(row: QARow) -> None:
    hops = row.hops or 0
    if hops < 1 or len(row.gold_queries) != hops or len(row.gold_entities) != hops:
        raise ValueError(f"row {row.id!r}: scripted demonstrations need hops and a gold path of that length")


def make_demonstrations(
    rows: Sequence[QARow],
    *,
    retriever: Retriever,
    tokenizer: TokenizerLike,
    cfg: ScriptConfig,
    prompt: PromptConfig | None = None,
    observation: ObservationConfig | None = None,
) -> list[Demonstration]:
    """Scripts one demonstration per row (deterministic given `cfg.seed` and the rows).

    Args:
      rows: questions with a gold path (`hops`, `gold_queries`, `gold_entities`), e.g. `World.train`.
      retriever: the retriever the rollout uses (BM25 over the world's passages); every query is
        sent in one batch.
      tokenizer: the policy's tokenizer; observation budgets are counted in its tokens.
      cfg: mistake rates, top-k, tool-call limit.
      prompt: prompt template and forced-answer text; default `PromptConfig()`.
      observation: observation budgets; default `ObservationConfig()`.

    Returns:
      The demonstrations, in row order.

    Raises:
      ValueError: for a row without a gold path.
    """
    prompt = prompt or PromptConfig()
    observation = observation or ObservationConfig()
    guesses = sorted({a for row in rows for a in row.golden_answers})
    plans = []
    for row in rows:
        _check_row(row)
        rng = random.Random(f"{cfg.seed}:{row.id}")
        mistake = _draw_mistake(rng, cfg)
        plans.append((row, mistake, _plan(row, mistake, rng, cfg, guesses)))
    queries = sorted({p.content for _, _, plan in plans for p in plan if p.action is ActionKind.SEARCH})
    # One observation per distinct query: the same entity is searched by many questions, and
    # formatting (several encodes to fit the budgets) costs more than retrieval.
    observations = {
        q: format_observation(result, tokenizer=tokenizer, cfg=observation)
        for q, result in zip(queries, retriever.search(queries, cfg.top_k), strict=True)
    }
    return [_assemble(row, mistake, plan, observations, cfg, prompt) for row, mistake, plan in plans]


def _assemble(
    row: QARow,
    mistake: Mistake,
    plan: list[_Planned],
    observations: Mapping[str, str],
    cfg: ScriptConfig,
    prompt: PromptConfig,
) -> Demonstration:
    steps, searches = [], 0
    for p in plan:
        obs = ""
        if p.action is ActionKind.SEARCH:
            searches += 1
            obs = observations[p.content]
            if searches == cfg.max_tool_calls:
                obs += prompt.forced_answer
        steps.append(DemoStep(generated=p.text(), observation=obs, action=p.action, content=p.content))
    score = score_trajectory([s.generated for s in steps], row.golden_answers)
    return Demonstration(
        id=row.id,
        question=row.question,
        data_source=row.data_source,
        hops=row.hops,
        golden_answers=tuple(row.golden_answers),
        prompt=prompt.render(row.question),
        steps=tuple(steps),
        answer=plan[-1].content,
        mistake=mistake,
        hit_tool_limit=searches == cfg.max_tool_calls,
        reward=score.reward,
        correct=score.correct,
        well_formed=score.well_formed,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizedDemonstration:
    """A demonstration as token spans: ``(ids, trained)`` for the prompt, then each step's generated
    text (trained) and observation (not trained; omitted when empty). The input of
    `rl.sft.demonstration_row`."""

    spans: tuple[tuple[tuple[int, ...], bool], ...]

    @property
    def tokens(self) -> list[int]:
        """All ids in order."""
        return [t for ids, _ in self.spans for t in ids]

    @property
    def loss_mask(self) -> list[int]:
        """1 on model-generated ids, 0 on prompt and observation ids."""
        return [int(trained) for ids, trained in self.spans for _ in ids]


def tokenize_demonstration(
    demo: Demonstration, tokenizer: PromptTokenizer, *, chat: bool = True
) -> TokenizedDemonstration:
    """Tokenizes each segment on its own, as the rollout does (token-in / token-out).

    Args:
      demo: the demonstration.
      tokenizer: the policy's tokenizer: the prompt goes through `prompt_ids` (BOS once), every
        step and observation through ``encode`` (nothing added), exactly as in a rollout.
      chat: wrap the prompt in the chat template (see `prompt_text`).

    Returns:
      The spans; no EOS is appended after the final answer (the ``</answer>`` stop string ends it).
    """
    spans = [(tuple(prompt_ids(demo.prompt, tokenizer, chat=chat)), False)]
    for step in demo.steps:
        spans.append((tuple(tokenizer.encode(step.generated)), True))
        if step.observation:
            spans.append((tuple(tokenizer.encode(step.observation)), False))
    return TokenizedDemonstration(spans=tuple(spans))


def write_demonstrations(demos: Sequence[Demonstration], path: str | os.PathLike[str]) -> None:
    """Writes one JSON object per line (UTF-8, fixed key order: the bytes depend on the inputs only)."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for demo in demos:
            f.write(json.dumps(demo.to_json_dict(), ensure_ascii=False) + "\n")


def read_demonstrations(path: str | os.PathLike[str]) -> list[Demonstration]:
    """Reads what `write_demonstrations` wrote."""
    with open(path, encoding="utf-8") as f:
        return [Demonstration.from_json_dict(json.loads(line)) for line in f if line.strip()]
