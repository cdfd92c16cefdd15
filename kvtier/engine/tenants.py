"""Tenant administration of one engine: purges, per-tenant TTLs, quotas and usage.

The device part (the prefix index's unreferenced blocks) runs here, on the engine thread; the
tier part runs on the tiers' admin worker, through the hierarchy's TenantAdmin
(`TierHierarchy.tenants`, kvtier.tiers.tenants)::

    EngineCore.purge_tenant(t)
        abort_tenant(t)                        requests (EngineCore: they are its state)
        EngineTenants.begin_purge(t)           queued write-backs down, device blocks out,
            TenantAdmin.begin_purge(t)         tier I/O fenced, host entries out -> future of
                                               the tier part
        future.result()                        host, disk, remote (admin worker)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvtier.identity import owner_id, tenant_of
from kvtier.kvcache.manager import KVCacheManager
from kvtier.kvcache.prefix_index import CachedBlock

if TYPE_CHECKING:
    from kvtier.tiers.hierarchy import TierHierarchy
    from kvtier.tiers.tenants import TenantAdmin


class EngineTenants:
    """The tenant administration of one EngineCore (its purge, TTL, quota and usage methods
    delegate here).

    Owns the per-tenant TTL table (`ttl_s`, mirrored into TenantAdmin.owner_ttl_s). Acts on
    the core's KVCacheManager (device blocks, through its pool and prefix index) and on its
    TierHierarchy, if any, through the hierarchy's TenantAdmin (`tiers.tenants`) only. It aborts no
    requests: the core aborts a tenant's requests before `begin_purge`, so that their blocks
    are unreferenced and can go.

    Threads: every method runs on the engine thread, between steps (the thread that steps the
    core, or the only thread when nothing steps it). `begin_*` return at once with a future
    (None without tiers) that runs the tier part on the tiers' admin worker; `purge`,
    `purge_all` and `sweep_expired` block on it.

    Invariants: after `begin_purge(t)` no unreferenced device block of `t` is in the prefix
    index (blocks still referenced are counted as "device_in_use"); eviction goes leaves first,
    so the index stays a tree (KVCacheManager.check_integrity holds after every method)."""

    def __init__(
        self,
        kv: KVCacheManager,
        tiers: TierHierarchy | None,
        block_bytes: int,
        store_blocks: Callable[[], None],
    ) -> None:
        self.kv = kv
        self.tiers = tiers
        self.admin: TenantAdmin | None = tiers.tenants if tiers is not None else None
        """The hierarchy's tenant administration (None without tiers): the tier part of each method."""
        self.block_bytes = block_bytes
        """Bytes of one device block's KV (usage reports)."""
        self._store_blocks = store_blocks
        """Writes the blocks the cache manager queued for the tiers down (EngineCore._store_blocks)."""
        self.events: Any = None
        """The engine's KV event recorder (kvtier.kv_events), told of purges; None: events off."""
        self.ttl_s: dict[str | None, float] = {}
        """Per-tenant time to live of cached KV, in every tier."""
        self.clock: Callable[[], float] = time.monotonic
        """What the device TTL sweep reads as now, against the prefix index's `created`
        (time.monotonic stamps); injectable: tests run it ahead of the real clock."""

    # ------------------------------------------------------------------ purges
    def begin_purge(self, tenant: str | None, everywhere: bool = True) -> tuple[dict[str, int], Future | None]:
        """The engine-thread part of a purge, after the tenant's requests were aborted: queued
        write-backs go down (fenced with the old stamp, so the purge deletes them), the tenant's
        device blocks leave the prefix index, and its tier I/O is fenced off. The future runs
        the tier part on the admin worker; see TenantAdmin.begin_purge."""
        if self.tiers is not None:
            self._store_blocks()
        removed = self._evict_cached(lambda n: tenant_of(n.owner) == tenant)
        counts = {
            "device": removed,
            "device_in_use": sum(1 for n in self.kv.index.nodes() if tenant_of(n.owner) == tenant),
        }
        future = self.admin.begin_purge(tenant, everywhere) if self.admin is not None else None
        if self.events is not None:  # routers stop seeing the tenant's blocks on any medium
            self.events.purge_owner(owner_id(tenant))
            self.events.flush()
        return counts, future

    def begin_purge_all(self) -> tuple[dict[str, int], Future | None]:
        """`begin_purge` for every tenant (after every request was aborted)."""
        counts = {"device": self.kv.pool.evict_all()}
        self.kv.take_blocks_to_store()  # a purge writes nothing down (write-back eviction log)
        future = self.admin.begin_purge_all() if self.admin is not None else None
        if self.events is not None:
            self.events.purge_all()
            self.events.flush()
        return counts, future

    def purge(self, tenant: str | None) -> dict[str, Any]:
        """`begin_purge`, then wait for the tier part (blocking)."""
        return _settled(*self.begin_purge(tenant))

    def purge_all(self) -> dict[str, Any]:
        """`begin_purge_all`, then wait for the tier part (blocking)."""
        return _settled(*self.begin_purge_all())

    def _evict_cached(self, select: Callable[[CachedBlock], bool]) -> int:
        """Evict the unreferenced device blocks whose prefix-index node `select` picks; a parent
        can go only after its children, so repeat until a round evicts nothing. Returns how many."""
        pool, index = self.kv.pool, self.kv.index
        removed = 0
        while True:
            n = sum(pool.evict_cached(key) for key in [node.key for node in index.nodes() if select(node)])
            removed += n
            if n == 0:
                return removed

    # ------------------------------------------------------------------ TTLs and quotas
    def set_ttl(self, tenant: str | None, ttl_s: float | None) -> None:
        """KV of `tenant` lives at most `ttl_s` in any tier (None: no limit), enforced by
        `begin_sweep_expired`."""
        if ttl_s is None:
            self.ttl_s.pop(tenant, None)
        else:
            self.ttl_s[tenant] = float(ttl_s)
        if self.admin is not None:
            self.admin.owner_ttl_s = dict(self.ttl_s)

    def set_quota(self, tenant: str | None, host_bytes: int | None = None, disk_bytes: int | None = None) -> None:
        """Cap `tenant`'s bytes in the host and disk tiers (its own oldest blocks go first);
        both None: no cap. No effect without tiers."""
        if self.admin is not None:
            if host_bytes is None and disk_bytes is None:
                self.admin.owner_quota.pop(tenant, None)
            else:
                self.admin.owner_quota[tenant] = (host_bytes, disk_bytes)

    def begin_sweep_expired(self) -> tuple[dict[str, dict[str, int]], Future | None]:
        """Drop each TTL'd tenant's device blocks older than its TTL (unreferenced ones, leaves
        first) now; the future expires host and disk on the admin worker (Redis expires
        entries itself). Counts per tenant, by str(tenant)."""
        out: dict[str, dict[str, int]] = {}
        now = self.clock()
        for tenant, ttl in self.ttl_s.items():
            removed = self._evict_cached(_cached_before(tenant, now - ttl))
            out[str(tenant)] = {"device": removed}
        if self.admin is None or not self.ttl_s:
            return out, None
        ttls, admin = dict(self.ttl_s), self.admin
        return out, admin.submit_admin(lambda: {str(t): admin.expire_owner(t, ttl) for t, ttl in ttls.items()})

    def sweep_expired(self) -> dict[str, dict[str, int]]:
        """`begin_sweep_expired`, then wait for the tier part (blocking)."""
        out, future = self.begin_sweep_expired()
        if future is not None:
            for tenant, counts in future.result().items():
                out[tenant].update(counts)
        return out

    # ------------------------------------------------------------------ usage
    def device_usage(self, tenant: str | None) -> dict[str, int]:
        """The tenant's cached device blocks (referenced or not) and their bytes."""
        n = sum(1 for node in self.kv.index.nodes() if tenant_of(node.owner) == tenant)
        return {"blocks": n, "bytes": n * self.block_bytes}

    def usage(self, tenant: str | None) -> dict[str, dict[str, int]]:
        """`device_usage`, plus the tiers' usage (TenantAdmin.owner_usage; blocking)."""
        out = {"device": self.device_usage(tenant)}
        if self.admin is not None:
            out.update(self.admin.owner_usage(tenant))
        return out


def _cached_before(tenant: str | None, cut: float) -> Callable[[CachedBlock], bool]:
    """Selects `tenant`'s blocks cached before time.monotonic() `cut`."""
    return lambda node: tenant_of(node.owner) == tenant and node.created < cut


def _settled(counts: dict[str, Any], future: Future | None) -> dict[str, Any]:
    """`counts` updated with the tier part's counts once `future` is done."""
    if future is not None:
        counts.update(future.result())
    return counts
