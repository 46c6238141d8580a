"""Action parser: hand cases, a 10^4-case fuzz against an oracle, and adversarial inputs."""

import random
import time

import pytest

from treegrpo_jax.env.actions import (
    STOP_SEQUENCES,
    Answer,
    Invalid,
    InvalidReason,
    ParserConfig,
    Search,
    parse_action,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>need capital</think><search>capital of France</search>", Search(query="capital of France")),
        ("<think>ok</think>\n<answer> Paris </answer>", Answer(text="Paris")),
        ("<SEARCH>  Eiffel\n\ttower  </Search>", Search(query="Eiffel tower")),
        ("< search >q</ search >", Search(query="q")),
        ("<answer></answer>", Answer(text="")),
        ("<search>   </search>", Invalid(reason=InvalidReason.EMPTY_QUERY)),
        ("", Invalid(reason=InvalidReason.EMPTY)),
        ("  \n\t ", Invalid(reason=InvalidReason.EMPTY)),
        ("<think>only thinking</think>", Invalid(reason=InvalidReason.NO_ACTION)),
        ("<answer> Paris", Invalid(reason=InvalidReason.UNCLOSED_TAG)),
        ("<search> Paris </answer>", Invalid(reason=InvalidReason.UNCLOSED_TAG)),
        # First complete tag wins: the first closing tag with an opener before it.
        ("<search>a</search><answer>b</answer>", Search(query="a")),
        ("<answer>b</answer><search>a</search>", Answer(text="b")),
        ("<search>a <answer>b</answer> c</search>", Answer(text="b")),
        ("</answer> stray <search>q</search>", Search(query="q")),
        # Nested openers: the latest opener pairs with the closer.
        ("<search>outer <search>inner</search>", Search(query="inner")),
        # Tag-like text inside a query is removed, not searched for.
        ("<search>who <think> wrote </think> Hamlet</search>", Search(query="who wrote Hamlet")),
        ("<search>a <b> c</search>", Search(query="a <b> c")),
        ("<search>北京 的 人口</search>", Search(query="北京 的 人口")),
    ],
)
def test_parse_cases(text, expected):
    assert parse_action(text) == expected


def test_search_disabled_in_forced_step():
    step = "<think>more?</think><search>q</search>"
    assert parse_action(step, search_allowed=False) == Invalid(reason=InvalidReason.SEARCH_DISABLED)
    assert parse_action("<answer>x</answer>", search_allowed=False) == Answer(text="x")


def test_stop_sequences_close_both_actions():
    assert set(STOP_SEQUENCES) == {"</search>", "</answer>"}


def test_caps():
    cfg = ParserConfig(max_scan_chars=100, max_query_chars=5, max_answer_chars=3)
    assert parse_action("<search>abcdefgh</search>", cfg=cfg) == Search(query="abcde")
    assert parse_action("<answer>abcdefgh</answer>", cfg=cfg) == Answer(text="abc")
    # A tag past the scanned prefix does not count.
    assert parse_action("x" * 200 + "<answer>a</answer>", cfg=cfg) == Invalid(reason=InvalidReason.NO_ACTION)


def test_config_names_bad_field():
    with pytest.raises(ValueError, match="max_query_chars"):
        ParserConfig(max_query_chars=0)


# ---- Fuzz against an oracle built from the fragment list (not from the text). ----

_TAGS = {
    "<search>": ("open", "search"),
    "</search>": ("close", "search"),
    "<answer>": ("open", "answer"),
    "</answer>": ("close", "answer"),
    "<SeArCh >": ("open", "search"),
    "< /ANSWER>": ("close", "answer"),
    "</ search>": ("close", "search"),
    "<think>": ("noise", "think"),
    "</think>": ("noise", "think"),
    "<information>": ("noise", "information"),
}
# Text fragments never contain "<" or ">", so tags come only from tag fragments.
_TEXT = ["a", "Paris", "search", "answer", "/", " ", "\n", "\t", "é", "中文", "🙂", "\x00", "(x)", "..."]


def _oracle(frags):
    pending = {}
    for i, f in enumerate(frags):
        role, name = _TAGS.get(f, ("text", None))
        if role == "open":
            pending[name] = i
        elif role == "close" and name in pending:
            inner = "".join(" " if g in _TAGS else g for g in frags[pending[name] + 1 : i])
            content = " ".join(inner.split())
            if name == "answer":
                return Answer(text=content[:1024])
            return Search(query=content[:512]) if content else Invalid(reason=InvalidReason.EMPTY_QUERY)
    text = "".join(frags)
    if not text.strip():
        return Invalid(reason=InvalidReason.EMPTY)
    return Invalid(reason=InvalidReason.UNCLOSED_TAG if pending else InvalidReason.NO_ACTION)


def test_fuzz_matches_oracle():
    rng = random.Random(0)
    pool = list(_TAGS) + _TEXT
    for _ in range(12_000):
        frags = [rng.choice(pool) for _ in range(rng.randint(0, 24))]
        text = "".join(frags)
        got = parse_action(text)
        assert got == _oracle(frags), text
        assert parse_action(text) == got  # Deterministic.
        disabled = parse_action(text, search_allowed=False)
        assert not isinstance(disabled, Search)
        if isinstance(got, Search) or got == Invalid(reason=InvalidReason.EMPTY_QUERY):
            assert disabled == Invalid(reason=InvalidReason.SEARCH_DISABLED)
        else:
            assert disabled == got


def test_fuzz_random_unicode_never_raises():
    rng = random.Random(1)
    alphabet = "<>/ \n\tsearchanswerSEARCH\x00é中🙂\u200b\ufeff"
    kinds = (Search, Answer, Invalid)
    for _ in range(10_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert isinstance(parse_action(text), kinds)
    # Random code points, lone surrogates included.
    for _ in range(2_000):
        text = "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 30)))
        assert isinstance(parse_action(text), kinds)


@pytest.mark.parametrize(
    "text",
    [
        "<" * 1_000_000,
        "< " * 500_000,
        "<" + " " * 1_000_000 + "search>",
        "<search>" * 200_000,
        "<search>" * 5000 + "x" + "</search>" * 5000,
        "<search>" + "word " * 200_000 + "</search>",
        "</search>" * 200_000 + "<answer>late</answer>",
        "<answer>" + "🙂" * 300_000,
    ],
)
def test_adversarial_inputs_are_bounded(text):
    start = time.perf_counter()
    action = parse_action(text)
    assert time.perf_counter() - start < 1.0
    assert isinstance(action, Search | Answer | Invalid)
    if isinstance(action, Search):
        assert len(action.query) <= 512


def test_non_string_input_does_not_raise():
    assert parse_action(None) == Invalid(reason=InvalidReason.EMPTY)
    assert isinstance(parse_action(12345), Invalid)
