"""What a tenant purge needs beside the tiers: a fence around in-flight I/O, a durable record
of purges that could not finish, and the requests that tell running processes about a purge
(the purge itself: tenants.TenantAdmin; from outside a running engine: kvtier.tiers.purge).
Below the hierarchy: this module imports nothing above kvtier.tiers.remote (and that lazily,
for redis).

    engine thread                         admin worker                    I/O workers
    -------------                         ------------                    -----------
    abort the tenant's requests
    evict its device blocks
    fence.begin(oid)  (stamp += 1) ---->  fence.wait_quiet(oid)  <-----   ops stamped before
                                          delete host/disk/remote         begin() finish; later
                                          destroy the data key            ones see a stale stamp
                                          ledger.done(...) / keep pending  or `purging` and skip
                                          fence.end(oid)

Every store, load and host demotion carries the stamp its owner had when the work was queued.
It touches a tier only inside `fence.enter(oid, stamp)`, which refuses stale stamps and owners
with a purge in progress, so once `wait_quiet` returns nothing of the tenant from before the
purge can be written anywhere again: what is already written is what the purge deletes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ALL = "*"
"""The owner id of a purge of every tenant."""

Stamp = tuple[int, int]


class OwnerFence:
    """Generation stamps and in-flight counts per owner id (thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._gen: dict[str, int] = {}
        self._all_gen = 0
        self._active: dict[str, int] = {}
        self._purging: dict[str, int] = {}

    def stamp(self, oid: str) -> Stamp:
        """The stamp work for `oid` queued now carries."""
        return (self._all_gen, self._gen.get(oid, 0))

    def current(self, oid: str, stamp: Stamp) -> bool:
        return stamp == (self._all_gen, self._gen.get(oid, 0))

    def purging(self, oid: str) -> bool:
        """A purge of `oid` (or of everyone) has begun and not finished."""
        return bool(self._purging.get(oid) or self._purging.get(ALL))

    @contextmanager
    def enter(self, oid: str, stamp: Stamp) -> Iterator[bool]:
        """Yields whether work stamped `stamp` may touch the tiers; while it runs, a purge of
        `oid` waits for it in `wait_quiet`."""
        with self._cond:
            ok = self.current(oid, stamp) and not self.purging(oid)
            if ok:
                self._active[oid] = self._active.get(oid, 0) + 1
        try:
            yield ok
        finally:
            if ok:
                with self._cond:
                    self._active[oid] -= 1
                    self._cond.notify_all()

    def begin(self, oid: str) -> None:
        """Stale every stamp of `oid` (ALL: of everyone) and refuse new work until `end`."""
        with self._cond:
            if oid == ALL:
                self._all_gen += 1
            else:
                self._gen[oid] = self._gen.get(oid, 0) + 1
            self._purging[oid] = self._purging.get(oid, 0) + 1

    def wait_quiet(self, oid: str, timeout_s: float | None = None) -> bool:
        """Wait until no work of `oid` (ALL: of anyone) is inside `enter`. True if quiet."""

        def quiet() -> bool:
            if oid == ALL:
                return not any(self._active.values())
            return not self._active.get(oid)

        with self._cond:
            return self._cond.wait_for(quiet, timeout_s)

    def end(self, oid: str) -> None:
        with self._cond:
            n = self._purging.get(oid, 0) - 1
            if n > 0:
                self._purging[oid] = n
            else:
                self._purging.pop(oid, None)


class PurgeLedger:
    """Purges whose remote part could not be done yet, kept in a JSON file (written atomically)
    so that a restarted process still refuses the tenant's remote entries and finishes the job.
    `path` None: kept in memory only (no directory was configured)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, Any]] = {}
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text())
                self._pending = {str(k): dict(v) for k, v in data.get("pending", {}).items()}
            except (OSError, ValueError, AttributeError):
                self._pending = {}

    def pending(self) -> dict[str, dict[str, Any]]:
        """{owner id: {"tiers": [...], "since": time.time()}}."""
        with self._lock:
            return {k: dict(v) for k, v in self._pending.items()}

    def add(self, oid: str, tiers: list[str]) -> None:
        with self._lock:
            entry = self._pending.setdefault(oid, {"tiers": [], "since": time.time()})
            entry["tiers"] = sorted(set(entry["tiers"]) | set(tiers))
            self._save()

    def done(self, oid: str) -> None:
        with self._lock:
            if self._pending.pop(oid, None) is not None:
                self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"pending": self._pending}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


# ---------------------------------------------------------------------------------------------
# Purges from outside a running engine (`kvtier cache purge`): the vLLM connector's tenants.

PURGE_REQUESTS_DIR = "purge-requests"
"""Beside the disk tier (or the key directory): one file per owner id, its mtime the request."""
PURGE_REQUESTS_HASH = b"kvtier:purge-requests"
"""In Redis: owner id -> unix time of the latest purge request."""


class PurgeRequests:
    """Where `kvtier cache purge` tells running processes (vLLM workers with the kvtier
    connector) that a tenant was purged, so that they drop what they hold in memory (their host
    tier) and fence the tenant's in-flight stores: files in a shared directory and/or a Redis hash.
    Both are polled; a request is identified by (owner id, time)."""

    def __init__(self, directory: str | os.PathLike | None = None, redis_url: str | None = None) -> None:
        self.directory = Path(directory) / PURGE_REQUESTS_DIR if directory else None
        self.redis_url = redis_url
        self._client: Any = None

    def _redis(self) -> Any:
        if self._client is None and self.redis_url:
            from kvtier.tiers.remote import connect  # redis: only when a URL is configured

            self._client = connect(self.redis_url, timeout_s=1.0)
        return self._client

    def post(self, oid: str, when: float | None = None) -> list[str]:
        """Record a purge request of `oid`; returns where it was recorded."""
        when = time.time() if when is None else when
        done: list[str] = []
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = self.directory / oid
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(repr(when))
            os.utime(path, (when, when))
            done.append(str(path))
        if self.redis_url:
            self._redis().hset(PURGE_REQUESTS_HASH, oid, repr(when))
            done.append(self.redis_url)
        return done

    def poll(self) -> dict[str, float]:
        """{owner id: time of its latest request} from every place configured (errors: skipped)."""
        out: dict[str, float] = {}
        if self.directory is not None and self.directory.is_dir():
            try:
                for entry in os.scandir(self.directory):
                    if entry.is_file():
                        out[entry.name] = max(out.get(entry.name, 0.0), entry.stat().st_mtime)
            except OSError:
                pass
        if self.redis_url:
            try:
                for oid, when in (self._redis().hgetall(PURGE_REQUESTS_HASH) or {}).items():
                    oid = oid.decode() if isinstance(oid, bytes) else str(oid)
                    out[oid] = max(out.get(oid, 0.0), float(when))
            except Exception:  # noqa: BLE001, S110 - Redis down: the directory still answers, or later
                pass
        return out
