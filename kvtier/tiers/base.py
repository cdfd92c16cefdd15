"""The storage-tier protocol below the device pool, with the machinery every tier shares.

A tier stores framed payloads (codec.py) under 16-byte block keys. The base class owns what
must behave the same in every tier, so each backend implements only the raw operations:

    caller ──> Tier.get/put/...   health gate ─ closed? ──> miss / dropped write (stats.skipped)
                                      │ open (or one probe after the backoff)
                                      v
                                  faults: latency, injected error, bandwidth
                                      │
                                      v
                                  backend _get/_put/...   (disk files, Redis, ...)
                                      │ any exception
                                      v
                                  stats.errors[kind] += 1, gate backs off, result is a miss

Contract for callers (the hierarchy's worker threads):
  - Every public method is thread-safe and never raises for backend trouble: a failed read is
    a miss (None / 0), a failed write returns False. Only misuse (a key that is not bytes)
    raises, and it raises before the backend is touched.
  - `get` returns the raw frame. Decoding is the caller's (codec.decode); when it fails, call
    `report_corrupt(key)`: the entry is counted in `stats.corrupt` and deleted.
    `codec.load_tensor` does both.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Iterable, Iterator

logger = logging.getLogger(__name__)


class TierError(Exception):
    """A backend failure. `kind` names it: "timeout", "connection", "disk_full", "io",
    "injected", ... Tiers raise it internally; it never reaches callers of the public methods."""

    def __init__(self, kind: str, message: str = "") -> None:
        super().__init__(f"{kind}: {message}" if message else kind)
        self.kind = kind


# -- fault injection --------------------------------------------------------------------------------

@dataclass
class FaultConfig:
    """Faults a tier adds to its own operations: slow, narrow or flaky storage on demand.

    Used by experiments (what does a 5 ms remote tier cost?) and tests. Latency is added to every
    operation that reaches the backend; the bandwidth cap delays reads and writes by
    nbytes / bandwidth, shared by all threads of the tier (one link, not one per thread).
    """

    latency_s: float = 0.0
    bandwidth_bytes_per_s: float | None = None
    error_rate: float = 0.0
    """Probability that an operation fails with TierError(kind="injected")."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        if self.bandwidth_bytes_per_s is not None and self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth must be positive, got {self.bandwidth_bytes_per_s}")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {self.error_rate}")

    @property
    def active(self) -> bool:
        return self.latency_s > 0 or self.bandwidth_bytes_per_s is not None or self.error_rate > 0

    @classmethod
    def parse(cls, spec: str | None) -> FaultConfig:
        """Parse a CLI flag: "latency_ms=5,bandwidth_mbps=200,error_rate=0.1,seed=3".

        Keys: latency_ms, latency_s, bandwidth_mbps (megabytes per second, 10^6 bytes/s),
        bandwidth_gbps (gigabytes per second), bandwidth_bytes_per_s, error_rate, seed.
        An empty string or "none" means no faults.
        """
        cfg = cls()
        if spec is None or spec.strip().lower() in ("", "none", "off"):
            return cfg
        scale = {"latency_ms": ("latency_s", 1e-3), "latency_s": ("latency_s", 1.0),
                 "bandwidth_mbps": ("bandwidth_bytes_per_s", 1e6),
                 "bandwidth_gbps": ("bandwidth_bytes_per_s", 1e9),
                 "bandwidth_bytes_per_s": ("bandwidth_bytes_per_s", 1.0),
                 "error_rate": ("error_rate", 1.0)}
        values: dict[str, float | int] = {}
        for item in spec.split(","):
            name, sep, raw = item.partition("=")
            name = name.strip().lower()
            if not sep or (name not in scale and name != "seed"):
                raise ValueError(f"bad fault spec item {item!r} in {spec!r}; expected key=value "
                                 f"with key one of {sorted([*scale, 'seed'])}")
            try:
                if name == "seed":
                    values["seed"] = int(raw)
                else:
                    attr, factor = scale[name]
                    values[attr] = float(raw) * factor
            except ValueError:
                raise ValueError(f"bad number {raw!r} for {name!r} in fault spec {spec!r}") from None
        return replace(cfg, **values)


class FaultInjector:
    """Applies one FaultConfig. Thread-safe; the random stream is seeded, so a single-threaded
    run fails the same operations every time."""

    def __init__(self, config: FaultConfig | None, sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config or FaultConfig()
        self._rng = random.Random(self.config.seed)
        self._lock = threading.Lock()
        self._link_free_at = 0.0  # monotonic time when the simulated link is next idle
        self._sleep = sleep

    def before_op(self) -> None:
        """Latency, then maybe an injected failure. Called before the backend is touched."""
        cfg = self.config
        if cfg.latency_s > 0:
            self._sleep(cfg.latency_s)
        if cfg.error_rate > 0:
            with self._lock:
                fail = self._rng.random() < cfg.error_rate
            if fail:
                raise TierError("injected", "fault injection (error_rate)")

    def transfer(self, nbytes: int) -> None:
        """Hold the caller until `nbytes` have passed the capped link (queued behind others)."""
        bw = self.config.bandwidth_bytes_per_s
        if bw is None or nbytes <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._link_free_at)
            self._link_free_at = start + nbytes / bw
            wait_s = self._link_free_at - now
        self._sleep(wait_s)


# -- health ------------------------------------------------------------------------------------------

class HealthGate:
    """Circuit breaker: after a failure the tier is skipped for a backoff, then probed once.

        healthy ──failure──> unhealthy(backoff) ──backoff elapsed──> one probe ──success──> healthy
                                   ^                                     │
                                   └──────── failure: backoff *= 2 ──────┘   (capped at max)

    While unhealthy, `allow()` is False and the tier answers without touching the backend. After
    the backoff exactly one caller is let through (the probe); the others keep being refused
    until the probe reports. The backoff resets on any success.
    """

    def __init__(self, initial_backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
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

    def record_success(self) -> None:
        if self._backoff_s is None:
            return
        with self._lock:
            self._backoff_s = None
            self._probing = False
            self.num_failures = 0

    def record_failure(self) -> None:
        with self._lock:
            if self._backoff_s is None:
                self._backoff_s = self.initial_backoff_s
            elif self._probing or self._clock() >= self._retry_at:
                # a failed probe (or the first failure after the backoff) doubles the wait;
                # failures of operations that started before the gate closed do not
                self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
            self._retry_at = self._clock() + self._backoff_s
            self._probing = False
            self.num_failures += 1


# -- stats -------------------------------------------------------------------------------------------

@dataclass(slots=True)
class TierStats:
    """Counters of one tier since it was created. `Tier.stats` hands out copies."""

    queries: int = 0
    """Keys asked by `get`."""
    hits: int = 0
    """Keys `get` found (before decoding; a corrupt one also counts in `corrupt`)."""
    lookups: int = 0
    """Keys asked by `contains_prefix`."""
    lookup_hits: int = 0
    """Leading keys `contains_prefix` reported present."""
    puts: int = 0
    """Successful puts."""
    deletes: int = 0
    """Entries removed by `delete` / `clear` (not evictions)."""
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0
    """Time spent in `get` and `contains_prefix`, injected faults included."""
    write_s: float = 0.0
    """Time spent in `put`, injected faults included."""
    evictions: int = 0
    corrupt: int = 0
    """Entries that failed their checksum / header (reported by the caller) and were deleted."""
    skipped: int = 0
    """Operations answered without the backend because the tier was unhealthy."""
    errors: dict[str, int] = field(default_factory=dict)
    """Failed operations by TierError kind."""

    def copy(self) -> TierStats:
        out = TierStats(**{f.name: getattr(self, f.name) for f in fields(self)})
        out.errors = dict(self.errors)
        return out

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())


# -- the tier ----------------------------------------------------------------------------------------

def _check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)) or len(key) == 0:
        raise TypeError(f"a block key must be non-empty bytes, got {type(key).__name__}")


class TierCounters:
    """What every tier keeps beside its entries: counters (TierStats) and fault injection. The
    base of `Tier` and of the host tier, which holds tensors rather than framed payloads."""

    def __init__(self, faults: FaultConfig | None = None, stats_lock: threading.Lock | None = None) -> None:
        self._faults = FaultInjector(faults)
        self._stats = TierStats()
        self._stats_lock = stats_lock or threading.Lock()
        """Guards `_stats`; a tier may share its own lock (then it must not hold it when calling
        the methods here)."""

    @property
    def stats(self) -> TierStats:
        """A consistent copy of the counters."""
        with self._stats_lock:
            return self._stats.copy()

    @property
    def faults(self) -> FaultConfig:
        return self._faults.config

    @faults.setter
    def faults(self, config: FaultConfig | None) -> None:
        """Swap the fault config at run time (experiments turn faults on and off)."""
        self._faults = FaultInjector(config)

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            s = self._stats
            for name, delta in deltas.items():
                setattr(s, name, getattr(s, name) + delta)

    def _count_error(self, kind: str) -> None:
        """An error that says nothing about the backend's health (a payload too large)."""
        with self._stats_lock:
            self._stats.errors[kind] = self._stats.errors.get(kind, 0) + 1


class Tier(TierCounters, ABC):
    """One store below the device pool. Subclasses implement the `_`-prefixed backend methods;
    they may raise anything on backend trouble (map it to a kind in `_error_kind`)."""

    name: str

    def __init__(self, name: str, *, faults: FaultConfig | None = None,
                 health: HealthGate | None = None) -> None:
        super().__init__(faults)
        self.name = name
        self._gate = health or HealthGate()

    # -- backend (implemented by each tier) -----------------------------------------------------
    @abstractmethod
    def _contains_prefix(self, keys: list[bytes]) -> int: ...

    @abstractmethod
    def _get(self, key: bytes) -> bytes | None: ...

    @abstractmethod
    def _put(self, key: bytes, payload: bytes, ttl_s: float | None) -> bool:
        """Store; False for a payload the tier refuses (too large), raise on backend failure."""

    @abstractmethod
    def _delete(self, key: bytes) -> bool: ...

    @abstractmethod
    def _keys(self) -> Iterable[bytes]: ...

    @abstractmethod
    def _clear(self) -> int: ...

    def _close(self) -> None:
        pass

    def _error_kind(self, exc: BaseException) -> str:
        """The stats/error kind of a backend exception (subclasses refine it)."""
        if isinstance(exc, TierError):
            return exc.kind
        if isinstance(exc, TimeoutError):
            return "timeout"
        if isinstance(exc, ConnectionError):
            return "connection"
        if isinstance(exc, OSError):
            return "io"
        return "internal"

    @property
    @abstractmethod
    def usage_bytes(self) -> int:
        """Bytes this tier holds (see each tier for how exact)."""

    @property
    def capacity_bytes(self) -> int | None:
        """The most bytes this tier will hold, or None when the backend decides (Redis)."""
        return None

    # -- state -------------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._gate.healthy

    @property
    def health(self) -> HealthGate:
        return self._gate

    def _fail(self, op: str, exc: BaseException) -> None:
        kind = self._error_kind(exc)
        with self._stats_lock:
            self._stats.errors[kind] = self._stats.errors.get(kind, 0) + 1
        self._gate.record_failure()
        if kind == "internal":
            logger.warning("tier %s: unexpected error in %s", self.name, op, exc_info=exc)
        else:
            logger.debug("tier %s: %s failed (%s): %s", self.name, op, kind, exc)

    # -- the public operations ---------------------------------------------------------------------
    def contains_prefix(self, keys: list[bytes]) -> int:
        """How many LEADING keys are present. Cheap: index lookups or one round trip."""
        if not keys:
            return 0
        for key in keys:
            _check_key(key)
        if not self._gate.allow():
            self._count(skipped=1)
            return 0
        t0 = time.perf_counter()
        try:
            self._faults.before_op()
            num_found = self._contains_prefix(keys)
        except Exception as exc:  # backend trouble is a miss, never the caller's exception
            self._fail("contains_prefix", exc)
            return 0
        self._gate.record_success()
        self._count(lookups=len(keys), lookup_hits=num_found, read_s=time.perf_counter() - t0)
        return num_found

    def get(self, key: bytes) -> bytes | None:
        """The stored frame, or None for a miss (absent, unhealthy tier, or backend error)."""
        _check_key(key)
        if not self._gate.allow():
            self._count(skipped=1)
            return None
        t0 = time.perf_counter()
        try:
            self._faults.before_op()
            data = self._get(key)
            if data is not None:
                self._faults.transfer(len(data))
        except Exception as exc:
            self._fail("get", exc)
            return None
        self._gate.record_success()
        nbytes = 0 if data is None else len(data)
        self._count(queries=1, hits=int(data is not None), bytes_read=nbytes,
                    read_s=time.perf_counter() - t0)
        return data

    def _get_many(self, keys: list[bytes]) -> list[bytes | None] | None:
        """A backend's batched read (one round trip); None when it has none."""
        return None

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """`get` for several keys; one round trip where the backend batches (Redis)."""
        if type(self)._get_many is Tier._get_many or len(keys) < 2:
            return [self.get(key) for key in keys]
        for key in keys:
            _check_key(key)
        if not self._gate.allow():
            self._count(skipped=1)
            return [None] * len(keys)
        t0 = time.perf_counter()
        try:
            self._faults.before_op()
            out = self._get_many(keys)
            nbytes = sum(len(d) for d in out if d is not None)
            self._faults.transfer(nbytes)
        except Exception as exc:
            self._fail("get_many", exc)
            return [None] * len(keys)
        self._gate.record_success()
        hits = sum(d is not None for d in out)
        self._count(queries=len(keys), hits=hits, bytes_read=nbytes, read_s=time.perf_counter() - t0)
        return out

    def put(self, key: bytes, payload: bytes, ttl_s: float | None = None) -> bool:
        """Store `payload` under `key` (replacing any entry). True when stored."""
        _check_key(key)
        if not self._gate.allow():
            self._count(skipped=1)
            return False
        t0 = time.perf_counter()
        try:
            self._faults.before_op()
            self._faults.transfer(len(payload))
            stored = self._put(key, payload, ttl_s)
        except Exception as exc:
            self._fail("put", exc)
            return False
        self._gate.record_success()
        if stored:
            self._count(puts=1, bytes_written=len(payload), write_s=time.perf_counter() - t0)
        return stored

    def delete(self, key: bytes) -> bool:
        """Remove one entry. True when it existed."""
        _check_key(key)
        if not self._gate.allow():
            self._count(skipped=1)
            return False
        try:
            self._faults.before_op()
            existed = self._delete(key)
        except Exception as exc:
            self._fail("delete", exc)
            return False
        self._gate.record_success()
        if existed:
            self._count(deletes=1)
        return existed

    def purge(self, keys: Iterable[bytes]) -> int:
        """Delete many entries; returns how many existed."""
        return sum(self.delete(key) for key in keys)

    def report_corrupt(self, key: bytes) -> None:
        """The caller could not decode what `get(key)` returned: count it and delete the entry."""
        self._count(corrupt=1)
        self.delete(key)

    def keys(self) -> Iterator[bytes]:
        """The keys this tier holds for its fingerprint, lazily (nothing when unhealthy).

        A backend error part-way ends the iteration early (counted like any error)."""
        if not self._gate.allow():
            self._count(skipped=1)
            return
        try:
            self._faults.before_op()
            it = iter(self._keys())
            key = next(it, None)
        except Exception as exc:
            self._fail("keys", exc)
            return
        self._gate.record_success()  # before the first yield: an abandoned iterator cannot wedge the gate
        while key is not None:
            yield key
            try:
                key = next(it, None)
            except Exception as exc:
                self._fail("keys", exc)
                return

    def clear(self) -> int:
        """Delete every entry of this tier's fingerprint; returns how many were removed."""
        if not self._gate.allow():
            self._count(skipped=1)
            return 0
        try:
            self._faults.before_op()
            num_removed = self._clear()
        except Exception as exc:
            self._fail("clear", exc)
            return 0
        self._gate.record_success()
        self._count(deletes=num_removed)
        return num_removed

    def close(self) -> None:
        try:
            self._close()
        except Exception as exc:
            logger.debug("tier %s: error while closing: %s", self.name, exc)

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, usage_bytes={self.usage_bytes}, "
                f"capacity_bytes={self.capacity_bytes}, healthy={self.healthy})")
