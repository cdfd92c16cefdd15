"""EngineTenants (kvtier.engine.tenants) over a real KVCacheManager, with no model: purges,
TTL sweeps, quotas and usage, device part exact, tier part through a recording fake."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from kvtier.engine.tenants import EngineTenants
from kvtier.identity import Tenancy, tenant_of
from kvtier.kvcache import KVCacheManager, root_key

BS = 4
ROOT = root_key(b"test-model")
BLOCK_BYTES = 100


def computed(m: KVCacheManager, req_id: str, tokens: list[int], owner: str | None) -> None:
    """Admit a request and compute all its tokens (its full blocks are cached, owned by `owner`)."""
    match = m.match(tokens, ROOT)
    assert m.allocate_new(req_id, tokens, ROOT, match, len(tokens) - match.num_cached_tokens(BS), Tenancy.of(owner))
    m.take_copies()
    m.end_step()
    m.cache_blocks(req_id, tokens, len(tokens))


def owned(m: KVCacheManager, owner: str | None) -> list[int]:
    return sorted(n.block_id for n in m.index.nodes() if tenant_of(n.owner) == owner)


def no_store() -> None:
    raise AssertionError("nothing is stored without tiers")


def test_purge_evicts_the_tenants_unreferenced_blocks_only() -> None:
    m = KVCacheManager(16, BS)
    computed(m, "a1", list(range(1, 10)), "a")  # blocks 0, 1 cached (a chain), 2 partial
    m.free("a1")
    computed(m, "b1", list(range(20, 29)), "b")  # blocks 2, 3 cached (2 was a1's partial); b1 keeps them
    computed(m, "a2", list(range(40, 49)), "a")  # blocks 5, 6 cached; a2 keeps them
    tenants = EngineTenants(m, None, BLOCK_BYTES, no_store)
    assert tenants.device_usage("a") == {"blocks": 4, "bytes": 4 * BLOCK_BYTES}
    assert owned(m, "a") == [0, 1, 5, 6] and owned(m, "b") == [2, 3]

    counts, future = tenants.begin_purge("a")
    assert future is None
    assert counts == {"device": 2, "device_in_use": 2}  # the chain 0 <- 1 went, leaf first
    assert owned(m, "a") == [5, 6] and owned(m, "b") == [2, 3]
    assert tenants.usage("a") == {"device": {"blocks": 2, "bytes": 2 * BLOCK_BYTES}}
    m.check_integrity()

    m.free("a2")
    assert tenants.purge("a") == {"device": 2, "device_in_use": 0}
    assert owned(m, "a") == [] and owned(m, "b") == [2, 3]
    m.check_integrity()

    m.free("b1")
    counts, future = tenants.begin_purge_all()
    assert counts == {"device": 2} and future is None and len(m.index) == 0
    m.check_integrity()


def test_ttl_sweep_drops_only_blocks_older_than_the_tenants_ttl() -> None:
    m = KVCacheManager(16, BS)
    computed(m, "old", list(range(1, 10)), "a")
    computed(m, "new", list(range(20, 29)), "a")
    computed(m, "other", list(range(40, 49)), "b")
    for req_id in ("old", "new", "other"):
        m.free(req_id)
    now = time.monotonic()
    for node in m.index.nodes():
        node.created = now - 100.0 if node.block_id in (0, 1) or tenant_of(node.owner) == "b" else now + 100.0
    tenants = EngineTenants(m, None, BLOCK_BYTES, no_store)
    assert tenants.sweep_expired() == {}  # no TTL set: nothing expires

    tenants.set_ttl("a", 10.0)
    assert tenants.ttl_s == {"a": 10.0}
    assert tenants.sweep_expired() == {"a": {"device": 2}}
    assert owned(m, "a") == [3, 4] and owned(m, "b") == [6, 7]  # b has no TTL
    m.check_integrity()

    tenants.set_ttl("a", None)
    assert tenants.ttl_s == {} and tenants.sweep_expired() == {}
    assert owned(m, "a") == [3, 4]
    m.check_integrity()


class FakeTiers:
    """A TierHierarchy as EngineTenants sees it: its tenant administration (`tenants`)."""

    def __init__(self) -> None:
        self.tenants = FakeTenantAdmin()


class FakeTenantAdmin:
    """TenantAdmin's methods, recording their calls; futures done at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.owner_ttl_s: dict[str | None, float] = {}
        self.owner_quota: dict[str | None, tuple[int | None, int | None]] = {}

    def _done(self, value: Any) -> Future:
        f: Future = Future()
        f.set_result(value)
        return f

    def begin_purge(self, owner: str | None, everywhere: bool = True) -> Future:
        self.calls.append(("begin_purge", owner, everywhere))
        return self._done({"host": 3, "disk": 1})

    def begin_purge_all(self) -> Future:
        self.calls.append(("begin_purge_all",))
        return self._done({"host": 5})

    def submit_admin(self, fn: Any, *args: Any) -> Future:
        self.calls.append(("submit_admin",))
        return self._done(fn(*args))

    def expire_owner(self, owner: str | None, ttl_s: float) -> dict[str, int]:
        self.calls.append(("expire_owner", owner, ttl_s))
        return {"host": 1}

    def owner_usage(self, owner: str | None) -> dict[str, dict[str, int]]:
        return {"host": {"blocks": 7, "bytes": 700}}


def test_tier_part_goes_through_the_hierarchys_tenant_methods() -> None:
    m = KVCacheManager(16, BS)
    computed(m, "a1", list(range(1, 10)), "a")
    m.free("a1")
    tiers = FakeTiers()
    admin = tiers.tenants
    stored: list[int] = []

    def store() -> None:  # the write-down runs before the device blocks go
        stored.append(len(m.index))
        admin.calls.append(("store",))

    tenants = EngineTenants(m, tiers, BLOCK_BYTES, store)  # type: ignore[arg-type]  # a duck-typed fake
    assert tenants.purge("a") == {"device": 2, "device_in_use": 0, "host": 3, "disk": 1}
    assert stored == [2] and admin.calls == [("store",), ("begin_purge", "a", True)]

    admin.calls.clear()
    counts, future = tenants.begin_purge("a", everywhere=False)
    assert counts == {"device": 0, "device_in_use": 0} and future is not None
    assert admin.calls == [("store",), ("begin_purge", "a", False)]

    tenants.set_ttl("a", 5)
    tenants.set_ttl(None, 7.5)
    assert admin.owner_ttl_s == {"a": 5.0, None: 7.5}
    admin.calls.clear()
    assert tenants.sweep_expired() == {"a": {"device": 0, "host": 1}, "None": {"device": 0, "host": 1}}
    assert admin.calls == [("submit_admin",), ("expire_owner", "a", 5.0), ("expire_owner", None, 7.5)]

    tenants.set_quota("a", host_bytes=1000)
    assert admin.owner_quota == {"a": (1000, None)}
    tenants.set_quota("a")
    assert admin.owner_quota == {}

    assert tenants.usage("a") == {"device": {"blocks": 0, "bytes": 0}, "host": {"blocks": 7, "bytes": 700}}
    assert tenants.purge_all() == {"device": 0, "host": 5}
    m.check_integrity()
