"""Bounds on what one HTTP client can hold of `kvtier serve` (uvicorn's h11 protocol).

- `limited_h11_protocol(limits)`: uvicorn's H11Protocol with a header read timeout (a
  connection that has not completed a request head within `header_timeout_s` of its first
  byte, or of connecting, is closed), a body read timeout (a body that stalls longer than
  `body_timeout_s` between chunks gets a 408 and the connection closed), a 413 at once for a
  declared Content-Length over `max_body_bytes` (the body is never read; `Connection: close`)
  and a cap on open connections (beyond `max_connections` a new connection gets a 503 and is
  closed at once, so the process never runs out of file descriptors).
- `raise_nofile_limit` / `default_max_connections`: the soft RLIMIT_NOFILE raised to the hard
  one, and the connection cap derived from it.
- `AcceptErrorFilter`: at most one asyncio `socket.accept() out of system resource` line per
  interval, with the count of those suppressed.
- `KeyLimiter`: requests in flight and a token bucket per API key (or client address), with an
  injectable clock; refusals are `RateLimited` (429, `Retry-After`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.server.protocol import APIError

if TYPE_CHECKING:
    from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("kvtier.server")


@dataclass(frozen=True)
class HTTPLimits:
    """What one connection may hold (0 or None: no bound)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_body_bytes: int = 4 << 20
    max_connections: int = 0


def _raw_response(status: int, reason: str, message: str, code: str, type: str = "invalid_request_error") -> bytes:
    """A complete HTTP/1.1 response with `Connection: close` and an OpenAI-shaped body."""
    body = json.dumps(APIError(message, status, type=type, code=code).body()).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def limited_h11_protocol(limits: HTTPLimits) -> type[H11Protocol]:
    """An H11Protocol subclass enforcing `limits` (pass it as uvicorn.Config(http=...)).
    uvicorn's `auto` picks httptools where installed; this one is h11 always, whose request
    state (`cycle.more_body`, `response_started`) the timers read."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class LimitedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            self._refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if limits.max_connections and len(self.connections) >= limits.max_connections:
                self._refused = True  # never counted among the connections
                self.transport = transport
                message = f"the server has {limits.max_connections} connections open (--max-connections); retry later"
                transport.write(
                    _raw_response(503, "Service Unavailable", message, "too_many_connections", "server_error")
                )
                transport.close()
                return
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timers()
            if not self._refused:
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self.cycle is None or self.cycle.response_complete:
                self._arm_head_timer()  # from the first byte of a keep-alive request
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:  # a request head arrived
                self._cancel_head_timer()
                if self._too_large(self.cycle):
                    return
            self._arm_body_timer()

        def _too_large(self, cycle: Any) -> bool:
            """A declared Content-Length over the bound: 413 now, the body never read."""
            declared = next((v for k, v in cycle.scope["headers"] if k == b"content-length"), b"")
            if not (limits.max_body_bytes and declared.isdigit() and int(declared) > limits.max_body_bytes):
                return False
            message = f"the request body is larger than {limits.max_body_bytes} bytes (--max-body-bytes)"
            self._fail(cycle, _raw_response(413, "Content Too Large", message, "request_too_large"))
            return True

        def _fail(self, cycle: Any, response: bytes) -> None:
            """Answers `response` in place of the app and closes: the app sees a disconnect."""
            cycle.disconnected = True  # the app's own sends are dropped
            cycle.message_event.set()
            self._cancel_timers()
            if not self.transport.is_closing():
                self.transport.write(response)
                self.transport.close()

        def _arm_head_timer(self) -> None:
            if limits.header_timeout_s and self._head_timer is None:
                self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _arm_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            cycle = self.cycle
            if limits.body_timeout_s and cycle is not None and cycle.more_body and not cycle.response_started:
                self._body_timer = self.loop.call_later(limits.body_timeout_s, self._body_timed_out)

        def _cancel_timers(self) -> None:
            self._cancel_head_timer()
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

        def _body_timed_out(self) -> None:
            self._body_timer = None
            cycle = self.cycle
            if cycle is None or not cycle.more_body or cycle.response_started or cycle.disconnected:
                return
            message = f"the request body stalled for {limits.body_timeout_s:g} s (--body-timeout-s)"
            self._fail(cycle, _raw_response(408, "Request Timeout", message, "request_timeout"))

    return LimitedH11Protocol


# ------------------------------------------------------------------ file descriptors
def raise_nofile_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit (where the platform has one) and
    returns the soft limit now in force (0 where unknown)."""
    try:
        import resource
    except ImportError:
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return 0 if soft == resource.RLIM_INFINITY else soft


NOFILE_MARGIN = 64
"""File descriptors kept for the engine, logs, tiers and the listening socket."""
MAX_CONNECTIONS_DEFAULT = 4096


def default_max_connections(nofile: int) -> int:
    """min(nofile - 64, 4096) (at least 1); 4096 where the limit is unknown."""
    if nofile <= 0:
        return MAX_CONNECTIONS_DEFAULT
    return max(1, min(nofile - NOFILE_MARGIN, MAX_CONNECTIONS_DEFAULT))


# ------------------------------------------------------------------ log flood
class AcceptErrorFilter(logging.Filter):
    """On the `asyncio` logger: one `socket.accept() out of system resource` record per
    `interval_s` passes (its message says how many were suppressed since the last one); the
    rest are dropped. Other records pass untouched."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        self.suppressed = 0
        self._last: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if "socket.accept() out of system resource" not in str(record.msg):
            return True
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            self.suppressed += 1
            return False
        self._last = now
        if self.suppressed:
            record.msg = f"{record.msg} ({self.suppressed} more suppressed in the last {self.interval_s:g} s)"
            self.suppressed = 0
        record.exc_info = None  # the traceback is the same each time
        record.exc_text = None
        return True


def install_accept_error_filter(interval_s: float = 10.0) -> AcceptErrorFilter:
    flt = AcceptErrorFilter(interval_s)
    logging.getLogger("asyncio").addFilter(flt)
    return flt


# ------------------------------------------------------------------ per-key limits
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:/s)?\s*(?::\s*burst\s*=\s*(\d+))?\s*$")


def parse_rate(text: str) -> tuple[float, int]:
    """`RATE` or `RATE/s:burst=N` as (requests per second, burst); the burst defaults to
    max(1, ceil(RATE)). `0` is (0, 0): no limit."""
    m = _RATE.match(text)
    if m is None:
        raise ValueError(f"rate {text!r}: expected RATE or RATE/s:burst=N, e.g. 10 or 10/s:burst=20")
    rate = float(m.group(1))
    burst = int(m.group(2)) if m.group(2) is not None else max(1, math.ceil(rate))
    if rate > 0 and burst < 1:
        raise ValueError(f"rate {text!r}: the burst is at least 1")
    return rate, (burst if rate > 0 else 0)


class RateLimited(APIError):
    """A 429 in OpenAI's shape (code `rate_limit_exceeded`) with a `Retry-After` header."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, 429, type="requests", code="rate_limit_exceeded")
        self.retry_after_s = retry_after_s
        self.headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class KeyLimiter:
    """Per key (an API key, or the client address when the request has none): at most
    `max_concurrent` requests in flight (0: unbounded) and a token bucket of `rate` requests
    per second with `burst` (rate 0: unbounded). `clock` is injectable (tests advance it).

    A refusal is paced (`pace`): held up to `pace_s` (never past its Retry-After) before the
    429 goes out, so a client that retries at once, ignoring Retry-After, gets one cheap answer
    per connection per `pace_s` instead of a tight loop of them (a 429 costs the event loop
    about a millisecond: at a thousand a second that is the whole loop). At most
    `max_paced_per_key` refusals of one key wait at a time; past that they are answered at
    once. `sleep` is injectable (tests record the waits)."""

    MAX_IDLE_KEYS = 10_000

    def __init__(
        self,
        max_concurrent: int = 0,
        rate: float = 0.0,
        burst: int = 0,
        clock: Callable[[], float] = time.monotonic,
        pace_s: float = 1.0,
        max_paced_per_key: int = 64,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.max_concurrent = max_concurrent
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.pace_s = pace_s
        self.max_paced_per_key = max_paced_per_key
        self.sleep = sleep
        self.in_flight: dict[str, int] = {}
        self.buckets: dict[str, _Bucket] = {}
        self.paced: dict[str, int] = {}

    async def pace(self, key: str, refusal: RateLimited) -> None:
        """Wait before `refusal` (a 429 of `key`) is sent: min(pace_s, its Retry-After), unless
        `max_paced_per_key` of this key's refusals already wait."""
        wait_s = min(self.pace_s, refusal.retry_after_s)
        waiting = self.paced.get(key, 0)
        if wait_s <= 0 or waiting >= self.max_paced_per_key:
            return
        self.paced[key] = waiting + 1
        try:
            await self.sleep(wait_s)
        finally:
            left = self.paced.get(key, 1) - 1
            if left > 0:
                self.paced[key] = left
            else:
                self.paced.pop(key, None)

    @property
    def enabled(self) -> bool:
        return self.max_concurrent > 0 or self.rate > 0

    def acquire(self, key: str) -> Callable[[], None]:
        """Takes a slot and a token for `key`, or raises RateLimited (nothing taken). Returns
        the release of the slot (idempotent): call it when the request (its stream) ends."""
        if self.max_concurrent and self.in_flight.get(key, 0) >= self.max_concurrent:
            raise RateLimited(
                f"this key has {self.max_concurrent} requests in flight "
                "(--max-concurrent-requests-per-key); retry when one ends",
                1.0,
            )
        if self.rate > 0:
            now = self.clock()
            bucket = self.buckets.get(key)
            if bucket is None:
                if len(self.buckets) >= self.MAX_IDLE_KEYS:
                    self._prune(now)
                bucket = self.buckets[key] = _Bucket(float(self.burst), now)
            bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.stamp) * self.rate)
            bucket.stamp = now
            if bucket.tokens < 1.0:
                raise RateLimited(
                    f"this key is over {self.rate:g} requests per second (--rate-limit-per-key); retry later",
                    (1.0 - bucket.tokens) / self.rate,
                )
            bucket.tokens -= 1.0
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self.in_flight.get(key, 1) - 1
            if left > 0:
                self.in_flight[key] = left
            else:
                self.in_flight.pop(key, None)

        return release

    def _prune(self, now: float) -> None:
        """Forgets buckets that have refilled (they would start full anyway)."""
        for key in [k for k, b in self.buckets.items() if b.tokens + (now - b.stamp) * self.rate >= self.burst]:
            del self.buckets[key]
