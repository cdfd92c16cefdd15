"""HostTier: blocks' KV kept as tensors in host memory, LRU within a byte capacity.

Unlike disk and remote, host entries are not framed: a restore is one copy into the device
pool, which is what makes this tier worth having. Entries are immutable; a caller that got an
entry may keep using its tensor after the tier evicts it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvtier.identity import Owner, tenant_of
from kvtier.tiers.base import TierCounters
from kvtier.tiers.faults import FaultConfig, InjectedError
from kvtier.tiers.fence import Stamp
from kvtier.tiers.lru import ByteLRU


@dataclass(slots=True)
class HostEntry:
    """What the host tier holds for one block (made by the hierarchy, never changed)."""

    kv: Any
    """The block's KV: a tensor (the simulator's: a marker)."""
    owner: Owner
    """Whose request computed it: its Tenancy (kvtier.identity), or a tenant's name (None: no
    named tenant). Selected by the tenant's name (`owner_keys`, `purge_owner`, `expire_owner`)."""
    stored_at: float
    """time.monotonic() when it was stored: tenant TTLs expire it from here."""
    stamp: Stamp
    """Its owner's purge-fence stamp when it was made (fence.OwnerFence): a load or a
    write-back demotion of an entry stamped before a purge of its owner uses nothing of it."""


class HostTier(TierCounters):
    """Host-memory entries (HostEntry) under block keys, least recently used first out once
    their sizes pass `capacity_bytes`.

    Thread-safety: every method may be called from any thread. `_lock` guards the entries
    (the LRU) and is held only for in-memory bookkeeping, never while calling out; the
    counters have their own lock (TierCounters._stats_lock, a leaf), so counting never needs
    `_lock` and cannot deadlock on it. Callbacks (`on_evict`, `watch`) and `purge_where`'s
    predicate run without `_lock`, so they may call back into the tier. `contains_prefix`,
    `__contains__` and `__len__` read the entries without the lock (single dict look-ups).
    Only injected faults (FaultConfig) make an operation block.

    Failures: nothing here touches a backend. An injected fault (InjectedError) makes `get` a
    miss and `put` a dropped write, counted in `stats.errors["injected"]`; any other exception
    is a bug and propagates. A put larger than the capacity is refused (False)."""

    name = "host"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        faults: FaultConfig | None = None,
        on_evict: Callable[[bytes, HostEntry], None] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"host_cache_bytes must be positive, got {capacity_bytes}")
        super().__init__(faults)
        self._capacity = capacity_bytes
        self._lru: ByteLRU[bytes, HostEntry] = ByteLRU()
        self._lock = threading.Lock()
        """Guards `_lru`; never held while calling out or counting."""
        self.on_evict = on_evict
        """Called (outside the lock) with each entry pushed out by capacity: write-back demotion."""
        self.watch: Callable[[bytes, bool], None] | None = None
        """Called (outside the lock) as watch(key, present) whenever a key enters (True) or leaves
        (False) the tier, for any reason: a process that cannot see this tier keeps a mirror of
        its keys by it (the vLLM connector's scheduler side)."""

    # ------------------------------------------------------------------ properties
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def usage_bytes(self) -> int:
        return self._lru.usage_bytes

    @property
    def healthy(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    # ------------------------------------------------------------------ operations
    def contains_prefix(self, keys: list[bytes], count: bool = True) -> int:
        """How many LEADING keys are present (`count=False`: not a prefix-cache query, left
        out of the lookup counters)."""
        n = self._lru.count_prefix(keys)
        if count:
            with self._stats_lock:
                self._stats.lookups += len(keys)
                self._stats.lookup_hits += n
        return n

    def get(self, key: bytes) -> HostEntry | None:
        """The stored entry (now the most recent), or None. An injected fault makes it a miss
        (counted as an error)."""
        t0 = time.perf_counter()
        try:
            self._faults.before_op()
        except InjectedError:
            self._count_error("injected")
            return None
        with self._lock:
            found = self._lru.touch(key)
        if found is not None:
            self._faults.transfer(found.nbytes)
        with self._stats_lock:
            s = self._stats
            s.queries += 1
            if found is not None:
                s.hits += 1
                s.bytes_read += found.nbytes
            s.read_s += time.perf_counter() - t0
        return None if found is None else found.value

    def put(self, key: bytes, entry: HostEntry, nbytes: int) -> bool:
        """Store `entry` as the most recent one (replacing any under `key`), evicting least
        recent ones until it fits (each goes to `on_evict`). False when `nbytes` exceeds the
        capacity or a fault is injected."""
        if nbytes > self._capacity:
            return False
        t0 = time.perf_counter()
        if self._faults.config.active:
            try:
                self._faults.before_op()
                self._faults.transfer(nbytes)
            except InjectedError:
                self._count_error("injected")
                return False
        with self._lock:
            self._lru.pop(key)
            evicted = self._lru.evict_to(self._capacity - nbytes)
            self._lru.insert(key, entry, nbytes)
        with self._stats_lock:
            s = self._stats
            s.evictions += len(evicted)
            s.puts += 1
            s.bytes_written += nbytes
            s.write_s += time.perf_counter() - t0
        if self.watch is not None:
            for gone in evicted:
                self.watch(gone.key, False)
            self.watch(key, True)
        if self.on_evict is not None:
            for gone in evicted:
                self.on_evict(gone.key, gone.value)
        return True

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark entries used, in the given order (the last one becomes the most recent)."""
        with self._lock:
            for key in keys:
                self._lru.touch(key)

    def delete(self, key: bytes, *, only_if: HostEntry | None = None) -> bool:
        """Remove an entry; with `only_if`, only while that object is still the stored entry."""
        with self._lock:
            found = self._lru.peek(key)
            if found is None or (only_if is not None and found.value is not only_if):
                return False
            self._lru.pop(key)
        self._count(deletes=1)
        if self.watch is not None:
            self.watch(key, False)
        return True

    def purge_where(self, predicate: Callable[[HostEntry], bool]) -> int:
        """Delete every entry that satisfies `predicate`; returns how many. `predicate` runs
        outside the lock, on a snapshot of the entries, so it may be slow or call back into the
        tier; an entry replaced meanwhile is kept (it was not judged)."""
        with self._lock:
            snapshot = [(e.key, e.value) for e in self._lru.entries()]
        return sum(self.delete(k, only_if=v) for k, v in snapshot if predicate(v))

    def purge(self, keys: Iterable[bytes]) -> int:
        return sum(self.delete(k) for k in keys)

    # ------------------------------------------------------------------ tenants
    def owner_keys(self, owner: str | None) -> list[bytes]:
        """The keys of `owner`'s entries (the tenant's name, not its owner id), least recent
        first."""
        with self._lock:
            return [e.key for e in self._lru.entries() if tenant_of(e.value.owner) == owner]

    def purge_owner(self, owner: str | None) -> int:
        """Delete every entry of `owner`; returns how many."""
        return self.purge_where(lambda e: tenant_of(e.owner) == owner)

    def expire_owner(self, owner: str | None, ttl_s: float, now: float | None = None) -> int:
        """Delete `owner`'s entries stored more than `ttl_s` before `now` (a time.monotonic();
        default the current one); returns how many."""
        cutoff = (time.monotonic() if now is None else now) - ttl_s
        return self.purge_where(lambda e: tenant_of(e.owner) == owner and e.stored_at < cutoff)

    # ------------------------------------------------------------------ whole tier
    def keys(self) -> Iterator[bytes]:
        """A snapshot of the keys, least recent first."""
        with self._lock:
            return iter(list(self._lru))

    def clear(self) -> int:
        with self._lock:
            gone = self._lru.clear()
        self._count(deletes=len(gone))
        if self.watch is not None:
            for entry in gone:
                self.watch(entry.key, False)
        return len(gone)

    def close(self) -> None:
        self.clear()
