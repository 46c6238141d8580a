"""A Search-R1-protocol retrieval server over any `Retriever` (BM25 by default).

``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": bool}`` answers
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`` (bare documents when
``return_scores`` is false), as Search-R1's server does, so its clients and ours are interchangeable.
``GET /health`` answers ``{"status": "ok"}``.

Safety: binds 127.0.0.1 unless told otherwise; bounds the body size, the number of queries, their
length and ``k``; parses bodies with `json.loads` only (never eval, never unpickle); answers bad input
with 4xx and a JSON ``{"error": ...}`` instead of crashing. One thread per request
(`ThreadingHTTPServer`); the retriever must be thread-safe (`BM25Retriever` is).
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from treegrpo_jax.env.bm25 import BM25Config, BM25Retriever
from treegrpo_jax.env.retrieval import Retriever, SearchResult


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Where to listen and what to accept.

    Attributes:
      host: bind address; keep 127.0.0.1 unless other hosts must reach it.
      port: TCP port; 0 picks a free one (the bound port is printed and in `server_address`).
      path: the endpoint path.
      max_k: largest ``topk`` accepted.
      max_queries: most queries in one request.
      max_query_chars: longest query accepted.
      max_body_bytes: largest request body accepted.
      request_timeout_s: socket timeout per connection, so a stalled client frees its thread.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    path: str = "/retrieve"
    max_k: int = 50
    max_queries: int = 512
    max_query_chars: int = 4096
    max_body_bytes: int = 4 << 20
    request_timeout_s: float = 30.0

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServerConfig.port must be in [0, 65535], got {self.port}")
        if not self.path.startswith("/"):
            raise ValueError(f"ServerConfig.path must start with '/', got {self.path!r}")
        for name in ("max_k", "max_queries", "max_query_chars", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"ServerConfig.request_timeout_s must be > 0, got {self.request_timeout_s}")


class RequestError(Exception):
    """A request the server refuses, with the HTTP status to answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, cfg: ServerConfig) -> tuple[list[str], int, bool]:
    """Validates a request body.

    Args:
      body: the raw POST body.
      cfg: the limits.

    Returns:
      ``(queries, topk, return_scores)``.

    Raises:
      RequestError: with status 400 and a message naming the bad field.
    """
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):
        raise RequestError(400, "body is not valid JSON") from None
    if not isinstance(req, dict):
        raise RequestError(400, "body must be a JSON object")
    queries = req.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise RequestError(400, '"queries" must be a list of strings')
    if len(queries) > cfg.max_queries:
        raise RequestError(400, f'"queries" has {len(queries)} entries; the limit is {cfg.max_queries}')
    if any(len(q) > cfg.max_query_chars for q in queries):
        raise RequestError(400, f"a query is longer than {cfg.max_query_chars} characters")
    topk = req.get("topk", 3)  # Search-R1's default top-k.
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= cfg.max_k:
        raise RequestError(400, f'"topk" must be an int in [1, {cfg.max_k}]')
    return_scores = req.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise RequestError(400, '"return_scores" must be a boolean')
    return queries, topk, return_scores


def _encode_result(result: SearchResult, return_scores: bool) -> list[dict[str, Any]]:
    out = []
    for p in result.passages:
        doc = {"id": p.id, "contents": p.contents}
        out.append({"document": doc, "score": p.score} if return_scores else doc)
    return out


def _make_handler(retriever: Retriever, cfg: ServerConfig) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = cfg.request_timeout_s
        server_version = "treegrpo-retriever/1"

        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": f"unknown path {self.path!r}"})

        def do_POST(self):  # noqa: N802
            try:
                if self.path != cfg.path:
                    raise RequestError(404, f"unknown path {self.path!r}; use {cfg.path}")
                queries, topk, return_scores = parse_request(self._read_body(), cfg)
                results = retriever.search(queries, topk) if queries else []
                self._send(200, {"result": [_encode_result(r, return_scores) for r in results]})
            except RequestError as e:
                self._send(e.status, {"error": str(e)})
            except Exception:  # The server must outlive any one bad request.
                logging.exception("retrieval failed")
                self._send(500, {"error": "internal error"})

        def _read_body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None:
                raise RequestError(411, "Content-Length is required")
            try:
                n = int(length)
            except ValueError:
                raise RequestError(400, "Content-Length is not a number") from None
            if n < 0 or n > cfg.max_body_bytes:
                raise RequestError(413, f"body must be at most {cfg.max_body_bytes} bytes")
            return self.rfile.read(n)

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            # ASCII escapes: any str (even a lone surrogate) encodes, so a reply never fails to send.
            data = json.dumps(payload).encode("ascii")
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # The client went away; nothing to tell it.
                pass

        def log_message(self, format, *args):  # noqa: A002 (http.server's signature)
            logging.debug("%s - %s", self.address_string(), format % args)

    return Handler


def make_server(retriever: Retriever, cfg: ServerConfig) -> http.server.ThreadingHTTPServer:
    """Binds a server (not yet serving); call ``serve_forever()`` and later ``shutdown()``.

    Args:
      retriever: answers the searches; must be thread-safe.
      cfg: bind address and limits.

    Returns:
      The bound server; ``server.server_address[1]`` is the port (useful with ``port=0``).
    """
    server = http.server.ThreadingHTTPServer((cfg.host, cfg.port), _make_handler(retriever, cfg))
    server.daemon_threads = True  # Do not let a stuck request block interpreter exit.
    return server


def serve_corpus(
    corpus: str,
    *,
    server_cfg: ServerConfig,
    bm25_cfg: BM25Config | None = None,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Builds (or loads the cached) BM25 index for ``corpus`` and serves it until interrupted.

    Args:
      corpus: corpus JSONL, ``{"id", "contents"}`` per line.
      server_cfg: bind address and limits.
      bm25_cfg: BM25 parameters and cache location; default `BM25Config(fill_to_k=True)`: every
        query gets ``topk`` passages, as from Search-R1's servers.
      announce: called once with the endpoint URL when the server is listening (default: print it
        to stdout, flushed, so a parent process can wait for the line).
    """
    retriever = BM25Retriever.from_corpus(corpus, cfg=bm25_cfg or BM25Config(fill_to_k=True))
    server = make_server(retriever, server_cfg)
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}{server_cfg.path}"
    logging.info("Serving %d passages from %s at %s", retriever.num_docs, corpus, url)
    (announce or _print_flush)(f"Serving {retriever.num_docs} passages at {url}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def _print_flush(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
