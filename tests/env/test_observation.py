"""Observation formatting and token budgets, with a real byte-level BPE tokenizer."""

import pytest

from treegrpo_jax.env.observation import (
    CLOSE_TAG,
    OPEN_TAG,
    ObservationConfig,
    format_observation,
    format_passages,
)
from treegrpo_jax.env.retrieval import Passage, SearchResult


def _p(i, text, title=None):
    return Passage(id=str(i), title=title or f"Title {i}", text=text, score=1.0)


def test_adapter_round_trips_and_adds_no_special_tokens(bpe_tokenizer):
    """The `TokenizerLike` contract the budgets rely on: decode(encode(x)) == x, and no BOS/EOS."""
    text = "Doc 1 (Title: Paris) Paris is the capital of France. 你好 🤖"
    ids = bpe_tokenizer.encode(text)
    assert bpe_tokenizer.decode(ids) == text
    assert bpe_tokenizer.encode("") == [] and len(bpe_tokenizer.encode("a")) == 1  # nothing added


def test_layout(bpe_tokenizer):
    obs = format_passages(
        [_p(1, "Paris is the capital.", "Paris"), _p(2, "Berlin too.", "Berlin")],
        tokenizer=bpe_tokenizer,
        cfg=ObservationConfig(),
    )
    assert obs == (
        "\n\n<information>Doc 1 (Title: Paris) Paris is the capital.\n"
        "Doc 2 (Title: Berlin) Berlin too.</information>\n\n"
    )


def test_each_passage_cut_to_its_budget(bpe_tokenizer):
    short = "Doc 2 (Title: Title 2) short"
    budget = len(bpe_tokenizer.encode(short))
    cfg = ObservationConfig(passage_tokens=budget, max_tokens=500)
    long = "The Eiffel Tower is a wrought-iron lattice tower in Paris. " * 20
    obs = format_passages([_p(1, long), _p(2, "short")], tokenizer=bpe_tokenizer, cfg=cfg)
    lines = obs[len(OPEN_TAG) : -len(CLOSE_TAG)].split("\n")
    assert len(lines) == 2
    assert lines[0].startswith("Doc 1 (Title: Title 1)")
    assert len(bpe_tokenizer.encode(lines[0])) <= budget < len(bpe_tokenizer.encode(long))
    assert lines[1] == short


@pytest.mark.parametrize("max_tokens", [16, 40, 100, 500])
def test_whole_observation_capped_and_closed(bpe_tokenizer, max_tokens):
    cfg = ObservationConfig(passage_tokens=400, max_tokens=max_tokens)
    passages = [
        _p(i, "Mount Everest is Earth's highest mountain 山 🙂 above sea level. " * 15) for i in range(5)
    ]
    obs = format_passages(passages, tokenizer=bpe_tokenizer, cfg=cfg)
    assert len(bpe_tokenizer.encode(obs)) <= max_tokens
    assert obs.startswith(OPEN_TAG) and obs.endswith(CLOSE_TAG)


def test_titles_stay_on_one_line(bpe_tokenizer):
    obs = format_passages(
        [_p(1, "t", "Multi\nline\ttitle")], tokenizer=bpe_tokenizer, cfg=ObservationConfig()
    )
    assert "(Title: Multi line title) t" in obs


def test_no_results_and_error(bpe_tokenizer):
    cfg = ObservationConfig()
    empty = format_observation(SearchResult(), tokenizer=bpe_tokenizer, cfg=cfg)
    assert empty == f"{OPEN_TAG}{cfg.no_results}{CLOSE_TAG}"
    err = format_observation(SearchResult(error="HTTP 503"), tokenizer=bpe_tokenizer, cfg=cfg)
    assert err == f"{OPEN_TAG}{cfg.search_error}{CLOSE_TAG}"
    assert "503" not in err  # Infrastructure detail goes to logs, not to the policy.


def test_config_validation():
    with pytest.raises(ValueError, match="passage_tokens"):
        ObservationConfig(passage_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        ObservationConfig(max_tokens=3)
