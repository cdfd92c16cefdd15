"""HealthGate: a tier's healthy / unhealthy state machine with exponential backoff.

    Tier._run (base.py) ──> gate.allow()? ── no ──> miss / dropped write (stats.skipped)
                                │ yes (healthy, or the one probe after the backoff)
                                v
                            backend ──> gate.record_success() / record_failure()

The gate only decides and counts; the tier logs the transitions it reports (base.Tier._fail,
_succeed) and rate-limits the repeats (base.LogLimiter, on the gate's clock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class HealthGate:
    """Circuit breaker: after a failure the tier is skipped for a backoff, then probed once.

        healthy ──failure──> unhealthy(backoff) ──backoff elapsed──> one probe ──success──> healthy
                                   ^                                     │
                                   └──────── failure: backoff *= 2 ──────┘   (capped at max)

    While unhealthy, `allow()` is False and the tier answers without touching the backend. After
    the backoff exactly one caller is let through (the probe); the others keep being refused
    until the probe reports. The backoff resets on any success.
    """

    def __init__(
        self, initial_backoff_s: float = 0.5, max_backoff_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if initial_backoff_s <= 0 or max_backoff_s < initial_backoff_s:
            raise ValueError("need 0 < initial_backoff_s <= max_backoff_s")
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._backoff_s: float | None = None  # None: healthy
        self._retry_at = 0.0
        self._probing = False
        self.num_failures = 0
        """Consecutive failures (0 when healthy)."""

    @property
    def healthy(self) -> bool:
        return self._backoff_s is None

    @property
    def backoff_s(self) -> float | None:
        """The current backoff, or None when healthy."""
        return self._backoff_s

    @property
    def retry_in_s(self) -> float:
        """Seconds until the next probe is allowed (0 when healthy or due)."""
        with self._lock:
            if self._backoff_s is None:
                return 0.0
            return max(0.0, self._retry_at - self._clock())

    def allow(self) -> bool:
        """May an operation touch the backend now? A True while unhealthy makes the caller the
        probe: it must call record_success or record_failure."""
        if self._backoff_s is None:  # fast path, no lock: a stale read only delays by one op
            return True
        with self._lock:
            if self._backoff_s is None:
                return True
            if self._probing or self._clock() < self._retry_at:
                return False
            self._probing = True
            return True

    @property
    def clock(self) -> Callable[[], float]:
        """The gate's time source (tests inject a manual one; the tier's log limiter shares it)."""
        return self._clock

    def record_success(self) -> int:
        """Returns how many consecutive failures this success ended (0: it was healthy)."""
        if self._backoff_s is None:
            return 0
        with self._lock:
            if self._backoff_s is None:
                return 0
            num_failures = self.num_failures
            self._backoff_s = None
            self._probing = False
            self.num_failures = 0
            return num_failures

    def abandon_probe(self) -> None:
        """The probe was interrupted before it could tell (KeyboardInterrupt, a killed
        thread): say nothing about health, but let the next caller probe."""
        with self._lock:
            self._probing = False

    def record_failure(self) -> bool:
        """Returns True when this failure took the gate from healthy to unhealthy."""
        with self._lock:
            backoff_s = self._backoff_s
            was_healthy = backoff_s is None
            if backoff_s is None:
                backoff_s = self.initial_backoff_s
            elif self._probing or self._clock() >= self._retry_at:
                # a failed probe (or the first failure after the backoff) doubles the wait;
                # failures of operations that started before the gate closed do not
                backoff_s = min(backoff_s * 2, self.max_backoff_s)
            self._backoff_s = backoff_s
            self._retry_at = self._clock() + backoff_s
            self._probing = False
            self.num_failures += 1
            return was_healthy
