"""Hostile model output, played through the real rollout: cases, a runner, and the checks.

Each `HostileCase` is a token script that a bigram model (`testing.bigram`) emits greedily
at every step: runaway steps that hit the per-step cap, thousands of tags, enormous queries
and answers, bytes that are not valid UTF-8 after detokenisation, stop strings inside a
query or split across byte tokens, EOS mid-action, control characters. `HostileRig` runs a
case through `tree_search.rollout` (real engine, stop table, parser, retriever,
observations) and `check` lists what went wrong: a crash, an unbounded query or step, a
tree without leaves, or a classification counter that did not move.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import jax

from treegrpo_jax.data.rows import QARow
from treegrpo_jax.data.synthetic_entities import WorldConfig
from treegrpo_jax.data.synthetic_world import build_world
from treegrpo_jax.env.actions import DEFAULT_PARSER, STOP_SEQUENCES
from treegrpo_jax.env.bm25 import BM25Retriever
from treegrpo_jax.env.observation import ObservationConfig
from treegrpo_jax.env.prompt import PromptConfig
from treegrpo_jax.env.retrieval import Retriever
from treegrpo_jax.model.bpe_train import EOS_TOKEN, train_bpe_tokenizer
from treegrpo_jax.model.tokenizer import Tokenizer
from treegrpo_jax.rollout.agent import AgentConfig, AgentEnv
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.stops import make_stop_table, token_bytes
from treegrpo_jax.rollout.tree import Tree
from treegrpo_jax.rollout.tree_search import RolloutStats, TreeSearchConfig, rollout
from treegrpo_jax.testing.bigram import bigram_config, bigram_model, set_successors, successor_table

_WORD = re.compile(r"^ ?[a-z]{3,}$")


@dataclasses.dataclass(frozen=True)
class Words:
    """`n` distinct word tokens (each a whole vocabulary entry, never a single byte)."""

    n: int


Piece = str | bytes | Words  # str: tokenized text (our tags are atomic); bytes: one byte token each


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostileCase:
    """One hostile step, repeated at every step of every trajectory.

    Attributes:
      name: short id.
      script: the pieces the model emits, in order.
      loop_last: the last token repeats until a cap stops the step.
      expect: `RolloutStats.as_dict()` keys that must be ≥ 1 (the output was classified).
      forbid: keys that must stay 0.
    """

    name: str
    script: tuple[Piece, ...]
    loop_last: bool = False
    expect: tuple[str, ...] = ()
    forbid: tuple[str, ...] = ()


CASES: tuple[HostileCase, ...] = (
    HostileCase(
        name="step_cap",
        script=(Words(1),),
        loop_last=True,
        expect=("capped_steps", "invalid_no_action"),
    ),
    HostileCase(
        name="thousands_of_tags",
        script=("<search>",),
        loop_last=True,
        expect=("capped_steps", "invalid_unclosed_tag"),
        forbid=("tool_calls",),
    ),
    HostileCase(
        name="thousands_of_closing_tags",
        script=("</search>",),  # every step stops at once: a closing tag without an opening one
        expect=("invalid_no_action",),
        forbid=("tool_calls",),
    ),
    HostileCase(
        name="enormous_query",
        script=("<search>", Words(300), "</search>"),
        expect=("clipped_actions", "tool_calls"),
    ),
    HostileCase(
        name="enormous_answer",
        script=("<answer>", Words(300), "</answer>"),
        expect=("clipped_actions",),
        forbid=("tool_calls",),
    ),
    HostileCase(
        name="invalid_utf8_query",
        script=("<search>", b"\xf0\x9f", Words(1), b"\xe2", "</search>"),
        expect=("undecodable_steps", "tool_calls"),
    ),
    HostileCase(
        name="invalid_utf8_runaway",
        script=(b"\xc3",),  # a lead byte, forever: never a character
        loop_last=True,
        expect=("undecodable_steps", "capped_steps"),
    ),
    HostileCase(
        name="stop_string_inside_query",
        script=("<search>", Words(2), "</answer>", Words(1), "</search>"),
        expect=("invalid_unclosed_tag",),  # the engine stops at "</answer>"
        forbid=("tool_calls",),
    ),
    HostileCase(
        name="stop_string_split_into_bytes",
        script=("<search>", Words(1), b"</search>"),  # nine byte tokens: matched on bytes
        expect=("tool_calls",),
        forbid=("capped_steps", "invalid_unclosed_tag"),
    ),
    HostileCase(
        name="eos_mid_action",
        script=("<search>", Words(1), EOS_TOKEN),
        expect=("invalid_unclosed_tag",),
        forbid=("capped_steps",),
    ),
    HostileCase(
        name="nested_tags",
        script=("<answer>", "<search>", Words(1), "</search>", "</answer>"),
        expect=("tool_calls",),
    ),
    HostileCase(
        name="control_characters",
        script=("<search>", b"\x00\x1b[2J\x07", Words(1), "</search>"),
        expect=("tool_calls",),
    ),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostileResult:
    name: str
    crashed: str | None  # the exception, if the rollout raised
    problems: tuple[str, ...]  # broken bounds or classifications (empty: all good)
    stats: dict[str, float]


def _texts() -> list[str]:
    world = build_world(
        WorldConfig(
            seed=7,
            num_people=80,
            num_cities=20,
            num_countries=5,
            num_organisations=15,
            num_works=30,
            questions_per_hop=(4, 4, 0, 0),
        )
    )
    return list(world.passages) * 2


class HostileRig:
    """Tokenizer, retriever and one engine, built once; `run` swaps in each case's weights.

    Args:
      retriever: defaults to BM25 over a small synthetic world (pass an `HttpRetriever`
        behind a chaos proxy to combine both kinds of trouble).
      agent: step limits; the default allows 2048-token steps (thousands of tags).
      tree: tree shape (default M=2, N=1, L=1).
    """

    def __init__(
        self,
        *,
        retriever: Retriever | None = None,
        agent: AgentConfig | None = None,
        tree: TreeSearchConfig | None = None,
        context_len: int = 6144,
    ):
        texts = _texts()
        self.tokenizer: Tokenizer = train_bpe_tokenizer(texts, vocab_size=1024)
        self.retriever = retriever or BM25Retriever.from_texts(texts[:200])
        self.agent = agent or AgentConfig(max_tool_calls=2, max_turns=3, max_step_tokens=2048, top_k=2)
        self.tree = tree or TreeSearchConfig(num_trees=2, num_picks=1, num_rounds=1)
        self.env = AgentEnv(
            tokenizer=self.tokenizer,
            retriever=self.retriever,
            prompt=PromptConfig(),
            observation=ObservationConfig(passage_tokens=40, max_tokens=96),
        )
        tok = self.tokenizer
        self.cfg = bigram_config(tok.vocab_size, max_len=context_len, eos_ids=tok.eos_ids)
        table = make_stop_table(token_bytes(tok), STOP_SEQUENCES, vocab_size=tok.vocab_size)
        self.model = bigram_model(self.cfg, {}, default=0)
        self.engine = Engine(
            self.model,
            num_slots=self.tree.leaves_per_prompt,
            max_len=context_len,
            eos_ids=tok.eos_ids,
            stop_table=table,
        )
        self._words = [i for i in range(tok.vocab_size) if _WORD.match(tok.decode([i]))]
        self._byte_ids: dict[int, int] = {}  # byte value → the id of the token that is that byte
        for i, raw in enumerate(token_bytes(tok)):
            if len(raw) == 1:
                self._byte_ids.setdefault(raw[0], i)

    def script_ids(self, case: HostileCase) -> list[int]:
        """The case's token ids (Words draw fresh, distinct word tokens in order)."""
        ids: list[int] = []
        words = iter(self._words)
        for piece in case.script:
            if isinstance(piece, Words):
                ids += [next(words) for _ in range(piece.n)]
            elif isinstance(piece, bytes):
                ids += [self._byte_ids[b] for b in piece]
            else:
                ids += self.tokenizer.encode(piece)
        return ids

    def run(self, case: HostileCase, *, seed: int = 0) -> tuple[list[Tree], RolloutStats]:
        """Rolls out one question whose every step is `case`'s script."""
        ids = self.script_ids(case)
        set_successors(self.model, successor_table(ids, loop_last=case.loop_last), default=ids[0])
        self.engine.set_params(self.model)
        row = QARow(
            id=case.name,
            question="Which city is the capital of Alnor?",
            golden_answers=("Dovra",),
            data_source="hostile",
        )
        return rollout(
            self.engine, self.env, [row], self.tree, self.agent, key=jax.random.key(seed), greedy=True
        )

    def check(self, case: HostileCase) -> HostileResult:
        """Runs `case` and lists every broken bound or missing classification."""
        try:
            trees, stats = self.run(case)
        except Exception as e:  # the point is to count crashes, whatever they are
            return HostileResult(name=case.name, crashed=f"{type(e).__name__}: {e}", problems=(), stats={})
        flat = stats.as_dict()
        problems = [f"{k} == 0 (not classified)" for k in case.expect if not flat[k]]
        problems += [f"{k} == {flat[k]} (expected 0)" for k in case.forbid if flat[k]]
        problems += _bounds(trees, self.agent, self.env, self.tree.leaves_per_prompt)
        return HostileResult(name=case.name, crashed=None, problems=tuple(problems), stats=flat)


def _bounds(trees: Sequence[Tree], agent: AgentConfig, env: AgentEnv, leaves: int) -> list[str]:
    problems = []
    if sum(len(t.leaves()) for t in trees) != leaves:
        problems.append(f"{sum(len(t.leaves()) for t in trees)} leaves, expected {leaves}")
    obs_cap = env.observation.max_tokens + len(env.encode_obs(env.prompt.forced_answer)) + 8
    for tree in trees:
        for node in tree.nodes[1:]:
            if len(node.tokens) > agent.max_step_tokens:
                problems.append(f"a step of {len(node.tokens)} tokens > max_step_tokens")
            if node.query is not None and len(node.query) > DEFAULT_PARSER.max_query_chars:
                problems.append(f"a query of {len(node.query)} chars reached the retriever")
            if len(node.obs_tokens) > obs_cap:
                problems.append(f"an observation of {len(node.obs_tokens)} tokens")
    return problems
