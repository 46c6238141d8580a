"""Client for the Search-R1 retrieval-server protocol (docs/DESIGN.md §3), standard library only.

Request: ``POST {url}`` with ``{"queries": [...], "topk": k, "return_scores": true}``.
Response: ``{"result": [[{"document": {"id": ..., "contents": "Title\\ntext"}, "score": s}, ...], ...]}``
(one list per query). Servers that ignore ``return_scores`` and send bare documents are accepted too.

Fault handling, so a flaky retriever never kills a training run:
  * transport faults (refused connection, reset, timeout) and HTTP 429/5xx are retried with
    exponential backoff, up to ``max_retries`` times;
  * HTTP 4xx and malformed bodies are not retried (a retry would get the same answer);
  * when a batch still fails, every query in it gets ``SearchResult(error=...)`` — the agent loop turns
    that into an error observation and goes on;
  * when the server has answered nothing but retryable faults for longer than ``max_outage_s`` (an
    outage, measured from the first failed attempt since the last answer), `search` raises
    `RetrieverUnavailableError` instead, so the trainer can save and stop rather than hang or
    train on error observations.
`RetrievalStats` counts every fault so the trainer can log it.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

from treegrpo_jax.env.retrieval import (
    Passage,
    RetrieverUnavailableError,
    SearchResult,
    check_k,
    split_contents,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HttpRetrieverConfig:
    """Where the server is and how hard to try.

    Attributes:
      url: full endpoint, e.g. ``http://127.0.0.1:8000/retrieve`` (http or https).
      timeout_s: socket timeout for connect and for each read.
      max_retries: extra attempts after the first for retryable faults.
      backoff_s: sleep before the first retry; doubles each retry.
      backoff_max_s: cap on one sleep.
      max_batch_queries: queries per request; larger batches are split.
      max_response_bytes: a larger response is treated as malformed (bounds memory).
      max_outage_s: raise `RetrieverUnavailableError` once the server has been unreachable this
        long (None: never; every failed batch is an error result).
    """

    url: str
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    max_batch_queries: int = 256
    max_response_bytes: int = 64 << 20
    max_outage_s: float | None = None

    def __post_init__(self):
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"HttpRetrieverConfig.url must be an http(s) URL with a host, got {self.url!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"HttpRetrieverConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_retries < 0:
            raise ValueError(f"HttpRetrieverConfig.max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValueError("HttpRetrieverConfig.backoff_s and backoff_max_s must be >= 0")
        if self.max_batch_queries < 1:
            raise ValueError(
                f"HttpRetrieverConfig.max_batch_queries must be >= 1, got {self.max_batch_queries}"
            )
        if self.max_response_bytes < 1:
            raise ValueError("HttpRetrieverConfig.max_response_bytes must be >= 1")
        if self.max_outage_s is not None and not self.max_outage_s > 0:
            raise ValueError(f"HttpRetrieverConfig.max_outage_s must be > 0 or None, got {self.max_outage_s}")


class RetrievalStats:
    """Thread-safe fault counters (read with `as_dict`)."""

    _FIELDS = (
        "requests",  # HTTP attempts made (first tries and retries).
        "queries",  # queries asked for.
        "retries",  # attempts after a retryable fault.
        "timeouts",  # attempts that hit the socket timeout.
        "connection_errors",  # refused / reset / unreachable.
        "http_errors",  # non-200 statuses.
        "truncated_responses",  # bodies shorter than their Content-Length (the connection dropped).
        "bad_responses",  # 200 with a body that is not the protocol's shape.
        "skipped_passages",  # malformed passage entries dropped from otherwise good responses.
        "failed_queries",  # queries answered with an error result.
        "outages",  # searches refused because the server was unreachable beyond max_outage_s.
    )

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self._FIELDS, 0)

    def add(self, name: str, n: int = 1) -> None:
        """Adds ``n`` to counter ``name``."""
        with self._lock:
            self._counts[name] += n

    def as_dict(self) -> dict[str, int]:
        """A snapshot of all counters."""
        with self._lock:
            return dict(self._counts)


class _Retryable(Exception):
    """A fault worth another attempt."""


class _Fatal(Exception):
    """A fault a retry would repeat."""


class HttpRetriever:
    """Batched client for a Search-R1-protocol server; implements `Retriever`. Thread-safe."""

    def __init__(self, cfg: HttpRetrieverConfig):
        """Args: cfg: the server URL and retry policy."""
        self.cfg = cfg
        self.stats = RetrievalStats()
        parsed = urllib.parse.urlsplit(cfg.url)
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port
        self._path = parsed.path or "/"
        if parsed.query:
            self._path += "?" + parsed.query
        self._outage_lock = threading.Lock()
        self._down_since: float | None = None  # first failed attempt since the server last answered

    def search(self, queries: Sequence[str], k: int) -> list[SearchResult]:
        """Retrieves top-``k`` passages for each query.

        Args:
          queries: the batch; split into requests of ``max_batch_queries``.
          k: passages per query (sent as ``topk``).

        Returns:
          One `SearchResult` per query, in order; failed batches give results with ``error`` set.
        """
        check_k(k)
        queries = [str(q) for q in queries]
        self.stats.add("queries", len(queries))
        out: list[SearchResult] = []
        step = self.cfg.max_batch_queries
        for start in range(0, len(queries), step):
            out.extend(self._search_batch(queries[start : start + step], k))
        return out

    def _search_batch(self, queries: list[str], k: int) -> list[SearchResult]:
        body = json.dumps({"queries": queries, "topk": k, "return_scores": True}).encode("utf-8")
        error = "unknown"
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                self.stats.add("retries")
                time.sleep(min(self.cfg.backoff_s * 2 ** (attempt - 1), self.cfg.backoff_max_s))
            try:
                payload = self._post(body)
                results = self._parse(payload, n=len(queries))
                self._mark_reachable()
                return results
            except _Retryable as e:
                error = str(e)
                self._mark_unreachable()
            except _Fatal as e:
                error = str(e)
                self._mark_reachable()  # it answered: the server is up, its answer was bad
                break
        self._check_outage(error)
        logging.warning("Retrieval failed for %d queries: %s", len(queries), error)
        self.stats.add("failed_queries", len(queries))
        return [SearchResult(error=error) for _ in queries]

    def _mark_reachable(self) -> None:
        with self._outage_lock:
            self._down_since = None

    def _mark_unreachable(self) -> None:
        with self._outage_lock:
            if self._down_since is None:
                self._down_since = time.monotonic()

    def _check_outage(self, error: str) -> None:
        with self._outage_lock:
            down = None if self._down_since is None else time.monotonic() - self._down_since
        if down is not None and self.cfg.max_outage_s is not None and down >= self.cfg.max_outage_s:
            self.stats.add("outages")
            raise RetrieverUnavailableError(
                f"retrieval server {self.cfg.url} unreachable for {down:.1f}s, longer than "
                f"max_outage_s={self.cfg.max_outage_s:g}; last error: {error}"
            )

    def _post(self, body: bytes) -> bytes:
        self.stats.add("requests")
        conn_cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = conn_cls(self._host, self._port, timeout=self.cfg.timeout_s)
        try:
            conn.request("POST", self._path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            # Read one byte past the cap to tell "exactly at the cap" from "too big".
            data = resp.read(self.cfg.max_response_bytes + 1)
            # `read(amt)` returns short, without IncompleteRead, when the peer closes early; the
            # header's promise is the only way to tell a truncated body from a complete one.
            promised = resp.getheader("Content-Length", "")
        except TimeoutError as e:
            self.stats.add("timeouts")
            raise _Retryable(f"timeout after {self.cfg.timeout_s}s") from e
        except (OSError, http.client.HTTPException) as e:
            self.stats.add("connection_errors")
            raise _Retryable(f"connection error: {type(e).__name__}: {e}") from e
        finally:
            conn.close()
        if resp.status != 200:
            self.stats.add("http_errors")
            msg = f"HTTP {resp.status} from server: {data[:200].decode('utf-8', 'replace')}"
            raise _Retryable(msg) if resp.status == 429 or resp.status >= 500 else _Fatal(msg)
        if promised.isdigit() and len(data) < int(promised) <= self.cfg.max_response_bytes:
            self.stats.add("truncated_responses")
            raise _Retryable(f"truncated response: {len(data)} of {promised} bytes")
        if len(data) > self.cfg.max_response_bytes:
            self.stats.add("bad_responses")
            raise _Fatal(f"response larger than {self.cfg.max_response_bytes} bytes")
        return data

    def _parse(self, data: bytes, *, n: int) -> list[SearchResult]:
        try:
            payload = json.loads(data)
        except (ValueError, RecursionError) as e:
            self.stats.add("bad_responses")
            raise _Fatal(f"response is not JSON: {e}") from None
        result = payload.get("result") if isinstance(payload, dict) else None
        if not isinstance(result, list) or len(result) != n:
            self.stats.add("bad_responses")
            raise _Fatal(f'response needs "result" as a list of {n} lists')
        out = []
        for hits in result:
            if not isinstance(hits, list):
                self.stats.add("bad_responses")
                raise _Fatal('each entry of "result" must be a list')
            passages = [p for p in (self._passage(h) for h in hits) if p is not None]
            out.append(SearchResult(passages=tuple(passages)))
        return out

    def _passage(self, hit: Any) -> Passage | None:
        """One hit; None (and counted) when malformed, so one bad passage does not sink the batch."""
        if not isinstance(hit, dict):
            self.stats.add("skipped_passages")
            return None
        doc = hit.get("document", hit)  # Without return_scores, servers send bare documents.
        score = hit.get("score", 0.0)
        if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
            self.stats.add("skipped_passages")
            return None
        if isinstance(score, bool) or not isinstance(score, int | float):
            score = 0.0
        title, text = split_contents(doc["contents"])
        return Passage(id=str(doc.get("id", "")), title=title, text=text, score=float(score))
