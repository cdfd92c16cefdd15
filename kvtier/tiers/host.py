"""HostTier: blocks' KV kept as tensors in host memory, LRU within a byte capacity.

Unlike disk and remote, host entries are not framed: a restore is one copy into the device
pool, which is what makes this tier worth having. Entries are immutable; a caller that got a
tensor may keep using it after the tier evicts the entry.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvtier.tiers.base import FaultConfig, TierCounters


class HostTier(TierCounters):
    name = "host"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        faults: FaultConfig | None = None,
        on_evict: Callable[[bytes, object], None] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"host_cache_bytes must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._entries: OrderedDict[bytes, object] = OrderedDict()
        self._sizes: dict[bytes, int] = {}
        self._usage = 0
        self._lock = threading.Lock()
        super().__init__(faults, stats_lock=self._lock)  # one lock for entries and counters
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
        return self._usage

    @property
    def healthy(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    # ------------------------------------------------------------------ operations
    def contains_prefix(self, keys: list[bytes], count: bool = True) -> int:
        n = 0
        entries = self._entries
        for key in keys:
            if key not in entries:
                break
            n += 1
        if count:
            with self._lock:
                self._stats.lookups += len(keys)
                self._stats.lookup_hits += n
        return n

    def get(self, key: bytes):
        """The stored tensor, or None. Injected faults make it a miss (counted as an error)."""
        t0 = time.perf_counter()
        try:
            self._faults.before_op()
        except Exception:
            self._count_error("injected")
            return None
        with self._lock:
            kv = self._entries.get(key)
            if kv is not None:
                self._entries.move_to_end(key)
            size = self._sizes.get(key, 0)
        if kv is not None:
            self._faults.transfer(size)
        with self._lock:
            s = self._stats
            s.queries += 1
            s.hits += kv is not None
            s.bytes_read += size if kv is not None else 0
            s.read_s += time.perf_counter() - t0
        return kv

    def put(self, key: bytes, kv, nbytes: int) -> bool:
        """Store `kv` as the most recent entry, evicting least recent ones until it fits (each
        goes to `on_evict`). False when `nbytes` exceeds the capacity or a fault is injected."""
        if nbytes > self._capacity:
            return False
        t0 = time.perf_counter()
        if self._faults.config.active:
            try:
                self._faults.before_op()
                self._faults.transfer(nbytes)
            except Exception:
                self._count_error("injected")
                return False
        evicted: list[tuple[bytes, object]] = []
        with self._lock:
            old = self._sizes.pop(key, None)
            if old is not None:
                self._usage -= old
                del self._entries[key]
            while self._usage + nbytes > self._capacity and self._entries:
                k, v = self._entries.popitem(last=False)
                self._usage -= self._sizes.pop(k)
                self._stats.evictions += 1
                evicted.append((k, v))
            self._entries[key] = kv
            self._sizes[key] = nbytes
            self._usage += nbytes
            self._stats.puts += 1
            self._stats.bytes_written += nbytes
            self._stats.write_s += time.perf_counter() - t0
        if self.watch is not None:
            for k, _ in evicted:
                self.watch(k, False)
            self.watch(key, True)
        if self.on_evict is not None:
            for k, v in evicted:
                self.on_evict(k, v)
        return True

    def touch(self, keys) -> None:
        """Mark entries used, in the given order (the last one becomes the most recent)."""
        with self._lock:
            for key in keys:
                if key in self._entries:
                    self._entries.move_to_end(key)

    def delete(self, key: bytes, *, only_if: object | None = None) -> bool:
        """Remove an entry; with `only_if`, only while that object is still the stored value."""
        with self._lock:
            if key not in self._sizes or (only_if is not None and self._entries[key] is not only_if):
                return False
            size = self._sizes.pop(key)
            del self._entries[key]
            self._usage -= size
            self._stats.deletes += 1
        if self.watch is not None:
            self.watch(key, False)
        return True

    def purge_where(self, predicate) -> int:
        """Delete every entry whose stored value satisfies `predicate`; returns how many.
        `predicate` runs outside the lock, on a snapshot of the entries, so it may be slow or
        call back into the tier; an entry replaced meanwhile is kept (it was not judged)."""
        with self._lock:
            entries = list(self._entries.items())
        return sum(self.delete(k, only_if=v) for k, v in entries if predicate(v))

    def purge(self, keys) -> int:
        return sum(self.delete(k) for k in keys)

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._entries))

    def clear(self) -> int:
        with self._lock:
            gone = list(self._entries) if self.watch is not None else []
            n = len(self._entries)
            self._entries.clear()
            self._sizes.clear()
            self._usage = 0
            self._stats.deletes += n
        if self.watch is not None:
            for key in gone:
                self.watch(key, False)
        return n

    def close(self) -> None:
        self.clear()
