"""In-process BM25 retrieval over a corpus JSONL, with the index cached on disk.

The corpus is Search-R1's layout, one JSON object a line: ``{"id": ..., "contents": "Title\\ntext"}``.
The whole ``contents`` (title included) is indexed, so a query naming an entity finds its passage.

The index is built with `bm25s` and cached under ``cache_dir/<key>/`` where ``key`` hashes the corpus
bytes, the BM25 parameters and the bm25s version, so editing the corpus or a parameter rebuilds it.
bm25s writes the sparse score matrix as ``.npy`` and the vocabulary/parameters as JSON; we load it
with ``allow_pickle=False`` — nothing here ever unpickles.

Scoring uses bm25s' public ``get_scores_from_ids`` and a numpy top-k of our own rather than
``retrieve``: that keeps empty queries, ``k`` larger than the corpus and thread safety under our
control (the HTTP server calls `search` from many threads; nothing here mutates shared state).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from treegrpo_jax.env.retrieval import Passage, SearchResult, check_k, split_contents

_METHODS = ("robertson", "lucene", "atire", "bm25l", "bm25+")
# Bump when the way we tokenize or lay out the cache changes, so old caches are ignored.
_CACHE_FORMAT = 1
_META_FILE = "treegrpo_meta.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BM25Config:
    """How to build and query a BM25 index.

    Attributes:
      k1: term-frequency saturation.
      b: length normalisation.
      method: bm25s scoring variant, one of robertson, lucene, atire, bm25l, bm25+.
      stopwords: bm25s stop-word list name ("en") or "" for none.
      max_query_chars: queries are cut to this many characters before tokenizing (bounds the work).
      cache_dir: where indexes are cached; None means ``$XDG_CACHE_HOME`` or ``~/.cache``
        ``/treegrpo_jax/bm25``.
      use_cache: False builds in memory every time and writes nothing.
      fill_to_k: return k passages for every query (at most the corpus size), as Search-R1's
        servers do: the matched passages by score, then the unmatched ones in corpus order (their
        BM25 score is the floor). False: only passages sharing a term with the query (a query of
        stop words alone gets none). A query-time choice: not part of the cached index.
    """

    k1: float = 1.5
    b: float = 0.75
    method: str = "lucene"
    stopwords: str = "en"
    max_query_chars: int = 1024
    cache_dir: str | None = None
    use_cache: bool = True
    fill_to_k: bool = False

    def __post_init__(self):
        if not self.k1 > 0:
            raise ValueError(f"BM25Config.k1 must be > 0, got {self.k1}")
        if not 0 <= self.b <= 1:
            raise ValueError(f"BM25Config.b must be in [0, 1], got {self.b}")
        if self.method not in _METHODS:
            raise ValueError(f"BM25Config.method must be one of {_METHODS}, got {self.method!r}")
        if self.max_query_chars < 1:
            raise ValueError(f"BM25Config.max_query_chars must be >= 1, got {self.max_query_chars}")

    def index_params(self) -> dict[str, Any]:
        """The parameters that change the index (and so enter the cache key)."""
        return {"k1": self.k1, "b": self.b, "method": self.method, "stopwords": self.stopwords}


@dataclasses.dataclass(frozen=True)
class _Docs:
    ids: list[str]
    titles: list[str]
    texts: list[str]


def read_corpus(path: str) -> _Docs:
    """Reads a corpus JSONL (``{"id", "contents"}`` per line; blank lines skipped).

    Args:
      path: the corpus file.

    Returns:
      The passages' ids, titles and texts, in file order. A missing ``id`` becomes the row number.

    Raises:
      ValueError: naming the file and line of the first bad row.
    """
    ids, titles, texts = [], [], []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
                raise ValueError(f'{path}:{line_no}: expected an object with a string "contents"')
            title, text = split_contents(row["contents"])
            ids.append(str(row.get("id", len(ids))))
            titles.append(title)
            texts.append(text)
    if not ids:
        raise ValueError(f"{path}: the corpus has no passages")
    return _Docs(ids=ids, titles=titles, texts=texts)


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "treegrpo_jax", "bm25")


class BM25Retriever:
    """BM25 over an in-memory corpus; implements `Retriever`.

    Build with `from_corpus` (cached on disk) or `from_texts` (in memory, for tests and tiny worlds).
    """

    def __init__(self, *, model: Any, docs: _Docs, cfg: BM25Config, loaded_from_cache: bool = False):
        """Wraps a built bm25s model; prefer `from_corpus` / `from_texts`."""
        self._model = model
        self._docs = docs
        self._cfg = cfg
        # bm25s keeps the vocabulary as token -> row of the score matrix.
        self._vocab: dict[str, int] = dict(model.vocab_dict)
        self.loaded_from_cache = loaded_from_cache

    @property
    def num_docs(self) -> int:
        """Number of passages in the index."""
        return len(self._docs.ids)

    @classmethod
    def from_texts(
        cls, contents: Sequence[str], *, ids: Sequence[str] | None = None, cfg: BM25Config | None = None
    ) -> BM25Retriever:
        """Builds an index in memory (no cache) from ``contents`` strings ("Title\\ntext").

        Args:
          contents: one string per passage, corpus layout.
          ids: passage ids; default ``"0", "1", ...``.
          cfg: BM25 parameters; default `BM25Config()`.

        Returns:
          The retriever.
        """
        cfg = cfg or BM25Config()
        if not contents:
            raise ValueError("from_texts needs at least one passage")
        if ids is not None and len(ids) != len(contents):
            raise ValueError(f"ids has {len(ids)} entries but contents has {len(contents)}")
        split = [split_contents(c) for c in contents]
        docs = _Docs(
            ids=[str(i) for i in ids] if ids is not None else [str(i) for i in range(len(contents))],
            titles=[t for t, _ in split],
            texts=[x for _, x in split],
        )
        return cls(model=_build_model(docs, cfg), docs=docs, cfg=cfg)

    @classmethod
    def from_corpus(cls, path: str, *, cfg: BM25Config | None = None) -> BM25Retriever:
        """Loads the cached index for ``path`` or builds (and caches) it.

        Args:
          path: corpus JSONL, ``{"id", "contents"}`` per line.
          cfg: BM25 parameters and cache location; default `BM25Config()`.

        Returns:
          The retriever; ``loaded_from_cache`` tells whether the index came from disk.
        """
        cfg = cfg or BM25Config()
        docs = read_corpus(path)
        if not cfg.use_cache:
            return cls(model=_build_model(docs, cfg), docs=docs, cfg=cfg)
        key = _cache_key(path, cfg)
        index_dir = os.path.join(cfg.cache_dir or _default_cache_dir(), key)
        model = _load_cached(index_dir, num_docs=len(docs.ids))
        if model is not None:
            return cls(model=model, docs=docs, cfg=cfg, loaded_from_cache=True)
        model = _build_model(docs, cfg)
        _save_atomically(model, index_dir, meta={"key": key, "num_docs": len(docs.ids), "corpus": path})
        return cls(model=model, docs=docs, cfg=cfg)

    def search(self, queries: Sequence[str], k: int) -> list[SearchResult]:
        """Top-``k`` passages per query, best first; passages sharing no term with the query are left
        out unless ``cfg.fill_to_k`` (then every query gets ``min(k, corpus size)``).

        Args:
          queries: the batch of queries (each cut to ``cfg.max_query_chars``).
          k: passages per query (at most the corpus size are returned).

        Returns:
          One `SearchResult` per query; never an error result (the index is local).
        """
        check_k(k)
        import bm25s  # Lazy: bm25s imports jax at import time; the HTTP client path never needs it.

        texts = [str(q)[: self._cfg.max_query_chars] for q in queries]
        if not texts:
            return []
        tokens = bm25s.tokenize(
            texts, stopwords=self._cfg.stopwords or None, return_ids=False, show_progress=False
        )
        return [self._search_one(toks, k) for toks in tokens]

    def _search_one(self, tokens: list[str], k: int) -> SearchResult:
        ids = [self._vocab[t] for t in tokens if t in self._vocab]
        n = len(self._docs.ids)
        scores = (
            np.asarray(self._model.get_scores_from_ids(ids), dtype=np.float32)
            if ids
            else np.zeros(n, np.float32)
        )
        # Rank only passages holding a query term: BM25L/BM25+ give every passage a positive floor and
        # Robertson IDF can be negative, so "score > 0" would not mean "matched". The score matrix is
        # token-major CSC: indices[indptr[t]:indptr[t + 1]] are the passages containing token t.
        indptr, indices = self._model.scores["indptr"], self._model.scores["indices"]
        mask = np.zeros(n, dtype=bool)
        for t in ids:
            mask[indices[indptr[t] : indptr[t + 1]]] = True
        matched = np.flatnonzero(mask)
        top = np.zeros(0, np.int64)
        if matched.size:
            m = min(k, matched.size)
            cand = scores[matched]
            top = np.argpartition(-cand, m - 1)[:m]
            # Sort by score, then by passage index so ties are deterministic.
            top = matched[top[np.lexsort((matched[top], -cand[top]))]]
        if self._cfg.fill_to_k and top.size < min(k, n):  # pad with unmatched passages, corpus order
            top = np.concatenate([top, np.flatnonzero(~mask)[: min(k, n) - top.size]])
        if top.size == 0:
            return SearchResult(passages=())
        passages = tuple(
            Passage(
                id=self._docs.ids[i],
                title=self._docs.titles[i],
                text=self._docs.texts[i],
                score=float(scores[i]),
            )
            for i in top.tolist()
        )
        return SearchResult(passages=passages)


def _build_model(docs: _Docs, cfg: BM25Config) -> Any:
    import bm25s

    contents = [f"{t}\n{x}" for t, x in zip(docs.titles, docs.texts, strict=True)]
    tokenized = bm25s.tokenize(
        contents, stopwords=cfg.stopwords or None, return_ids=True, show_progress=False
    )
    model = bm25s.BM25(k1=cfg.k1, b=cfg.b, method=cfg.method, backend="numpy")
    model.index(tokenized, show_progress=False)
    return model


def _cache_key(path: str, cfg: BM25Config) -> str:
    import bm25s

    blob = json.dumps(
        {
            "corpus_sha256": _file_sha256(path),
            "params": cfg.index_params(),
            "bm25s": bm25s.__version__,
            "format": _CACHE_FORMAT,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _load_cached(index_dir: str, *, num_docs: int) -> Any | None:
    """Returns the cached model, or None when absent, stale or unreadable (then we rebuild)."""
    import bm25s

    meta_path = os.path.join(index_dir, _META_FILE)
    if not os.path.exists(meta_path):
        return None
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("num_docs") != num_docs:
            return None
        # allow_pickle=False: the arrays are plain .npy; a tampered cache cannot run code.
        return bm25s.BM25.load(
            index_dir, mmap=False, allow_pickle=False, load_corpus=False, show_progress=False
        )
    except Exception as e:  # Any unreadable cache just means "rebuild"; it must never stop a run.
        logging.warning("Ignoring unreadable BM25 cache %s: %s", index_dir, e)
        return None


def _save_atomically(model: Any, index_dir: str, *, meta: dict[str, Any]) -> None:
    """Writes into a temporary sibling then renames, so readers never see half an index."""
    parent = os.path.dirname(index_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    except OSError as e:
        logging.warning("Cannot write BM25 cache under %s (%s); continuing without it", parent, e)
        return
    try:
        model.save(tmp, allow_pickle=False, show_progress=False)
        with open(os.path.join(tmp, _META_FILE), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        if os.path.exists(index_dir):  # A stale or concurrent copy: replace it.
            shutil.rmtree(index_dir, ignore_errors=True)
        os.rename(tmp, index_dir)
    except OSError as e:
        # Another process may have renamed its copy first; theirs is as good as ours.
        logging.info("BM25 cache not written to %s: %s", index_dir, e)
        shutil.rmtree(tmp, ignore_errors=True)
