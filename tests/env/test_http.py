"""HTTP retrieval over real sockets on 127.0.0.1.

The real server runs as a separate process (launch/serve_retriever.py); fault cases (slow, dead,
malformed, erroring servers) use tiny in-test servers so each fault is exact and repeatable.
"""

import concurrent.futures
import contextlib
import http.client
import http.server
import json
import os
import selectors
import subprocess
import sys
import threading
import time
import urllib.parse

import portpicker
import pytest

from tests.env.conftest import CORPUS
from treegrpo_jax.env.bm25 import BM25Config, BM25Retriever
from treegrpo_jax.env.http_client import HttpRetriever, HttpRetrieverConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUERIES = ["capital of Germany", "highest mountain", "Guido van Rossum", "zzzz", "physicist"]


def _read_line(proc: subprocess.Popen, deadline_s: float) -> str:
    """The server's first stdout line, waiting at most ``deadline_s``."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if sel.select(timeout=0.1):
            return proc.stdout.readline()
        if proc.poll() is not None:
            break
    raise RuntimeError(
        f"server did not start: rc={proc.poll()} stderr={proc.stderr.read() if proc.poll() else ''}"
    )


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "contents": c}) + "\n" for i, c in CORPUS))
    cmd = [
        sys.executable,
        os.path.join(REPO, "launch", "serve_retriever.py"),
        f"--corpus={corpus}",
        "--port=0",  # The server picks a free port and prints it: no race with other tests.
        "--host=127.0.0.1",
        f"--cache_dir={tmp / 'cache'}",
        "--max_k=10",
        "--max_queries=64",
    ]
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = _read_line(proc, deadline_s=60)
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/retrieve"), line
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def local():
    # The server fills every result to topk, as Search-R1's do (`BM25Config.fill_to_k`).
    cfg = BM25Config(fill_to_k=True)
    return BM25Retriever.from_texts([c for _, c in CORPUS], ids=[i for i, _ in CORPUS], cfg=cfg)


def _raw_post(url: str, body: bytes, headers=None, path=None):
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.request("POST", path or u.path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_results_match_in_process_bm25(server_url, local):
    client = HttpRetriever(HttpRetrieverConfig(url=server_url, timeout_s=10))
    got = client.search(QUERIES, k=3)
    want = local.search(QUERIES, k=3)
    assert [[p.id for p in r.passages] for r in got] == [[p.id for p in r.passages] for r in want]
    for g, w in zip(got, want, strict=True):
        assert g.ok
        for gp, wp in zip(g.passages, w.passages, strict=True):
            assert (gp.title, gp.text) == (wp.title, wp.text)
            assert gp.score == pytest.approx(wp.score, rel=1e-5)
    assert client.stats.as_dict()["failed_queries"] == 0


def test_server_always_returns_topk_like_search_r1(server_url):
    """A query of stop words only, and one that matches a single passage, still get topk passages:
    the matched one first, then unmatched ones in corpus order."""
    client = HttpRetriever(HttpRetrieverConfig(url=server_url, timeout_s=10))
    stop_words, one_match = client.search(["the of and", "Himalayas"], k=3)
    assert len(stop_words.passages) == 3 and len(one_match.passages) == 3
    assert one_match.passages[0].title == "Mount Everest" and one_match.passages[0].score > 0
    assert [p.score for p in one_match.passages[1:]] == [0.0, 0.0]


def test_search_r1_wire_format(server_url):
    status, body = _raw_post(
        server_url, json.dumps({"queries": ["Berlin"], "topk": 1, "return_scores": True}).encode()
    )
    assert status == 200
    (hits,) = json.loads(body)["result"]
    assert hits[0]["document"]["contents"].startswith("Berlin\n") and isinstance(hits[0]["score"], float)
    # Without return_scores the server sends bare documents, as Search-R1's does.
    status, body = _raw_post(server_url, json.dumps({"queries": ["Berlin"], "topk": 1}).encode())
    assert json.loads(body)["result"][0][0]["contents"].startswith("Berlin\n")


def test_concurrent_clients(server_url, local):
    want = [[p.id for p in r.passages] for r in local.search(QUERIES, k=2)]

    def worker(i):
        client = HttpRetriever(HttpRetrieverConfig(url=server_url, timeout_s=10, max_batch_queries=2))
        outs = [client.search(QUERIES, k=2) for _ in range(5)]
        return [[[p.id for p in r.passages] for r in out] for out in outs]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for outs in pool.map(worker, range(8)):
            assert all(o == want for o in outs)


@pytest.mark.parametrize(
    "body, status",
    [
        (b"this is not json", 400),
        (b"[1, 2]", 400),
        (json.dumps({"queries": "Berlin"}).encode(), 400),
        (json.dumps({"queries": ["Berlin"], "topk": 11}).encode(), 400),  # --max_k=10
        (json.dumps({"queries": ["Berlin"], "topk": True}).encode(), 400),
        (json.dumps({"queries": ["q"] * 65}).encode(), 400),  # --max_queries=64
        (b"[" * 100_000 + b"]" * 100_000, 400),  # Deep nesting must not crash the server.
    ],
)
def test_server_rejects_bad_requests(server_url, body, status):
    got, payload = _raw_post(server_url, body)
    assert got == status
    assert "error" in json.loads(payload)


def test_server_paths_and_limits(server_url):
    assert _raw_post(server_url, b"{}", path="/nope")[0] == 404
    u = urllib.parse.urlsplit(server_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.putrequest("POST", u.path)
    conn.putheader("Content-Length", str(10**9))  # Refused from the header alone.
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read()) == {"status": "ok"}
    conn.close()
    # Still serving after all of the above.
    client = HttpRetriever(HttpRetrieverConfig(url=server_url))
    assert client.search(["Berlin"], k=1)[0].passages[0].id == "d1"


# ---- Fault injection with in-test servers. ----


@contextlib.contextmanager
def fake_server(respond):
    """Serves ``respond(n, body) -> (status, bytes)`` on 127.0.0.1 (``n`` counts requests)."""
    count = {"n": 0}
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            with lock:
                n = count["n"]
                count["n"] += 1
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, data = respond(n, body)
            with contextlib.suppress(OSError):  # The client may have given up (timeout case).
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve", count
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _ok_body(body: bytes) -> bytes:
    queries = json.loads(body)["queries"]
    return json.dumps(
        {"result": [[{"document": {"id": "x", "contents": f'"T"\n{q}'}, "score": 1.5}] for q in queries]}
    ).encode()


def _client(url, **kw):
    cfg = {"url": url, "timeout_s": 0.3, "max_retries": 2, "backoff_s": 0.01, "backoff_max_s": 0.05} | kw
    return HttpRetriever(HttpRetrieverConfig(**cfg))


def test_slow_server_times_out_then_retry_succeeds():
    def respond(n, body):
        if n == 0:
            time.sleep(1.0)  # Longer than the client's 0.3 s timeout.
        return 200, _ok_body(body)

    with fake_server(respond) as (url, count):
        client = _client(url)
        (result,) = client.search(["q1"], k=1)
    assert result.ok and result.passages[0].text == "q1" and result.passages[0].title == "T"
    stats = client.stats.as_dict()
    assert stats["timeouts"] == 1 and stats["retries"] == 1 and stats["failed_queries"] == 0


def test_dead_server_gives_error_results_quickly():
    port = portpicker.pick_unused_port()  # nothing listens there
    client = _client(f"http://127.0.0.1:{port}/retrieve")
    start = time.monotonic()
    results = client.search(["a", "b", "c"], k=3)
    assert time.monotonic() - start < 5
    assert [r.ok for r in results] == [False] * 3 and all(r.passages == () for r in results)
    assert "connection" in results[0].error
    stats = client.stats.as_dict()
    assert stats["connection_errors"] == 3 and stats["retries"] == 2 and stats["failed_queries"] == 3


@pytest.mark.parametrize(
    "payload",
    [b"{not json", b'{"result": []}', b'{"result": [5]}', b"[]", b'{"result": "x"}'],
)
def test_malformed_response_is_an_error_without_retry(payload):
    with fake_server(lambda n, body: (200, payload)) as (url, count):
        client = _client(url)
        (result,) = client.search(["q"], k=1)
    assert not result.ok and count["n"] == 1
    assert client.stats.as_dict()["bad_responses"] == 1


def test_bad_passages_are_skipped_not_fatal():
    payload = json.dumps(
        {"result": [[{"document": {"id": 1}}, "junk", {"document": {"contents": "A\nb"}, "score": "hi"}]]}
    )
    with fake_server(lambda n, body: (200, payload.encode())) as (url, _):
        client = _client(url)
        (result,) = client.search(["q"], k=3)
    assert result.ok and [(p.title, p.text, p.score) for p in result.passages] == [("A", "b", 0.0)]
    assert client.stats.as_dict()["skipped_passages"] == 2


def test_5xx_is_retried_4xx_is_not():
    with fake_server(lambda n, body: (503, b"busy") if n < 2 else (200, _ok_body(body))) as (url, count):
        client = _client(url)
        assert client.search(["q"], k=1)[0].ok and count["n"] == 3
    with fake_server(lambda n, body: (400, b'{"error": "bad"}')) as (url, count):
        client = _client(url)
        (result,) = client.search(["q"], k=1)
    assert not result.ok and "HTTP 400" in result.error and count["n"] == 1


def test_batches_are_split_and_reassembled():
    with fake_server(lambda n, body: (200, _ok_body(body))) as (url, count):
        client = _client(url, max_batch_queries=2)
        results = client.search([f"q{i}" for i in range(5)], k=1)
    assert [r.passages[0].text for r in results] == [f"q{i}" for i in range(5)] and count["n"] == 3


def test_client_config_validation():
    with pytest.raises(ValueError, match="url"):
        HttpRetrieverConfig(url="ftp://x")
    with pytest.raises(ValueError, match="timeout_s"):
        HttpRetrieverConfig(url="http://127.0.0.1:1/r", timeout_s=0)
