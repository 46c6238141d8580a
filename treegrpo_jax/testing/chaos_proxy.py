"""A fault-injecting HTTP/TCP proxy for the retrieval protocol (a testing tool).

Sits on 127.0.0.1 between `HttpRetriever` and a real retrieval server, one real socket
on each side, and breaks chosen requests in the ways networks and servers break:

  latency       forward the request after `latency_s` (beyond the client's timeout: a timeout)
  reset         read the request, then reset the connection (RST, no answer)
  http_500      answer 500 without asking the server
  truncated     forward; send the headers and half the body, then close
  non_json      forward; replace the body with an HTML error page (status 200)
  wrong_count   forward; drop the last query's list from "result"
  down          (while `down()` is in effect) reset every connection as soon as it arrives

Which request gets which fault: first the queue given to `script`, then at random by
`ChaosConfig.rates` (seeded, so a run is repeatable). `injected` counts every fault
applied. The client speaks one request per connection (`HttpRetriever` closes after each),
and so does our server (HTTP/1.0), which keeps the proxy a simple read-all/write-all relay.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import json
import random
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterable

_MAX_HEAD = 64 << 10
_MAX_BODY = 64 << 20


class Fault(enum.StrEnum):
    NONE = "none"
    LATENCY = "latency"
    RESET = "reset"
    HTTP_500 = "http_500"
    TRUNCATED = "truncated"
    NON_JSON = "non_json"
    WRONG_COUNT = "wrong_count"
    DOWN = "down"


# The faults a request can draw at random (DOWN is a mode, switched by `down()` / `up()`).
REQUEST_FAULTS = tuple(f for f in Fault if f not in (Fault.NONE, Fault.DOWN))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """How often each fault strikes a request, and how slow `latency` is.

    Attributes:
      rates: fault → probability per request (each in [0, 1], summing to at most 1).
      latency_s: the delay of a `latency` fault.
      seed: seeds the draws.
      upstream_timeout_s: socket timeout towards the server.
    """

    rates: tuple[tuple[Fault, float], ...] = ()
    latency_s: float = 0.2
    seed: int = 0
    upstream_timeout_s: float = 30.0

    def __post_init__(self):
        rates = tuple((Fault(f), float(p)) for f, p in dict(self.rates).items())
        for fault, p in rates:
            if fault in (Fault.NONE, Fault.DOWN) or not 0 <= p <= 1:
                raise ValueError(
                    f"ChaosConfig.rates: {fault}={p}; allowed faults {[f.value for f in REQUEST_FAULTS]} "
                    "with probabilities in [0, 1]"
                )
        if sum(p for _, p in rates) > 1 + 1e-9:
            raise ValueError(f"ChaosConfig.rates sum to {sum(p for _, p in rates)} > 1")
        if self.latency_s < 0 or self.upstream_timeout_s <= 0:
            raise ValueError("ChaosConfig.latency_s must be ≥ 0 and upstream_timeout_s > 0")
        object.__setattr__(self, "rates", rates)

    @classmethod
    def uniform(cls, total: float, **kw) -> ChaosConfig:
        """Every request fault equally likely, `total` the chance that a request is hit."""
        return cls(rates=tuple((f, total / len(REQUEST_FAULTS)) for f in REQUEST_FAULTS), **kw)


def _reset(sock: socket.socket) -> None:
    # Linger on with a zero timeout: close() sends RST instead of FIN.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _read_request(sock: socket.socket) -> bytes | None:
    """The whole request (head + Content-Length body); None if the client went away."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk or len(data) > _MAX_HEAD:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = min(int(value.strip() or 0), _MAX_BODY)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        body += chunk
    return head + b"\r\n\r\n" + body


def _with_body(head: bytes, body: bytes, status: bytes | None = None) -> bytes:
    """`head` with its Content-Length (and optionally its status line) replaced, then `body`."""
    lines = head.split(b"\r\n")
    if status is not None:
        lines[0] = b"HTTP/1.0 " + status
    lines = [ln for ln in lines if not ln.lower().startswith(b"content-length:")]
    lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class ChaosProxy:
    """Listens on 127.0.0.1 (free port) and relays to `upstream_url`'s host and port.

    Use as a context manager, or `start()` / `close()`. `url` is `upstream_url` with the
    proxy's address, so a client configured with it goes through the proxy.
    """

    def __init__(self, upstream_url: str, cfg: ChaosConfig | None = None):
        self.cfg = cfg or ChaosConfig()
        parsed = urllib.parse.urlsplit(upstream_url)
        self._upstream = (parsed.hostname, parsed.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)  # so the accept loop notices `close()`
        port = self._listener.getsockname()[1]
        self.url = urllib.parse.urlunsplit(parsed._replace(netloc=f"127.0.0.1:{port}"))
        self._lock = threading.Lock()
        self._rng = random.Random(self.cfg.seed)
        self._queue: collections.deque[Fault] = collections.deque()
        self._down = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="chaos-proxy", daemon=True)
        self.injected: collections.Counter[Fault] = collections.Counter()
        self.requests = 0
        self.largest_request_bytes = 0

    # ------------------------------------------------------------------ control
    def start(self) -> ChaosProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._listener.close()

    def __enter__(self) -> ChaosProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def script(self, faults: Iterable[Fault | str]) -> None:
        """The next requests get these faults, in order (then the random draws resume)."""
        with self._lock:
            self._queue.extend(Fault(f) for f in faults)

    def down(self) -> None:
        """Every connection is reset on arrival until `up()`: the server looks dead."""
        self._down = True

    def up(self) -> None:
        self._down = False

    def counts(self) -> dict[str, int]:
        """Faults injected so far, by name (all faults listed, zeros included)."""
        with self._lock:
            return {f.value: self.injected[f] for f in Fault if f != Fault.NONE}

    # ---------------------------------------------------------------- internals
    def _draw(self) -> Fault:
        with self._lock:
            if self._queue:
                fault = self._queue.popleft()
            else:
                r, fault = self._rng.random(), Fault.NONE
                for f, p in self.cfg.rates:
                    if r < p:
                        fault = f
                        break
                    r -= p
            if fault != Fault.NONE:
                self.injected[fault] += 1
            return fault

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        if self._down:
            with self._lock:
                self.injected[Fault.DOWN] += 1
            _reset(client)
            return
        try:
            client.settimeout(self.cfg.upstream_timeout_s)
            request = _read_request(client)
            if request is None:
                client.close()
                return
            with self._lock:
                self.requests += 1
                self.largest_request_bytes = max(self.largest_request_bytes, len(request))
            fault = self._draw()
            if fault == Fault.RESET:
                _reset(client)
                return
            if fault == Fault.HTTP_500:
                body = json.dumps({"error": "injected fault"}).encode()
                client.sendall(_with_body(b"HTTP/1.0 500 Internal Server Error", body))
                client.close()
                return
            if fault == Fault.LATENCY:
                time.sleep(self.cfg.latency_s)
            response = self._forward(request)
            client.sendall(self._mangle(response, fault))
            client.close()
        except OSError:  # the client gave up (its timeout) or the server is gone: drop it
            client.close()

    def _forward(self, request: bytes) -> bytes:
        with socket.create_connection(self._upstream, timeout=self.cfg.upstream_timeout_s) as up:
            up.sendall(request)
            chunks = []
            while chunk := up.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)

    def _mangle(self, response: bytes, fault: Fault) -> bytes:
        head, _, body = response.partition(b"\r\n\r\n")
        if fault == Fault.TRUNCATED:
            return head + b"\r\n\r\n" + body[: len(body) // 2]  # Content-Length still says all of it
        if fault == Fault.NON_JSON:
            return _with_body(head, b"<html><body><h1>502 Bad Gateway</h1></body></html>", b"200 OK")
        if fault == Fault.WRONG_COUNT:
            try:
                payload = json.loads(body)
                payload["result"] = payload["result"][:-1]
            except (ValueError, KeyError, TypeError):  # not a result body: break it some other way
                payload = {"result": "not a list"}
            return _with_body(head, json.dumps(payload).encode())
        return response
