"""ByteLRU: entries with a size in bytes, in least-recently-used order, and their total.

The bookkeeping every capacity-bound tier shares (the host tier's tensors, the disk tier's
index, the simulator's memory tier); the tier decides the capacity and when to evict:

    least recent ──────────────────────────────────────────> most recent
    evict_to() pops from here        touch() / insert() move or add here

Pure Python and not thread-safe: the tier that owns one holds its own lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(slots=True)
class LRUEntry(Generic[K, V]):
    """One entry: what `pop`, `evict_to` and `clear` hand back, and what the LRU holds."""

    key: K
    value: V
    nbytes: int


class ByteLRU(Generic[K, V]):
    """Entries keyed by `K`, each with a value and a size, kept in LRU order; `usage_bytes` is
    the sum of the sizes. Iteration yields the keys, least recent first."""

    __slots__ = ("_entries", "_usage_bytes")

    def __init__(self) -> None:
        self._entries: OrderedDict[K, LRUEntry[K, V]] = OrderedDict()
        self._usage_bytes = 0

    @property
    def usage_bytes(self) -> int:
        """The sum of the entries' sizes."""
        return self._usage_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def entries(self) -> Iterator[LRUEntry[K, V]]:
        """The entries, least recent first (do not change the LRU while iterating)."""
        return iter(self._entries.values())

    def peek(self, key: K) -> LRUEntry[K, V] | None:
        """The entry of `key`, or None; its place in the order is unchanged."""
        return self._entries.get(key)

    def touch(self, key: K) -> LRUEntry[K, V] | None:
        """Make `key` the most recent entry and return it (None, and nothing changes, when absent)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def count_prefix(self, keys: Iterable[K]) -> int:
        """How many LEADING `keys` are present (the order is unchanged)."""
        entries = self._entries
        n = 0
        for key in keys:
            if key not in entries:
                break
            n += 1
        return n

    def count_present(self, keys: Iterable[K]) -> int:
        """How many of `keys` are present, in any order (the order is unchanged)."""
        entries = self._entries
        return sum(1 for key in keys if key in entries)

    def insert(self, key: K, value: V, nbytes: int) -> LRUEntry[K, V] | None:
        """Add `key` as the most recent entry; returns the entry it replaced, if any. Evicts
        nothing: call `evict_to` first to make room."""
        if nbytes < 0:
            raise ValueError(f"an entry's size must be >= 0, got {nbytes}")
        old = self.pop(key)
        self._entries[key] = LRUEntry(key, value, nbytes)
        self._usage_bytes += nbytes
        return old

    def pop(self, key: K) -> LRUEntry[K, V] | None:
        """Remove `key`; returns its entry, or None when absent."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._usage_bytes -= entry.nbytes
        return entry

    def evict_to(self, limit_bytes: int, keep: K | None = None) -> list[LRUEntry[K, V]]:
        """Remove least recent entries, never `keep`, until `usage_bytes <= limit_bytes` or
        nothing else is left; returns them, least recent first. `keep` keeps its place in the
        order. A limit already met evicts nothing."""
        excess = self._usage_bytes - limit_bytes
        if excess <= 0:
            return []
        entries = self._entries
        evicted: list[LRUEntry[K, V]] = []
        if keep is None or keep not in entries:
            while excess > 0 and entries:
                _, entry = entries.popitem(last=False)
                self._usage_bytes -= entry.nbytes
                excess -= entry.nbytes
                evicted.append(entry)
            return evicted
        for key, entry in entries.items():  # `keep` stays where it is: choose, then remove
            if key == keep:
                continue
            evicted.append(entry)
            excess -= entry.nbytes
            if excess <= 0:
                break
        for entry in evicted:
            self.pop(entry.key)
        return evicted

    def clear(self) -> list[LRUEntry[K, V]]:
        """Remove every entry; returns them, least recent first."""
        out = list(self._entries.values())
        self._entries.clear()
        self._usage_bytes = 0
        return out

    def __repr__(self) -> str:
        return f"ByteLRU(len={len(self)}, usage_bytes={self._usage_bytes})"
