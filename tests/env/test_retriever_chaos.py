"""Retriever chaos: our client ↔ fault-injecting proxy ↔ our server, real sockets on 127.0.0.1.

One scenario per fault type: each is either retried (and the search succeeds) or becomes an
error result (which the agent turns into an error observation); every fault is counted. A
server that stays down longer than `max_outage_s` makes `search` raise, not hang.
"""

import threading
import time

import pytest

from tests.env.conftest import CORPUS
from treegrpo_jax.env.bm25 import BM25Retriever
from treegrpo_jax.env.http_client import HttpRetriever, HttpRetrieverConfig
from treegrpo_jax.env.retrieval import RetrieverUnavailableError
from treegrpo_jax.env.retrieval_server import ServerConfig, make_server
from treegrpo_jax.testing.chaos_proxy import REQUEST_FAULTS, ChaosConfig, ChaosProxy, Fault

QUERIES = ["capital of Germany", "highest mountain", "Guido van Rossum"]


@pytest.fixture(scope="module")
def local():
    return BM25Retriever.from_texts([c for _, c in CORPUS], ids=[i for i, _ in CORPUS])


@pytest.fixture(scope="module")
def server_url(local):
    server = make_server(local, ServerConfig(port=0))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    server.shutdown()
    server.server_close()


@pytest.fixture()
def proxy(server_url):
    with ChaosProxy(server_url, ChaosConfig(latency_s=0.5)) as p:
        yield p


def _client(url, **kw):
    cfg = {"url": url, "timeout_s": 0.3, "max_retries": 2, "backoff_s": 0.01, "backoff_max_s": 0.05} | kw
    return HttpRetriever(HttpRetrieverConfig(**cfg))


# fault → (stats counter it raises, whether a retry recovers it)
EXPECTED = {
    Fault.LATENCY: ("timeouts", True),  # 0.5 s > the client's 0.3 s timeout
    Fault.RESET: ("connection_errors", True),
    Fault.HTTP_500: ("http_errors", True),
    Fault.TRUNCATED: ("truncated_responses", True),  # shorter than its Content-Length
    Fault.NON_JSON: ("bad_responses", False),
    Fault.WRONG_COUNT: ("bad_responses", False),
}


def test_every_request_fault_has_an_expectation():
    assert set(EXPECTED) == set(REQUEST_FAULTS)


@pytest.mark.parametrize("fault", list(EXPECTED), ids=str)
def test_each_fault_is_retried_or_becomes_an_error_result(fault, proxy, local):
    counter, recovers = EXPECTED[fault]
    client = _client(proxy.url)
    proxy.script([fault])
    results = client.search(QUERIES, 2)
    stats = client.stats.as_dict()
    assert proxy.counts()[fault] == 1 and stats[counter] == 1
    assert len(results) == len(QUERIES)
    if recovers:
        assert stats["retries"] == 1 and stats["failed_queries"] == 0
        assert results == local.search(QUERIES, 2)
    else:  # a retry would get the same answer: error results, which the agent shows as observations
        assert stats["retries"] == 0 and stats["failed_queries"] == len(QUERIES)
        assert all(not r.ok and r.error for r in results)
    assert client.search(QUERIES, 2) == local.search(QUERIES, 2)  # the next request is clean


def test_short_latency_is_only_slower(proxy, local):
    client = _client(proxy.url, timeout_s=5.0)
    proxy.script([Fault.LATENCY])
    t0 = time.monotonic()
    assert client.search(QUERIES, 2) == local.search(QUERIES, 2)
    assert time.monotonic() - t0 >= 0.5 and client.stats.as_dict()["retries"] == 0


def test_down_server_gives_error_results_then_recovers(proxy, local):
    client = _client(proxy.url)
    proxy.down()
    results = client.search(QUERIES, 2)
    assert all(not r.ok for r in results)
    assert proxy.counts()["down"] == 3 and client.stats.as_dict()["connection_errors"] == 3
    proxy.up()
    assert client.search(QUERIES, 2) == local.search(QUERIES, 2)


def test_outage_longer_than_the_limit_raises_instead_of_hanging(proxy):
    client = _client(proxy.url, max_outage_s=0.2)
    proxy.down()
    t0 = time.monotonic()
    first = client.search(QUERIES, 2)  # the outage starts: error results while it is short
    assert all(not r.ok for r in first)
    time.sleep(0.2)
    with pytest.raises(RetrieverUnavailableError, match=r"unreachable for .*max_outage_s=0.2"):
        client.search(QUERIES, 2)
    assert time.monotonic() - t0 < 5 and client.stats.as_dict()["outages"] == 1


def test_an_answer_resets_the_outage_clock(proxy, local):
    client = _client(proxy.url, max_outage_s=0.3)
    proxy.down()
    client.search(QUERIES, 2)
    proxy.up()
    time.sleep(0.3)
    assert client.search(QUERIES, 2) == local.search(QUERIES, 2)  # up again: no outage
    proxy.script([Fault.NON_JSON])  # a bad answer is still an answer
    client.search(QUERIES, 2)
    assert client.stats.as_dict()["outages"] == 0


def test_random_chaos_never_raises_and_good_answers_are_exact(server_url, local):
    with ChaosProxy(server_url, ChaosConfig.uniform(0.6, latency_s=0.4, seed=3)) as proxy:
        client = _client(proxy.url)
        want = local.search(QUERIES, 2)
        for _ in range(25):
            results = client.search(QUERIES, 2)
            assert len(results) == len(QUERIES)
            assert all(r == w for r, w in zip(results, want, strict=True) if r.ok)
        injected = proxy.counts()
    assert sum(injected.values()) >= 10 and all(injected[f] for f in REQUEST_FAULTS)
