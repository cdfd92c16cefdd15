"""The storage-tier protocol below the device pool, with the machinery every tier shares.

A tier stores framed payloads (codec.py) under 16-byte block keys. The base class owns what
must behave the same in every tier, so each backend implements only the raw operations:

    caller ──> Tier.get/put/...   health gate (health.py) ─ closed? ──> miss / dropped write
                                      │ open (or one probe after the backoff)    (stats.skipped)
                                      v
                                  faults (faults.py): latency, injected error, bandwidth
                                      │
                                      v
                                  backend _get/_put/...   (disk files, Redis, ...)
                                      │ any exception
                                      v
                                  TierError (errors.py): stats.errors[kind] += 1, gate backs
                                  off, result is a miss

This module keeps the shared machinery (the counters, the log limiter, `Tier` itself); the
error, fault injection and the gate are their own modules, re-exported from here.

Contract for callers (the hierarchy's worker threads):
  - Every public method is thread-safe and never raises for backend trouble: a failed read is
    a miss (None / 0), a failed write returns False. Only misuse (a key that is not bytes)
    raises, and it raises before the backend is touched.
  - `get` returns the raw frame. Decoding is the caller's (codec.decode); when it fails, call
    `report_corrupt(key)`: the entry is counted in `stats.corrupt` and deleted.
    `codec.load_tensor` does both.
  - Every backend access, the public operations and tier-specific ones (`call`), goes through
    `_run`, which always reports the outcome to the gate: no probe can be left open.

Logging (what an operator sees at --log-level warning): a tier going down ("tier disk
unavailable: disk_full: ...; skipping it for 0.5 s, requests recompute") and coming back ("tier
remote is back after 3 failures") at WARNING, and the first error of each kind and the first
corrupt entry at WARNING; repeats within 60 s only at DEBUG, the next WARNING counting them
(LogLimiter, on the gate's clock).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import TypeVar

# the error, fault injection and the health gate live in their own modules; their names stay
# importable from here, their former home
from kvtier.tiers.errors import TierError
from kvtier.tiers.faults import (
    FaultConfig,
    FaultInjector,
    InjectedError,  # noqa: F401 - re-exported
)
from kvtier.tiers.health import HealthGate

_T = TypeVar("_T")

logger = logging.getLogger(__name__)


# -- logging -----------------------------------------------------------------------------------------


class LogLimiter:
    """At most one log record per topic per `interval_s`; counts what it held back.

    Tiers fail in bursts (every operation of a dead server fails): the first failure of a kind
    reaches the log at WARNING, repeats within the interval only at DEBUG, and the next WARNING
    says how many were held back."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def admit(self, topic: str) -> int | None:
        """None: stay quiet. Else the number of records held back since the last one admitted."""
        now = self._clock()
        with self._lock:
            last = self._last.get(topic)
            if last is not None and now - last < self.interval_s:
                self._held[topic] = self._held.get(topic, 0) + 1
                return None
            self._last[topic] = now
            return self._held.pop(topic, 0)


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
    def num_errors(self) -> int:
        return sum(self.errors.values())


# -- the tier ----------------------------------------------------------------------------------------


def _check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)) or len(key) == 0:
        raise TypeError(f"a block key must be non-empty bytes, got {type(key).__name__}")


class TierCounters:
    """What every tier keeps beside its entries: counters (TierStats) and fault injection. The
    base of `Tier` and of the host tier, which holds tensors rather than framed payloads.

    Thread-safety: `_stats_lock` guards `_stats` and nothing else, and no other lock is taken
    while it is held (a leaf lock), so `_count` may be called with or without a tier's own
    entry lock held."""

    def __init__(self, faults: FaultConfig | None = None) -> None:
        self._faults = FaultInjector(faults)
        self._stats = TierStats()
        self._stats_lock = threading.Lock()
        """Guards `_stats` only (a leaf: nothing else is locked while it is held)."""

    @property
    def stats(self) -> TierStats:
        """A consistent copy of the counters."""
        with self._stats_lock:
            return self._stats.copy()

    @property
    def faults(self) -> FaultConfig:
        return self._faults.config

    @faults.setter
    def faults(self, config: FaultConfig | FaultInjector | None) -> None:
        """Swap the fault config at run time (experiments turn faults on and off). An injector
        is taken as it is: tests pass one with a recording `sleep` instead of waiting."""
        self._faults = config if isinstance(config, FaultInjector) else FaultInjector(config)

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
    """One store of framed payloads (codec.py) under 16-byte block keys, below the device pool.

    Stores: whatever the backend holds for this tier's fingerprint; the base class keeps the
    counters (TierStats), the fault injector and the health gate.

    Thread-safety: every public method may be called from any thread. The base class holds no
    lock across a backend call (the gate and the counters have their own leaf locks); each
    backend guards its own state. `get`, `put`, `delete`, `keys`, `clear` and `call` may block
    on the backend (files, the network) and on injected latency or bandwidth;
    `contains_prefix` blocks as little as the backend allows (an in-memory index, one round
    trip).

    Failures: backend trouble never reaches the caller of the public operations: it is
    counted in `stats.errors` by kind, closes the health gate, and the operation degrades to a
    miss (None, 0, an empty iteration) or a dropped write (False). While the gate is closed,
    operations are answered without the backend (`stats.skipped`). `call` is the exception: it
    raises TierError, for tier-specific operations whose caller must know (a purge). Misuse (a
    key that is not bytes) raises TypeError before the backend is touched.

    Subclasses implement the `_`-prefixed backend methods; they may raise anything on backend
    trouble (map it to a kind in `_error_kind`)."""

    name: str

    def __init__(self, name: str, *, faults: FaultConfig | None = None, health: HealthGate | None = None) -> None:
        super().__init__(faults)
        self.name = name
        self.watch: Callable[[bytes, bool], None] | None = None
        """Called as watch(key, present) after an entry is stored (True) or leaves (False) through
        this tier's own operations: put, delete, eviction (kvtier.kv_events). Not for entries
        another process writes or deletes, nor for a backend's own expiry."""
        self._gate = health or HealthGate()
        self._log_limiter = LogLimiter(clock=self._gate.clock)
        """Rate-limits this tier's WARNINGs (per topic: "down", an error kind, "corrupt")."""
        self._down_logged = False  # was the current outage logged at WARNING (then so is its end)

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

    def _fail(self, op: str, exc: BaseException) -> str:
        """Count a backend failure, close the gate, and log it (state changes and the first of
        each kind at WARNING, repeats within the limiter's interval at DEBUG)."""
        kind = self._error_kind(exc)
        with self._stats_lock:
            self._stats.errors[kind] = self._stats.errors.get(kind, 0) + 1
        went_down = self._gate.record_failure()
        if went_down:
            held = self._log_limiter.admit("down")
            self._log_limiter.admit(kind)  # this record is the kind's first report
            self._down_logged = held is not None
            if held is not None:
                logger.warning(
                    "tier %s unavailable: %s: %s; skipping it for %.1f s, requests recompute%s",
                    self.name,
                    kind,
                    exc,
                    self._gate.backoff_s or 0.0,
                    f" ({held} more outages since the last report)" if held else "",
                )
                if kind == "internal":
                    logger.warning("tier %s: unexpected error in %s", self.name, op, exc_info=exc)
                return kind
        held = self._log_limiter.admit(kind)
        if held is None:
            logger.debug("tier %s: %s failed (%s): %s", self.name, op, kind, exc)
        else:
            logger.warning(
                "tier %s: %s failed (%s): %s%s",
                self.name,
                op,
                kind,
                exc,
                f" ({held} more since the last report)" if held else "",
                exc_info=exc if kind == "internal" else None,
            )
        return kind

    def _succeed(self) -> None:
        num_failures = self._gate.record_success()
        if not num_failures:
            return
        level = logging.WARNING if self._down_logged else logging.DEBUG
        logger.log(level, "tier %s is back after %d failures", self.name, num_failures)
        try:
            self._on_recovered()
        except Exception as exc:  # noqa: BLE001 - a hook must not turn the probe's success into an error
            logger.warning("tier %s: recovery hook failed: %s", self.name, exc)

    def _on_recovered(self) -> None:
        """Called once the gate reopens after failures (the remote tier resyncs its sizes)."""

    def _run(self, op: str, fn: Callable[[], _T], *, inject: bool = True) -> _T:
        """The one path to the backend: every operation, public or tier-specific, runs here.

        The gate decides; `fn` runs after the injected faults (unless `inject` is False: the
        later pages of one `keys()` iteration); its outcome always reaches the gate, so no
        probe can be left unreported and wedge the tier. Raises TierError: kind
        "unavailable" when the gate refuses (counted in `skipped`), else the kind of the
        backend's exception (counted in `errors`)."""
        if not self._gate.allow():
            self._count(skipped=1)
            raise TierError("unavailable", f"tier {self.name} is unhealthy (retry in {self._gate.retry_in_s:.1f} s)")
        try:
            if inject:
                self._faults.before_op()
            result = fn()
        except Exception as exc:  # backend trouble: reported, then the caller's miss
            kind = self._fail(op, exc)
            raise TierError(kind, str(exc)) from exc
        except BaseException:  # interrupted (KeyboardInterrupt, GeneratorExit): no verdict
            self._gate.abandon_probe()
            raise
        self._succeed()
        return result

    # -- the public operations ---------------------------------------------------------------------
    def call(self, op: str, fn: Callable[[], _T]) -> _T:
        """Run `fn` (one backend operation named `op`) through the health gate and the faults,
        and report its outcome to the gate: the way for tier-specific operations (a remote
        tier's owner sets) to touch the backend. Raises TierError as `_run` does."""
        return self._run(op, fn)

    def contains_prefix(self, keys: list[bytes], count: bool = True) -> int:
        """How many LEADING keys are present. Cheap: index lookups or one round trip.
        `count=False`: not a prefix-cache query (a store checking what is there already, a
        retried admission), so the lookup counters leave it out."""
        if not keys:
            return 0
        for key in keys:
            _check_key(key)
        t0 = time.perf_counter()
        try:  # backend trouble is a miss, never the caller's exception
            num_found = self._run("contains_prefix", lambda: self._contains_prefix(keys))
        except TierError:
            return 0
        if count:
            self._count(lookups=len(keys), lookup_hits=num_found, read_s=time.perf_counter() - t0)
        return num_found

    def get(self, key: bytes) -> bytes | None:
        """The stored frame, or None for a miss (absent, unhealthy tier, or backend error)."""
        _check_key(key)

        def read() -> bytes | None:
            data = self._get(key)
            if data is not None:
                self._faults.transfer(len(data))
            return data

        t0 = time.perf_counter()
        try:
            data = self._run("get", read)
        except TierError:
            return None
        nbytes = 0 if data is None else len(data)
        self._count(queries=1, hits=int(data is not None), bytes_read=nbytes, read_s=time.perf_counter() - t0)
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

        def read() -> list[bytes | None]:
            out = self._get_many(keys)
            assert out is not None  # overridden: the backend batches
            self._faults.transfer(sum(len(d) for d in out if d is not None))
            return out

        t0 = time.perf_counter()
        try:
            out = self._run("get_many", read)
        except TierError:
            return [None] * len(keys)
        nbytes = sum(len(d) for d in out if d is not None)
        hits = sum(d is not None for d in out)
        self._count(queries=len(keys), hits=hits, bytes_read=nbytes, read_s=time.perf_counter() - t0)
        return out

    def put(self, key: bytes, payload: bytes, ttl_s: float | None = None) -> bool:
        """Store `payload` under `key` (replacing any entry). True when stored."""
        _check_key(key)

        def write() -> bool:
            self._faults.transfer(len(payload))
            return self._put(key, payload, ttl_s)

        t0 = time.perf_counter()
        try:
            stored = self._run("put", write)
        except TierError:
            return False
        if stored:
            self._count(puts=1, bytes_written=len(payload), write_s=time.perf_counter() - t0)
            if self.watch is not None:
                self.watch(key, True)
        return stored

    def delete(self, key: bytes) -> bool:
        """Remove one entry. True when it existed."""
        _check_key(key)
        try:
            existed = self._run("delete", lambda: self._delete(key))
        except TierError:
            return False
        if existed:
            self._count(deletes=1)
            if self.watch is not None:
                self.watch(key, False)
        return existed

    def purge(self, keys: Iterable[bytes]) -> int:
        """Delete many entries; returns how many existed."""
        return sum(self.delete(key) for key in keys)

    def report_corrupt(self, key: bytes, reason: str | None = None) -> None:
        """The caller could not decode what `get(key)` returned: count it, log it (the first at
        WARNING, then at most one per interval) and delete the entry."""
        self._count(corrupt=1)
        held = self._log_limiter.admit("corrupt")
        if held is not None:
            logger.warning(
                "tier %s: corrupt entry %s (%s), deleted; the block is recomputed%s",
                self.name,
                key.hex(),
                reason or "checksum or header check failed",
                f" ({held} more since the last report)" if held else "",
            )
        self.delete(key)

    def keys(self) -> Iterator[bytes]:
        """The keys this tier holds for its fingerprint, lazily (nothing when unhealthy).

        A backend error part-way ends the iteration early (counted like any error); every
        step's outcome reaches the gate before the key is yielded, so an abandoned iterator
        cannot wedge it."""
        it: Iterator[bytes] = iter(())

        def first() -> bytes | None:  # the first step touches the backend: it is the probe
            nonlocal it
            it = iter(self._keys())
            return next(it, None)

        try:
            key = self._run("keys", first)
            while key is not None:
                yield key
                key = self._run("keys", lambda: next(it, None), inject=False)
        except TierError:
            return

    def clear(self) -> int:
        """Delete every entry of this tier's fingerprint; returns how many were removed."""
        try:
            num_removed = self._run("clear", self._clear)
        except TierError:
            return 0
        self._count(deletes=num_removed)
        return num_removed

    def close(self) -> None:
        """Release the backend's resources. Not gated: it must run even while the tier is
        unhealthy, and it never takes the probe (it does not call `allow()`), so it cannot
        wedge the gate; a backend error here is logged and dropped."""
        try:
            self._close()
        except Exception as exc:  # noqa: BLE001 - closing must not raise
            logger.debug("tier %s: error while closing: %s", self.name, exc)

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, usage_bytes={self.usage_bytes}, "
            f"capacity_bytes={self.capacity_bytes}, healthy={self.healthy})"
        )
