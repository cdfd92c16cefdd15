"""TenantAdmin: what a TierHierarchy does per tenant beside its I/O: purges, TTL expiry, quotas,
usage.

    engine / server ──> hierarchy.tenants.begin_purge, expire_owner, owner_usage, ...
                              │
                              v
                        TenantAdmin ──> host:   owner_keys / purge_owner / expire_owner
                         │  admin worker  disk:   owner_keys / entry_sizes / purge / expire_owner
                         │  ledger        remote: owner_keys / drain_owner / clear
                         v
                        fence (fence.OwnerFence), sealing.keys (sealing.Sealing: the data keys),
                        stats.quota_evictions: what the hierarchy hands it, nothing more

The dependency goes one way: the hierarchy builds its TenantAdmin with the pieces it needs (the
tiers mapping, the fence, the sealing, the counters, the block size, the tier TTL) and calls
its quota and TTL checks; TenantAdmin knows nothing of the hierarchy.

Tenants are named by the caller (`owner`: str, None for no named tenant); the disk and remote
tiers know them by their owner id (owners.owner_id: a hash, so names never reach storage).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvtier import threads
from kvtier.identity import Owner, as_tenancy
from kvtier.tiers.errors import TierError
from kvtier.tiers.fence import ALL, OwnerFence, PurgeLedger
from kvtier.tiers.keyring import KeyringError
from kvtier.tiers.owners import DEFAULT_OWNER, owner_id

if TYPE_CHECKING:
    from kvtier.tiers.sealing import Sealing

logger = logging.getLogger(__name__)


class QuotaCounter(Protocol):
    """Where quota evictions are counted (the hierarchy's HierarchyStats)."""

    quota_evictions: int


class TenantAdmin:
    """Per-tenant administration of one TierHierarchy's stored KV.

    Holds: the per-tenant quotas and TTLs (set by the engine from its tenant config), the
    ledger of purges whose remote part is pending, and the admin worker (one thread) that runs
    purges, expiry sweeps and usage queries off the engine thread.

    Thread-safety: `begin_purge` / `begin_purge_all` run on the caller's thread (fence, host
    drop: in memory) and hand the rest to the admin worker; the `_finish_*` parts, `expire_owner`,
    `owner_usage` and `retry_pending_purges` block on tier I/O and belong on the admin worker
    (`submit_admin`). The quota checks run on whichever thread stored the blocks (the engine
    for host, an I/O worker for disk). The ledger locks itself; the fence is the hierarchy's.

    Failures: tiers degrade as always (a failed delete is a block not deleted, counted by the
    tier). A remote purge that cannot reach Redis does not fail the purge: it is recorded in
    the ledger as pending, the tenant stays fenced off, and `retry_pending_purges` finishes it."""

    def __init__(
        self,
        tiers: Mapping[str, Any],
        *,
        fence: OwnerFence,
        sealing: Sealing,
        stats: QuotaCounter,
        block_bytes: int,
        remote_ttl_s: float | None = None,
        ledger_path: Path | None = None,
    ) -> None:
        """`tiers`: the hierarchy's tiers by name (read live: the same mapping); `fence`: its
        purge fence; `sealing`: its data keys (forgotten and destroyed by purges); `stats`:
        where quota evictions are counted; `block_bytes`: one block's KV (host quota and usage);
        `remote_ttl_s`: the remote tier's own TTL; `ledger_path`: where pending purges are kept
        (None: in memory)."""
        self._tiers = tiers
        self._fence = fence
        self._sealing = sealing
        self._stats = stats
        self._block_bytes = block_bytes
        self._remote_ttl_s = remote_ttl_s
        self.owner_quota: dict[str | None, tuple[int | None, int | None]] = {}
        """Per-tenant (host_bytes, disk_bytes) caps; a tenant over its cap loses its own oldest
        blocks first, never another tenant's."""
        self.owner_ttl_s: dict[str | None, float] = {}
        """Per-tenant time to live of stored KV (set by the server from its tenant config)."""
        self.clock: Callable[[], float] = time.monotonic
        """Now for the host tier's TTL (its entries are stamped with time.monotonic)."""
        self.wall_clock: Callable[[], float] = time.time
        """Now for the disk tier's TTL (its owner manifests hold time.time stamps). Both are
        injectable: tests run them ahead of the real clocks."""
        self.ledger = PurgeLedger(ledger_path)
        self._held: set[str] = set()  # owner ids fenced until their pending remote purge is done
        for oid in self.ledger.pending():
            fence.begin(oid)
            self._held.add(oid)
        self._admin: ThreadPoolExecutor | None = None  # purges, sweeps: off the engine thread

    # ------------------------------------------------------------------ quotas and TTLs
    def enforce_host_quota(self, owner: str | None) -> None:
        """Drop `owner`'s least recent host entries until it is within its host cap (if any)."""
        cap_bytes = self.owner_quota.get(owner, (None, None))[0]
        host = self._tiers.get("host")
        if cap_bytes is None or host is None:
            return
        block_bytes = self._block_bytes
        mine = host.owner_keys(owner)  # least recent first
        excess = len(mine) * block_bytes - cap_bytes
        for key in mine:
            if excess <= 0:
                break
            if host.delete(key):
                excess -= block_bytes
                self._stats.quota_evictions += 1

    def enforce_disk_quota(self, owner: Owner) -> None:
        """Delete `owner`'s oldest-written disk entries until it is within its disk cap (if any).
        `owner`: a Tenancy (a store's: its owner id precomputed) or a tenant's name."""
        tenancy = as_tenancy(owner)
        cap_bytes = self.owner_quota.get(tenancy.tenant, (None, None))[1]
        disk = self._tiers.get("disk")
        if cap_bytes is None or disk is None:
            return
        sizes = disk.entry_sizes(disk.owner_keys(tenancy.owner_id))  # oldest write first
        excess = sum(sizes.values()) - cap_bytes
        for key, size in sizes.items():
            if excess <= 0:
                break
            if disk.delete(key):
                excess -= size
                self._stats.quota_evictions += 1

    def remote_ttl(self, owner: str | None) -> float | None:
        """The TTL of `owner`'s remote entries: the shorter of the tier's and the tenant's."""
        ttls = [t for t in (self._remote_ttl_s, self.owner_ttl_s.get(owner)) if t is not None]
        return min(ttls) if ttls else None

    def expire_owner(self, owner: str | None, ttl_s: float) -> dict[str, int]:
        """Delete `owner`'s blocks stored more than `ttl_s` ago from host and disk (Redis
        entries carry the TTL themselves)."""
        counts: dict[str, int] = {}
        host = self._tiers.get("host")
        if host is not None:
            counts["host"] = host.expire_owner(owner, ttl_s, now=self.clock())
        disk = self._tiers.get("disk")
        if disk is not None:
            counts["disk"] = disk.expire_owner(owner_id(owner), ttl_s, now=self.wall_clock())
        return counts

    def owner_usage(self, owner: str | None) -> dict[str, dict[str, int]]:
        """{tier: {"blocks": n (, "bytes": host only)}} of what `owner` has stored."""
        out: dict[str, dict[str, int]] = {}
        host = self._tiers.get("host")
        if host is not None:
            n = len(host.owner_keys(owner))
            out["host"] = {"blocks": n, "bytes": n * self._block_bytes}
        for name in ("disk", "remote"):
            tier = self._tiers.get(name)
            if tier is not None:
                keys = tier.owner_keys(owner_id(owner))
                if name == "remote":  # entries the server's TTL removed are not counted
                    n = tier.contains_count(keys, owner_id(owner))
                else:
                    n = tier.contains_count(keys) if hasattr(tier, "contains_count") else len(keys)
                out[name] = {"blocks": n}
        return out

    # ------------------------------------------------------------------ the admin worker
    def submit_admin(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on the admin worker (one thread: purges, sweeps, usage), never on
        the engine thread and never behind the loads and stores of the I/O pool."""
        if self._admin is None:
            self._admin = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvtier-admin", initializer=threads.on_helper_thread
            )
        return self._admin.submit(fn, *args)

    def close(self) -> None:
        """Wait for the admin worker's jobs and stop it."""
        if self._admin is not None:
            self._admin.shutdown(wait=True)

    # ------------------------------------------------------------------ purges
    def purge_owner(self, owner: str | None) -> dict[str, Any]:
        """Delete every stored block of `owner` from every tier and destroy its data key
        (blocking; the server uses begin_purge)."""
        return self.begin_purge(owner).result()

    def begin_purge(self, owner: str | None, everywhere: bool = True) -> Future:
        """Fence off `owner`'s tier I/O and drop its host entries now (cheap, in memory); the
        rest runs on the admin worker. The future's result: blocks deleted per tier,
        `key_destroyed`, and `pending`: the tiers whose part could not be done (kept in the
        ledger and retried by retry_pending_purges; the owner stays fenced off meanwhile).
        `everywhere` False: only this instance's copies (host, disk), for a fleet key that
        another instance destroyed."""
        oid = owner_id(owner)
        self._fence.begin(oid)
        host = self._tiers.get("host")
        num_host = host.purge_owner(owner) if host is not None else 0
        if self._sealing.keys is not None:
            self._sealing.keys.forget(owner or DEFAULT_OWNER)  # this process stops using the key at once
        return self.submit_admin(self._finish_purge, owner, oid, num_host, everywhere)

    def _finish_purge(self, owner: str | None, oid: str, num_host: int, everywhere: bool) -> dict[str, Any]:
        settled = False
        try:
            self._fence.wait_quiet(oid)  # stores and loads that began before the fence
            counts: dict[str, Any] = {}
            host = self._tiers.get("host")
            if host is not None:  # again: promotions of loads that were in flight
                counts["host"] = num_host + host.purge_owner(owner)
            disk = self._tiers.get("disk")
            if disk is not None:
                counts["disk"] = disk.purge(disk.owner_keys(oid))
                disk.forget_owner(oid)
            pending: list[str] = []
            if everywhere:
                if "remote" in self._tiers:
                    try:
                        counts["remote"] = self._purge_remote(oid)
                    except (TierError, KeyringError) as e:
                        logger.warning("purge of tenant %s: remote tier not purged (%s); pending", oid, e)
                        counts["remote"] = None
                        pending.append("remote")
                if self._sealing.keys is not None and self._sealing.fleet_keys is None:
                    counts["key_destroyed"] = int(self._sealing.keys.destroy(owner or DEFAULT_OWNER))
                elif self._sealing.keys is not None:
                    counts["key_destroyed"] = 0 if pending else 1
            counts["pending"] = pending
            self._settle(oid, pending)
            settled = True
            return counts
        finally:
            if not settled:
                self._fence.end(oid)

    def _settle(self, oid: str, pending: list[str]) -> None:
        """After a purge attempt: record or clear `oid`'s pending part, and lift the fence
        once nothing is pending (the ledger's hold keeps it up until then)."""
        fence = self._fence
        if pending:
            self.ledger.add(oid, pending)
            if oid in self._held:
                fence.end(oid)
            else:
                self._held.add(oid)
            return
        self.ledger.done(oid)
        fence.end(oid)
        if oid in self._held:
            self._held.discard(oid)
            fence.end(oid)

    def _purge_remote(self, oid: str) -> int:
        """Delete `oid`'s Redis entries (ALL: every entry of this model configuration), its
        owner set and, with fleet keys, its wrapped data key. Raises TierError."""
        remote = self._tiers["remote"]
        fleet = self._sealing.fleet_keys
        if fleet is not None:
            fleet.verify_domain()  # KeyringError: these entries belong to another master key
        if oid == ALL:
            n = remote.clear(strict=True)
            if fleet is not None:
                fleet.destroy_all()
                fleet.verify_domain(again=True)  # clear() took the key-check record too
            return n
        n = remote.drain_owner(oid)
        if fleet is not None:
            fleet.destroy_oid(oid)
            n += remote.drain_owner(oid)  # blocks another instance stored under the old key meanwhile
        return n

    def retry_pending_purges(self, wait_gate_s: float = 5.0) -> dict[str, list[str]]:
        """Finish the pending purges whose tiers answer now (admin worker). A tier in back-off
        is waited for (at most `wait_gate_s`) so that a caller retrying right after the
        backend returned gets its answer. Returns what is still pending per owner id."""
        remote = self._tiers.get("remote")
        for oid in self.ledger.pending():
            if remote is not None and not remote.healthy:
                time.sleep(min(remote.health.retry_in_s, wait_gate_s))
            try:
                if remote is not None:
                    self._purge_remote(oid)
            except (TierError, KeyringError) as e:
                logger.info("pending purge of %s still pending: %s", oid, e)
                continue
            self._fence.begin(oid)
            self._settle(oid, [])
        return self.pending_purges()

    def pending_purges(self) -> dict[str, list[str]]:
        """{owner id: tiers} of purges not finished yet."""
        return {oid: rec["tiers"] for oid, rec in self.ledger.pending().items()}

    def purge_all(self) -> dict[str, Any]:
        """Delete every stored block of this model configuration from every tier and destroy
        every data key (blocking; the server uses begin_purge_all)."""
        return self.begin_purge_all().result()

    def begin_purge_all(self) -> Future:
        """`begin_purge` for every tenant: fence everyone, clear the host tier now, the rest
        on the admin worker."""
        self._fence.begin(ALL)
        host = self._tiers.get("host")
        num_host = host.clear() if host is not None else 0
        return self.submit_admin(self._finish_purge_all, num_host)

    def _finish_purge_all(self, num_host: int) -> dict[str, Any]:
        settled = False
        try:
            self._fence.wait_quiet(ALL)
            counts: dict[str, Any] = {}
            for name, tier in self._tiers.items():
                if name == "host":
                    counts[name] = num_host + tier.clear()
                elif name == "disk":
                    counts[name] = tier.clear()
            pending: list[str] = []
            if "remote" in self._tiers:
                try:
                    counts["remote"] = self._purge_remote(ALL)
                except (TierError, KeyringError) as e:
                    logger.warning("purge of every tenant: remote tier not purged (%s); pending", e)
                    counts["remote"] = None
                    pending.append("remote")
            if self._sealing.keys is not None and self._sealing.fleet_keys is None:
                counts["keys_destroyed"] = self._sealing.keys.destroy_all()
            counts["pending"] = pending
            self._settle(ALL, pending)
            settled = True
            return counts
        finally:
            if not settled:
                self._fence.end(ALL)
