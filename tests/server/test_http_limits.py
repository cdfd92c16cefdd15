"""The HTTP edge bounds every client (kvtier.server.http_limits): header and body read timeouts,
a 413 before the body for a declared Content-Length over the bound, a connection cap, a
never-reading stream aborted with its blocks freed, per-key concurrency and token bucket 429s,
and the asyncio accept-error log filter. The servers use tiny timeouts; nothing asserts on
elapsed time (sockets wait with generous timeouts for what the server must do)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest
from serverutil import MODEL_NAME, scrape

from kvtier.server.http_limits import AcceptErrorFilter, KeyLimiter, RateLimited, parse_rate

WAIT_S = 60.0
"""How long a socket waits for what the server must do (generous: never a timing bound)."""


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    u = urlparse(url)
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(WAIT_S)
    s.connect((u.hostname, u.port))
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def _get_health(s: socket.socket) -> bytes:
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    data = b""
    while b'"ok"' not in data:
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    return data


@pytest.fixture(scope="module")
def edge(serve):
    s = serve("--header-timeout-s", "0.5", "--body-timeout-s", "0.5", "--max-body-bytes", "64KiB")
    yield s
    assert "Traceback" not in s.log(), s.log()


def test_slow_header_is_closed(edge) -> None:
    with _connect(edge.url) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # the head never ends
        assert _read_all(s) == b""
    with _connect(edge.url) as s:  # nothing at all
        assert _read_all(s) == b""


def test_stalled_body_gets_408(edge) -> None:
    with _connect(edge.url) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model": '
        )
        data = _read_all(s)
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert b"connection: close" in data.lower()
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("declared", [5 << 30, 10**19])
def test_huge_declared_length_gets_413_before_the_body(edge, declared: int) -> None:
    with _connect(edge.url) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {declared}\r\n\r\n".encode()
            + b"{}"
        )
        data = _read_all(s)
    assert data.startswith(b"HTTP/1.1 413 "), data
    assert b"connection: close" in data.lower()
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
    assert httpx.get(f"{edge.url}/health", timeout=WAIT_S).status_code == 200


def test_content_length_past_what_h11_parses_gets_400_at_once(edge) -> None:
    """10^20 is past h11's bound on Content-Length: a 400 at once (never a wait for the body)."""
    with _connect(edge.url) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: " + b"1" + b"0" * 20 + b"\r\n\r\n{}")
        data = _read_all(s)
    assert data.startswith(b"HTTP/1.1 400 "), data
    assert b"connection: close" in data.lower()
    assert httpx.get(f"{edge.url}/health", timeout=WAIT_S).status_code == 200


def test_connection_cap_refuses_excess_while_open_ones_work(serve) -> None:
    srv = serve("--max-connections", "2", "--header-timeout-s", "0")
    a, b = _connect(srv.url), _connect(srv.url)
    try:
        _get_health(a)
        _get_health(b)
        with _connect(srv.url) as c:
            data = _read_all(c)
        assert data.startswith(b"HTTP/1.1 503 "), data
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
        _get_health(a)  # the open ones still work
        _get_health(b)
    finally:
        a.close()
        b.close()
    # once they are closed, new connections are served again
    for _ in range(200):
        try:
            if httpx.get(f"{srv.url}/health", timeout=WAIT_S).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    else:
        raise AssertionError("no connection was served after the others closed")


def _big_stream_request() -> bytes:
    """64 prompts x 2 samples x 200 tokens with 20 logprobs: ~10 MB of SSE, more than the
    kernel's socket buffers (up to 4 MB on loopback) and the transport hold, so a client that
    does not read keeps the stream from ending."""
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": ["never read me"] * 64,
            "max_tokens": 200,
            "ignore_eos": True,
            "logprobs": 20,
            "n": 2,
            "stream": True,
        }
    ).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer key-a\r\n" + f"content-length: {len(body)}\r\n\r\n".encode() + body
    )


def test_never_reading_stream_is_aborted_and_its_blocks_freed(serve) -> None:
    srv = serve("--stream-stall-timeout-s", "0.5", "--num-device-blocks", "4096")
    with _connect(srv.url, rcvbuf=4096) as s:
        s.sendall(_big_stream_request())
        key = ("kvtier:stream_aborts_total", (("reason", "client_stalled"),))
        for _ in range(1200):  # the socket is never read while the server gives up on it
            if scrape(srv.url).get(key, 0.0) >= 1.0:
                break
            time.sleep(0.05)
        assert scrape(srv.url)[key] == 1.0
    srv.check_idle_clean()
    assert "read nothing for 0.5 s" in srv.log()


# 10 s a mode, a limit of the HTTP layer before the engine: the default mode only (conftest.py)
@pytest.mark.engine_modes("process")
def test_per_key_concurrency_429_with_retry_after(serve) -> None:
    srv = serve(
        "--max-concurrent-requests-per-key",
        "1",
        "--stream-stall-timeout-s",
        "0",
        "--num-device-blocks",
        "4096",
        "--api-key",
        "key-a",
        "key-b",
    )
    url = f"{srv.url}/v1/completions"
    short = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    with httpx.Client(timeout=WAIT_S) as client:
        with _connect(srv.url, rcvbuf=4096) as held:  # key-a's stream, never read: it holds the slot
            held.sendall(_big_stream_request())
            assert held.recv(12) == b"HTTP/1.1 200"
            r = client.post(url, json=short, headers=a)
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert client.post(url, json=short, headers=b).status_code == 200  # another key
        for _ in range(1200):  # the slot comes back once the stream's cleanup ran
            r = client.post(url, json=short, headers=a)
            if r.status_code != 429:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text


def test_per_key_token_bucket_429(serve) -> None:
    srv = serve("--rate-limit-per-key", "0.001/s:burst=2", "--api-key", "k1", "k2")  # a token per 1000 s
    url = f"{srv.url}/v1/completions"
    short = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    with httpx.Client(timeout=WAIT_S) as client:
        for _ in range(2):
            assert client.post(url, json=short, headers={"Authorization": "Bearer k1"}).status_code == 200
        r = client.post(url, json=short, headers={"Authorization": "Bearer k1"})
        assert r.status_code == 429
        assert r.json()["error"] == {
            "message": r.json()["error"]["message"],
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
        assert 900 <= int(r.headers["retry-after"]) <= 1000
        assert client.post(url, json=short, headers={"Authorization": "Bearer k2"}).status_code == 200


def test_limits_count_addresses_where_any_key_passes() -> None:
    """Without --api-key(s) a client could mint keys: the limits count its address instead."""
    from starlette.requests import Request

    from kvtier.server.app import _client_key

    def request(key: str | None, host: str) -> Request:
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        return Request({"type": "http", "headers": headers, "client": (host, 1234)})

    same_host = [_client_key(request(k, "10.0.0.1"), keys_checked=False) for k in ("a", "b", None)]
    assert len(set(same_host)) == 1
    assert _client_key(request("a", "10.0.0.1"), False) != _client_key(request("a", "10.0.0.2"), False)
    assert _client_key(request("a", "10.0.0.1"), True) == _client_key(request("a", "10.0.0.2"), True)
    assert _client_key(request("a", "10.0.0.1"), True) != _client_key(request("b", "10.0.0.1"), True)


def test_token_bucket_refills_on_the_injected_clock() -> None:
    now = [100.0]
    limiter = KeyLimiter(rate=2.0, burst=3, clock=lambda: now[0])
    for _ in range(3):
        limiter.acquire("k")()
    with pytest.raises(RateLimited) as e:
        limiter.acquire("k")
    assert e.value.status_code == 429 and e.value.headers == {"Retry-After": "1"}  # 0.5 s, rounded up
    limiter.acquire("other")()
    now[0] += 0.5
    limiter.acquire("k")()
    with pytest.raises(RateLimited):
        limiter.acquire("k")
    now[0] += 10.0  # refills to the burst, no further
    for _ in range(3):
        limiter.acquire("k")()
    with pytest.raises(RateLimited):
        limiter.acquire("k")


def test_concurrency_slots_release_once() -> None:
    limiter = KeyLimiter(max_concurrent=2)
    r1, r2 = limiter.acquire("k"), limiter.acquire("k")
    with pytest.raises(RateLimited):
        limiter.acquire("k")
    r1()
    r1()  # idempotent: frees one slot only
    r3 = limiter.acquire("k")
    with pytest.raises(RateLimited):
        limiter.acquire("k")
    r2()
    r3()
    assert limiter.in_flight == {}


def test_parse_rate() -> None:
    assert parse_rate("10") == (10.0, 10)
    assert parse_rate("10/s:burst=20") == (10.0, 20)
    assert parse_rate("0.5/s") == (0.5, 1)
    assert parse_rate("0") == (0.0, 0)
    for bad in ("fast", "10/m", "-1", "10/s:burst=0"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_accept_error_flood_is_rate_limited() -> None:
    now = [0.0]
    flt = AcceptErrorFilter(interval_s=10.0, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            import sys

            exc = sys.exc_info()
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, exc)

    first = record("socket.accept() out of system resource")
    assert flt.filter(first) and first.exc_info is None
    assert not any(flt.filter(record("socket.accept() out of system resource")) for _ in range(1000))
    assert flt.filter(record("something else"))
    now[0] += 10.0
    later = record("socket.accept() out of system resource")
    assert flt.filter(later)
    assert "1000 more suppressed" in later.getMessage()


def test_request_stream_holds_one_undelivered_output() -> None:
    """A reader that does not read holds the newest (cumulative) output only; an error is kept."""
    import asyncio
    from types import SimpleNamespace

    from kvtier.server.async_engine import RequestStream

    async def run() -> None:
        stream = RequestStream("r")
        for k in range(1000):
            stream._put(SimpleNamespace(step=k, finished=False))  # type: ignore[arg-type]
        assert stream._queue.qsize() == 1
        assert (await stream.next()).step == 999
        stream._put(RuntimeError("engine failed"))
        stream._put(SimpleNamespace(step=1000, finished=True))  # type: ignore[arg-type]
        with pytest.raises(RuntimeError):
            await stream.next()

    asyncio.run(run())


def test_refusals_are_paced_up_to_their_retry_after_and_a_cap_per_key() -> None:
    """A 429 waits min(pace_s, Retry-After) before it goes out (a client ignoring Retry-After
    gets one answer per pace per connection); past max_paced_per_key waiting refusals of one
    key, the rest are answered at once."""
    waits: list[tuple[str, float]] = []
    gate = asyncio.Event()
    current = [""]

    async def sleep(s: float) -> None:
        waits.append((current[0], s))
        await gate.wait()

    limiter = KeyLimiter(max_concurrent=1, pace_s=1.0, max_paced_per_key=2, sleep=sleep)

    async def main() -> None:
        limiter.acquire("a")
        refusals = []
        for _ in range(3):
            with pytest.raises(RateLimited) as e:
                limiter.acquire("a")
            refusals.append(e.value)
        current[0] = "a"
        held = [asyncio.create_task(limiter.pace("a", r)) for r in refusals[:2]]
        await asyncio.sleep(0)
        assert waits == [("a", 1.0), ("a", 1.0)] and limiter.paced == {"a": 2}
        await limiter.pace("a", refusals[2])  # the cap: answered at once
        assert len(waits) == 2 and not any(t.done() for t in held)
        current[0] = "b"
        other = asyncio.create_task(limiter.pace("b", RateLimited("x", 0.25)))  # a shorter Retry-After
        await asyncio.sleep(0)
        assert waits[-1] == ("b", 0.25) and limiter.paced == {"a": 2, "b": 1}
        gate.set()
        await asyncio.gather(*held, other)
        assert limiter.paced == {}

    asyncio.run(main())


def test_pacing_off_answers_at_once() -> None:
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    limiter = KeyLimiter(max_concurrent=1, pace_s=0.0, sleep=sleep)
    asyncio.run(limiter.pace("a", RateLimited("x", 1.0)))
    assert waits == []
