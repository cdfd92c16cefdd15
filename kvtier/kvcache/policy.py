"""Eviction policies: which unreferenced cached block to give up first.

A policy only orders blocks; the index says which of them may go (leaves only, so that no cached
block is left unreachable). Contract:

- `add(key, hits)`: the block became evictable (unreferenced, and no cached descendant in use).
- `remove(key)`: the block was referenced again or evicted. Removing an absent key is a no-op.
- `pop_victim(is_leaf)`: remove and return the preferred key for which `is_leaf(key)` is true,
  or None if none qualifies. Skipped keys stay in the policy.

Both built-in policies are O(1) amortised per operation: a block enters the policy only once its
whole cached subtree is in it (the index pins the rest), and every hit on a child also hits its
parent, so a parent is always after its children in LRU order and has at least their hits in
LFU order: the first candidate is a leaf unless hits are recorded outside that pattern.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from kvtier.kvcache.keys import BlockKey


class EvictionPolicy(Protocol):
    name: str

    def add(self, key: BlockKey, hits: int) -> None: ...
    def remove(self, key: BlockKey) -> None: ...
    def pop_victim(self, is_leaf: Callable[[BlockKey], bool]) -> BlockKey | None: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...


class LRUPolicy:
    """Least recently freed first (a block is "used" until it is freed)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def add(self, key: BlockKey, hits: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def pop_victim(self, is_leaf: Callable[[BlockKey], bool]) -> BlockKey | None:
        for key in self._order:
            if is_leaf(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class LFUPolicy:
    """Fewest hits first; ties broken by least recently freed."""

    name = "lfu"

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, BlockKey]] = []
        self._live: dict[BlockKey, int] = {}  # key -> sequence number of its live heap entry
        self._seq = itertools.count()

    def add(self, key: BlockKey, hits: int) -> None:
        seq = next(self._seq)
        self._live[key] = seq
        heapq.heappush(self._heap, (hits, seq, key))

    def remove(self, key: BlockKey) -> None:
        self._live.pop(key, None)
        if len(self._heap) > 4 * len(self._live) + 64:  # drop dead entries now and then
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def pop_victim(self, is_leaf: Callable[[BlockKey], bool]) -> BlockKey | None:
        skipped: list[tuple[int, int, BlockKey]] = []
        victim = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._live.get(entry[2]) != entry[1]:
                continue  # stale
            if is_leaf(entry[2]):
                victim = entry[2]
                del self._live[victim]
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return victim

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live


POLICIES: dict[str, type] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
