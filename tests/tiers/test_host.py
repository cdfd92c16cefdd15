"""HostTier: LRU within its capacity, the tenant methods the hierarchy uses, the counters' own
lock, and which fault-injector exceptions count as injected."""

from __future__ import annotations

import time

import pytest

from kvtier.tiers.base import FaultConfig, FaultInjector, InjectedError, TierError
from kvtier.tiers.host import HostEntry, HostTier


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def entry(kv: object, owner: str | None = None, stored_at: float | None = None) -> HostEntry:
    return HostEntry(kv, owner, time.monotonic() if stored_at is None else stored_at, (0, 0))


def test_put_evicts_least_recent_and_hands_them_to_on_evict() -> None:
    evicted: list[tuple[bytes, object]] = []
    host = HostTier(30, on_evict=lambda k, e: evicted.append((k, e.kv)))
    for i in range(3):
        assert host.put(key(i), entry(i), 10)
    host.touch([key(0)])  # 1 is now the least recent
    assert host.put(key(3), entry(3), 20)
    assert evicted == [(key(1), 1), (key(2), 2)]
    assert list(host.keys()) == [key(0), key(3)] and host.usage_bytes == 30
    s = host.stats
    assert (s.puts, s.evictions, s.bytes_written) == (4, 2, 50)
    assert not host.put(key(9), entry(9), 31)  # larger than the capacity: refused
    assert host.stats.puts == 4


def test_get_returns_the_entry_and_counts_hits() -> None:
    host = HostTier(100)
    stored = entry("kv")
    host.put(key(1), stored, 10)
    assert host.get(key(1)) is stored and host.get(key(2)) is None
    s = host.stats
    assert (s.queries, s.hits, s.bytes_read) == (2, 1, 10)
    assert host.contains_prefix([key(1), key(2)]) == 1
    assert (host.stats.lookups, host.stats.lookup_hits) == (2, 1)


def test_counters_have_their_own_lock() -> None:
    """Counting never needs the entries' lock: stats can be read (and counted) while it is held."""
    host = HostTier(100)
    host.put(key(1), entry(1), 10)
    with host._lock:
        assert host.stats.puts == 1
        host._count(deletes=1)
    assert host.stats.deletes == 1


def test_tenant_methods() -> None:
    host = HostTier(100)
    now = time.monotonic()
    host.put(key(1), entry(1, "a", now - 100), 10)
    host.put(key(2), entry(2, "b", now - 100), 10)
    host.put(key(3), entry(3, "a", now), 10)
    host.put(key(4), entry(4, None, now - 100), 10)
    assert host.owner_keys("a") == [key(1), key(3)]  # least recent first
    assert host.owner_keys(None) == [key(4)]
    assert host.expire_owner("a", 50.0) == 1
    assert host.owner_keys("a") == [key(3)]
    assert host.purge_owner("b") == 1 and host.purge_owner("b") == 0
    assert list(host.keys()) == [key(3), key(4)] and host.usage_bytes == 20
    assert host.stats.deletes == 2


def test_delete_only_if_the_entry_is_still_stored() -> None:
    host = HostTier(100)
    first, second = entry(1), entry(2)
    host.put(key(1), first, 10)
    host.put(key(1), second, 10)
    assert not host.delete(key(1), only_if=first)
    assert host.delete(key(1), only_if=second) and key(1) not in host


def test_watch_sees_every_key_enter_and_leave() -> None:
    host = HostTier(20)
    seen: list[tuple[bytes, bool]] = []
    host.watch = lambda k, present: seen.append((k, present))
    host.put(key(1), entry(1), 10)
    host.put(key(2), entry(2), 10)
    host.put(key(3), entry(3), 10)  # evicts 1
    host.delete(key(2))
    assert host.clear() == 1
    assert seen == [
        (key(1), True),
        (key(2), True),
        (key(1), False),
        (key(3), True),
        (key(2), False),
        (key(3), False),
    ]


def test_injected_faults_are_a_counted_miss() -> None:
    host = HostTier(100, faults=FaultConfig(error_rate=1.0))
    assert not host.put(key(1), entry(1), 10)
    assert host.get(key(1)) is None
    assert host.stats.errors == {"injected": 2}
    assert len(host) == 0


class BrokenInjector(FaultInjector):
    """A fault injector with a bug: its failure is no injected fault."""

    def before_op(self) -> None:
        raise RuntimeError("bug in the injector")


def test_a_bug_in_the_fault_machinery_propagates() -> None:
    host = HostTier(100, faults=FaultConfig(latency_s=0.001))
    host.faults = BrokenInjector(FaultConfig(latency_s=0.001))
    with pytest.raises(RuntimeError, match="bug"):
        host.get(key(1))
    with pytest.raises(RuntimeError, match="bug"):
        host.put(key(1), entry(1), 10)
    assert host.stats.errors == {}


def test_injected_error_is_a_tier_error_of_kind_injected() -> None:
    err = InjectedError()
    assert isinstance(err, TierError) and err.kind == "injected"
