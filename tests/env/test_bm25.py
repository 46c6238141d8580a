"""In-process BM25: top-1 on a small corpus, result shape, and the pickle-free on-disk cache."""

import concurrent.futures
import json
import os

import numpy as np
import pytest

from tests.env.conftest import CORPUS
from treegrpo_jax.env.bm25 import BM25Config, BM25Retriever, read_corpus

TOP1 = [
    ("capital of Germany", "d1"),
    ("highest mountain Himalayas", "d2"),
    ("physicist radioactivity", "d4"),
    ("Guido van Rossum", "d5"),
    ("TOKYO, Japan!", "d7"),
    ("city on the Seine", "d0"),
    ("fortifications northern China", "d6"),
    ("Amazon River", "d3"),
]


@pytest.fixture()
def retriever(corpus_file, tmp_path):
    return BM25Retriever.from_corpus(corpus_file, cfg=BM25Config(cache_dir=str(tmp_path / "cache")))


def test_top1(retriever):
    results = retriever.search([q for q, _ in TOP1], k=3)
    assert [r.passages[0].id for r in results] == [d for _, d in TOP1]


def test_passage_fields_and_order(retriever):
    (result,) = retriever.search(["capital"], k=8)
    assert result.ok
    first = result.passages[0]
    assert first.title in {"Paris", "Berlin", "Tokyo"}  # Quotes from wiki-18 layout removed.
    assert "capital" in first.text
    scores = [p.score for p in result.passages]
    assert scores == sorted(scores, reverse=True) and all(s > 0 for s in scores)
    # Only passages sharing a term are returned.
    assert {p.id for p in result.passages} == {"d0", "d1", "d7"}


def test_edge_queries(retriever):
    nothing, empty, stop_only, big_k = retriever.search(["zzzz qqqq", "", "the of and", "capital"], k=100)
    assert nothing.passages == () and empty.passages == () and stop_only.passages == ()
    assert nothing.ok and empty.ok
    assert len(big_k.passages) == 3
    assert retriever.search([], k=3) == []
    with pytest.raises(ValueError, match="k must be"):
        retriever.search(["x"], k=0)
    long = retriever.search(["Berlin " + "x" * 100_000], k=1)[0]
    assert long.passages[0].id == "d1"


def test_from_texts_matches_from_corpus(retriever):
    mem = BM25Retriever.from_texts([c for _, c in CORPUS], ids=[i for i, _ in CORPUS])
    queries = [q for q, _ in TOP1]
    assert mem.search(queries, k=3) == retriever.search(queries, k=3)


def test_cache_reuse_and_keys(corpus_file, tmp_path):
    cache = tmp_path / "cache"
    cfg = BM25Config(cache_dir=str(cache))
    first = BM25Retriever.from_corpus(corpus_file, cfg=cfg)
    second = BM25Retriever.from_corpus(corpus_file, cfg=cfg)
    assert (first.loaded_from_cache, second.loaded_from_cache) == (False, True)
    queries = [q for q, _ in TOP1]
    assert first.search(queries, k=3) == second.search(queries, k=3)
    (key_dir,) = [d for d in cache.iterdir()]
    # Only JSON and plain .npy (no pickles); every array loads with allow_pickle=False.
    names = sorted(os.listdir(key_dir))
    assert all(n.endswith((".json", ".npy")) for n in names), names
    for n in names:
        if n.endswith(".npy"):
            np.load(key_dir / n, allow_pickle=False)
    # A different parameter or a different corpus gets its own entry.
    BM25Retriever.from_corpus(corpus_file, cfg=BM25Config(cache_dir=str(cache), k1=1.2))
    with open(corpus_file, "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": "d8", "contents": "Oslo\nOslo is the capital of Norway."}) + "\n")
    grown = BM25Retriever.from_corpus(corpus_file, cfg=cfg)
    assert not grown.loaded_from_cache and grown.num_docs == len(CORPUS) + 1
    assert len([d for d in cache.iterdir() if not d.name.startswith(".")]) == 3


def test_no_cache_writes_nothing(corpus_file, tmp_path):
    cache = tmp_path / "cache"
    r = BM25Retriever.from_corpus(corpus_file, cfg=BM25Config(cache_dir=str(cache), use_cache=False))
    assert r.search(["Berlin"], k=1)[0].passages[0].id == "d1"
    assert not cache.exists()


def test_corrupt_cache_is_rebuilt(corpus_file, tmp_path):
    cache = tmp_path / "cache"
    cfg = BM25Config(cache_dir=str(cache))
    BM25Retriever.from_corpus(corpus_file, cfg=cfg)
    (key_dir,) = list(cache.iterdir())
    for n in os.listdir(key_dir):
        if n.endswith(".npy"):
            (key_dir / n).write_bytes(b"garbage")
    again = BM25Retriever.from_corpus(corpus_file, cfg=cfg)
    assert not again.loaded_from_cache
    assert again.search(["Berlin"], k=1)[0].passages[0].id == "d1"


def test_thread_safe(retriever):
    queries = [q for q, _ in TOP1]
    expected = retriever.search(queries, k=3)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: retriever.search(queries, k=3), range(32)))
    assert all(o == expected for o in outs)


def test_read_corpus_reports_bad_rows(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1, "contents": "A\\nb"}\n\n{"id": 2}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3"):
        read_corpus(str(path))
    path.write_text('{"contents": "A\\nb"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_corpus(str(path))
    path.write_text("\n")
    with pytest.raises(ValueError, match="no passages"):
        read_corpus(str(path))


def test_config_validation():
    with pytest.raises(ValueError, match="method"):
        BM25Config(method="tfidf")
    with pytest.raises(ValueError, match=r"BM25Config\.b"):
        BM25Config(b=2.0)


@pytest.mark.parametrize("method", ["lucene", "robertson", "atire", "bm25l", "bm25+"])
def test_only_matching_passages_for_every_method(method):
    # BM25L/BM25+ score every passage above zero and Robertson IDF can go negative: matching is by term.
    r = BM25Retriever.from_texts(
        [c for _, c in CORPUS], ids=[i for i, _ in CORPUS], cfg=BM25Config(method=method)
    )
    (result,) = r.search(["capital"], k=8)
    assert {p.id for p in result.passages} == {"d0", "d1", "d7"}
    assert r.search(["Berlin Germany"], k=8)[0].passages[0].id == "d1"


def test_fill_to_k_pads_with_unmatched_passages_in_corpus_order():
    texts = [c for _, c in CORPUS]
    plain = BM25Retriever.from_texts(texts)
    filled = BM25Retriever.from_texts(texts, cfg=BM25Config(fill_to_k=True))
    for query in ("Himalayas", "the of and", "Paris capital France", "zzzz"):
        (a,), (b,) = plain.search([query], 4), filled.search([query], 4)
        assert len(b.passages) == 4
        assert [p.id for p in b.passages[: len(a.passages)]] == [p.id for p in a.passages]  # matched first
        rest = [int(p.id) for p in b.passages[len(a.passages) :]]
        assert rest == sorted(rest) and all(p.score == 0.0 for p in b.passages[len(a.passages) :])
    (everything,) = filled.search(["Himalayas"], 100)
    assert len(everything.passages) == len(texts)  # at most the corpus
