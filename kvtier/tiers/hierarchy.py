"""TierHierarchy: host -> disk -> remote below the device pool, with background I/O.

The scheduler never waits on it: lookups of the remote tier, loads and stores run on worker
threads and hand back futures. Local lookups (host, disk: in-memory indexes) are synchronous.

Write policies (when a computed block goes down):
    write_through   as soon as it is full and computed (every configured tier)
    write_back      when the device evicts it (into the first tier; host evictions demote on)
    selective       once it has been hit `selective_min_hits` times on device

Loads copy below-device hits into device blocks; disk and remote hits are promoted into host.

The hierarchy is the policy *and* the I/O: the simulator (kvtier/sim) runs this same class with
payload-free tiers and a serial executor (`tiers=`, `executor=`, and `_encode`/`_decode`
overridden), so every placement decision it reports is this code's.

Beside the I/O, in their own modules (the dependency goes one way, from here to them):

    TierHierarchy ──> tenants   (tenants.TenantAdmin, `tenants`): purges, TTL expiry, quotas, usage;
       │                        callers use `hierarchy.tenants.<method>` directly
       ├────────────> sealing   (sealing.Sealing, `sealing`): frames encrypted with per-tenant
       │                        data keys (`_encode` / `_decode` call it)
       └────────────> fence     (fence.OwnerFence, `fence`): purges fence off queued tier I/O
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier import threads
from kvtier.cost.model import CostModel, TierRun
from kvtier.identity import ANONYMOUS, Owner, Tenancy, as_tenancy
from kvtier.tiers.base import TierStats
from kvtier.tiers.crypto import KeyDestroyedError
from kvtier.tiers.faults import FaultConfig
from kvtier.tiers.fence import OwnerFence, Stamp
from kvtier.tiers.host import HostEntry, HostTier
from kvtier.tiers.keyring import KeyringError
from kvtier.tiers.owners import (
    DEFAULT_OWNER,  # noqa: F401 - re-exported from here, its former home
    owner_id,  # noqa: F401 - also re-exported from here, its former home
)
from kvtier.tiers.runs import stored_runs
from kvtier.tiers.sealing import Sealing
from kvtier.tiers.tenants import TenantAdmin

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back", "selective")

TIER_ORDER = ("host", "disk", "remote")


def _ledger_path(config: TierConfig, fingerprint: bytes) -> Path | None:
    """Where pending purges are kept: beside the keys, else beside the disk tier, else nowhere
    (memory only: a pending remote purge is then forgotten when the process exits)."""
    directory = config.key_dir or config.disk_cache_dir
    if directory is None:
        return None
    Path(directory).mkdir(parents=True, exist_ok=True)
    return Path(directory) / f"pending-purges-{fingerprint.hex()}.json"


@dataclass(frozen=True)
class TierConfig:
    """Tiers below the device pool. Each is optional; none configured means device only."""

    host_cache_bytes: int | None = None
    """Bytes of host memory for KV blocks."""
    disk_cache_dir: str | None = None
    """Directory for the disk tier (a new process finds what an earlier one stored)."""
    disk_cache_bytes: int | None = None
    """Capacity of the disk tier (default 16 GiB when a directory is given)."""
    remote_cache_url: str | None = None
    """redis://, rediss://, valkey://, or redis+cluster://host:port,host:port."""
    remote_ttl_s: float | None = None
    """Time to live of remote entries (None: no expiry)."""
    remote_timeout_s: float = 1.0
    """Socket timeout of remote operations."""
    cache_write_policy: str = "write_through"
    """'write_through', 'write_back' or 'selective' (see docs/benchmarks.md for the choice)."""
    selective_min_hits: int = 2
    """With 'selective': device hits before a block is written down."""
    compression: str | None = None
    """None, 'lz4' or 'zstd' for disk and remote payloads."""
    key_dir: str | None = None
    """Encrypt disk and remote payloads at rest with per-tenant AES-256-GCM data keys kept in
    this directory (owner-only); destroying a tenant's key makes every copy unreadable."""
    master_key_file: str | None = None
    """Fleet encryption (kvtier.tiers.keyring): data keys wrapped by this master key and kept
    in the remote tier, so every instance given the same file reads every other's entries and
    a purge anywhere destroys the tenant's one key. Needs remote_cache_url."""
    key_check_interval_s: float = 1.0
    """With master_key_file: how long an instance may use a cached data key before it re-reads
    the wrapped one (the bound on noticing a purge made by another instance)."""
    restore_policy: str = "cost"
    """'cost': restore a stored prefix only when the cost model says it beats recomputing it;
    'always': restore whatever is stored (what engines without a cost model do)."""
    faults: tuple[tuple[str, str], ...] = ()
    """Fault injection per tier: (("disk", "latency_ms=5,bandwidth_mbps=200"), ...)."""
    io_threads: int = 2
    """Background I/O workers."""
    max_pending_stores: int = 4096
    """Blocks queued for disk/remote beyond this are dropped (counted), never block the engine."""

    def __post_init__(self) -> None:
        if self.cache_write_policy not in WRITE_POLICIES:
            raise ValueError(f"cache_write_policy must be one of {WRITE_POLICIES}, got {self.cache_write_policy!r}")
        if self.host_cache_bytes is not None and self.host_cache_bytes <= 0:
            raise ValueError("host_cache_bytes must be positive")
        if self.disk_cache_bytes is not None and self.disk_cache_dir is None:
            raise ValueError("disk_cache_bytes needs disk_cache_dir")
        if self.restore_policy not in ("cost", "always"):
            raise ValueError("restore_policy must be 'cost' or 'always'")
        if self.master_key_file is not None and not self.remote_cache_url:
            raise ValueError(
                "master_key_file (--kv-master-key-file) needs a remote tier "
                "(--remote-cache-url): the wrapped data keys live there"
            )
        if self.key_check_interval_s < 0:
            raise ValueError("key_check_interval_s must be >= 0")
        if self.compression not in (None, "lz4", "zstd"):
            raise ValueError("compression must be None, 'lz4' or 'zstd'")
        for tier, spec in self.faults:
            if tier not in TIER_ORDER:
                raise ValueError(f"fault injection for unknown tier {tier!r}; tiers: {TIER_ORDER}")
            FaultConfig.parse(spec)

    @property
    def enabled(self) -> bool:
        return bool(self.host_cache_bytes or self.disk_cache_dir or self.remote_cache_url)

    def fault_for(self, tier: str) -> FaultConfig | None:
        for name, spec in self.faults:
            if name == tier:
                return FaultConfig.parse(spec)
        return None


@dataclass(slots=True)
class LoadResult:
    tensors: list[Any]
    """KV of the leading blocks that loaded (stops at the first failure)."""
    per_tier: dict[str, int]
    seconds: float
    queue_s: float


@dataclass
class HierarchyStats:
    stores_dropped: int = 0
    loads: int = 0
    load_failures: int = 0
    demotions: int = 0
    promotions: int = 0
    quota_evictions: int = 0
    stores_fenced: int = 0
    """Blocks not stored because their tenant was purged after they were queued."""


class TierHierarchy:
    """The tiers below the device pool (host -> disk -> remote) as one store, with the write
    policy, promotion and demotion, per-tenant encryption, and background I/O.

    Stores: nothing itself; it owns the tiers (`tiers`, fastest first), the data keys and
    what seals frames with them (`sealing`), the purge fence (`fence`) and the tenant
    administration (`tenants`: call its methods directly).

    Thread-safety: the lookup methods (`runs`, `touch`, `contains_prefix` of host and disk)
    and `store`'s host part run synchronously on the caller's (engine) thread and never wait
    on disk or network; loads, disk/remote stores and remote lookups run on the I/O pool and
    hand back futures; purges, sweeps and usage queries run on the admin worker
    (`tenants.submit_admin`). `_lock` guards the pending-store count and the in-flight counts,
    and is never held across tier I/O. The tiers, the sealing and the tenant administration
    lock themselves.

    Failures: a tier in trouble degrades to a miss or a dropped write (the tiers count it);
    a load stops at the first block it cannot get and returns the leading ones (the rest is
    recomputed); a store that fails is logged and dropped; stores beyond
    `max_pending_stores` are dropped and counted. Nothing here raises for tier trouble,
    except where a purge must know (see TenantAdmin: it records a pending purge instead)."""

    def __init__(
        self,
        config: TierConfig,
        *,
        fingerprint: bytes,
        block_bytes: int,
        block_size: int,
        cost: CostModel | None = None,
        tiers: dict[str, Any] | None = None,
        executor: Executor | None = None,
    ) -> None:
        """`tiers`: ready-made tiers by name ("host", "disk", "remote") instead of those the
        config describes (the simulator's payload-free ones); a host tier's `on_evict` is set
        here. `executor`: runs loads and stores (default: `config.io_threads` worker threads)."""
        self.config = config
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        if tiers is not None:
            unknown = set(tiers) - set(TIER_ORDER)
            if unknown:
                raise ValueError(f"unknown tiers {sorted(unknown)}; tiers: {TIER_ORDER}")
            self.tiers: dict[str, Any] = {name: tiers[name] for name in TIER_ORDER if name in tiers}
            if "host" in self.tiers:
                self.tiers["host"].on_evict = self._on_host_evict
        else:
            self.tiers = self._open_tiers(config, fingerprint)
        self.names = list(self.tiers)
        self.sealing = Sealing(fingerprint, config.compression)
        """The data keys and the sealing of disk and remote frames with them."""
        if config.master_key_file:
            self.sealing.use_fleet_keys(config.master_key_file, self.tiers["remote"], config.key_check_interval_s)
        elif config.key_dir:
            self.sealing.use_key_dir(config.key_dir)
        self.cost = cost or CostModel(self.names, block_bytes, block_size)
        self._pool = executor or ThreadPoolExecutor(
            max_workers=config.io_threads, thread_name_prefix="kvtier-io", initializer=threads.on_helper_thread
        )
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # pending stores drained (flush)
        self.fence = OwnerFence()
        self.stats = HierarchyStats()
        self.tenants = TenantAdmin(
            self.tiers,
            fence=self.fence,
            sealing=self.sealing,
            stats=self.stats,
            block_bytes=block_bytes,
            remote_ttl_s=config.remote_ttl_s,
            ledger_path=_ledger_path(config, fingerprint),
        )
        """Purges, TTL expiry, quotas and usage per tenant: callers use its methods directly."""
        self._pending_stores = 0
        self._inflight: dict[str, int] = {name: 0 for name in self.names}
        self._closed = False

    def use_fleet_keys(self, master_key_file: str, check_interval_s: float = 1.0) -> None:
        """Switch to fleet keys (kvtier.tiers.keyring) before any request runs: what
        `master_key_file` in the config does, for a caller that built the hierarchy already."""
        if "remote" not in self.tiers:
            raise ValueError("--kv-master-key-file needs --remote-cache-url: the wrapped data keys live there")
        self.sealing.use_fleet_keys(master_key_file, self.tiers["remote"], check_interval_s)

    def _open_tiers(self, config: TierConfig, fingerprint: bytes) -> dict[str, Any]:
        """The tiers `config` describes, fastest first."""
        tiers: dict[str, Any] = {}
        if config.host_cache_bytes:
            tiers["host"] = HostTier(
                config.host_cache_bytes, faults=config.fault_for("host"), on_evict=self._on_host_evict
            )
        if config.disk_cache_dir:
            from kvtier.tiers.disk import DiskTier

            tiers["disk"] = DiskTier(
                config.disk_cache_dir,
                config.disk_cache_bytes or 16 << 30,
                fingerprint=fingerprint,
                faults=config.fault_for("disk"),
            )
        if config.remote_cache_url:
            from kvtier.tiers.remote import RemoteTier

            tiers["remote"] = RemoteTier(
                config.remote_cache_url,
                fingerprint=fingerprint,
                ttl_s=config.remote_ttl_s,
                timeout_s=config.remote_timeout_s,
                faults=config.fault_for("remote"),
            )
        return tiers

    # ------------------------------------------------------------------ lookup
    @property
    def has_remote(self) -> bool:
        return "remote" in self.tiers

    def submit_remote_lookup(self, keys: list[bytes]) -> Future | None:
        """Count of leading `keys` the remote tier holds, in the background."""
        if "remote" not in self.tiers or not keys:
            return None
        return self._pool.submit(self._timed_lookup, "remote", keys)

    def _timed_lookup(self, name: str, keys: list[bytes]) -> int:
        t0 = time.perf_counter()
        n = self.tiers[name].contains_prefix(keys)
        self.cost.tiers[name].observe_lookup(time.perf_counter() - t0)
        return n

    def runs(self, keys: list[bytes], start: int, remote_prefix: int = 0, count: bool = True) -> list[TierRun]:
        """Stored blocks from keys[start]: consecutive runs, each in the fastest tier holding it
        (`stored_runs`, kvtier/tiers/runs.py: the one lookup the engine, the simulator and the
        vLLM connector share). `count=False` for a lookup that repeats one already counted
        (see contains_prefix)."""
        local = [(name, self.tiers[name]) for name in ("host", "disk") if name in self.tiers]
        return stored_runs(local, keys, start, remote_prefix, count)

    def touch(self, keys: list[bytes]) -> None:
        """A device hit on `keys` (a prefix): refresh their host entries, head of the prefix
        last (most recent), as a restore does. Without it, an inclusive host tier ages out
        exactly the blocks that are hottest on device, and loses them for when the device
        evicts them."""
        host = self.tiers.get("host")
        if host is not None and keys:
            host.touch(reversed(keys))

    # ------------------------------------------------------------------ load
    def _encode(self, kv: Any, key: bytes, owner: Tenancy) -> bytes:
        """The frame a disk or remote tier stores for one block (Sealing.seal; the simulator
        overrides it)."""
        return self.sealing.seal(kv, key, owner.tenant)

    def _decode(self, tier: Any, data: bytes, key: bytes, owner: Tenancy) -> Any | None:
        """A frame's KV, or None (reported to `tier` as corrupt) when it does not decode
        (Sealing.unseal; the simulator overrides it)."""
        return self.sealing.unseal(tier, data, key, owner.tenant)

    def submit_load(self, keys: list[bytes], runs: list[TierRun], owner: Owner = None) -> Future:
        """Read the blocks of `runs` (in order) for `keys`; the result is a LoadResult.
        `owner`: the request's Tenancy (its owner id fences the load), or a tenant's name."""
        tenancy = as_tenancy(owner)
        plan: list[str] = []
        for run in runs:
            plan += [run.tier] * run.num_blocks
        assert len(plan) == len(keys)
        with self._lock:
            for name in set(plan):
                self._inflight[name] += 1
            self._update_queue_estimates()
        stamp = self.fence.stamp(tenancy.owner_id)
        return self._pool.submit(self._fenced_load, keys, plan, time.perf_counter(), tenancy, stamp)

    def _fenced_load(
        self, keys: list[bytes], plan: list[str], submitted: float, owner: Tenancy, stamp: Stamp
    ) -> LoadResult:
        """A load of a tenant purged since it was queued (or being purged) loads nothing."""
        with self.fence.enter(owner.owner_id, stamp) as ok:
            if ok:
                return self._load(keys, plan, submitted, owner, stamp)
        with self._lock:
            for name in set(plan):
                self._inflight[name] -= 1
            self._update_queue_estimates()
        return LoadResult([], {}, 0.0, time.perf_counter() - submitted)

    def _load(
        self,
        keys: list[bytes],
        plan: list[str],
        submitted: float,
        owner: Owner = None,
        stamp: Stamp | None = None,
    ) -> LoadResult:
        t_start = time.perf_counter()
        owner = as_tenancy(owner)
        stamp = stamp if stamp is not None else self.fence.stamp(owner.owner_id)
        out: list[Any] = []
        per_tier: dict[str, int] = {}
        tier_time: dict[str, float] = {}
        prefetched: dict[bytes, bytes | None] = {}
        try:
            for i, (key, name) in enumerate(zip(keys, plan)):
                t0 = time.perf_counter()
                tier = self.tiers[name]
                if name == "host":
                    entry = tier.get(key)
                    kv = None if entry is None or entry.stamp != stamp else entry.kv
                else:
                    if name == "remote" and key not in prefetched:
                        # one round trip for the next run of remote blocks (up to 32)
                        batch = [k for k, n in zip(keys[i : i + 32], plan[i : i + 32]) if n == "remote"]
                        prefetched.update(zip(batch, tier.get_many(batch)))
                    data = prefetched.pop(key) if key in prefetched else tier.get(key)
                    kv = None if data is None else self._decode(tier, data, key, owner)
                    if kv is not None:
                        host = self.tiers.get("host")
                        if host is not None:
                            host.put(key, HostEntry(kv, owner, time.monotonic(), stamp), self.block_bytes)
                            self.stats.promotions += 1
                tier_time[name] = tier_time.get(name, 0.0) + time.perf_counter() - t0
                if kv is None:
                    self.stats.load_failures += 1
                    break
                out.append(kv)
                per_tier[name] = per_tier.get(name, 0) + 1
        finally:
            with self._lock:
                for name in set(plan):
                    self._inflight[name] -= 1
                self._update_queue_estimates()
        host = self.tiers.get("host")
        if host is not None:
            host.touch(reversed(keys[: len(out)]))  # keep the head of a restored prefix longest
        for name, n in per_tier.items():
            self.cost.tiers[name].observe_read(n * self.block_bytes, tier_time[name])
        self.stats.loads += 1
        end = time.perf_counter()
        for name in per_tier:
            self.cost.tiers[name].observe_job(end - t_start)
        return LoadResult(out, per_tier, end - t_start, t_start - submitted)

    def _update_queue_estimates(self) -> None:
        workers = max(self.config.io_threads, 1)
        for name in self.names:
            job = self.cost.tiers[name].job_s.get(0.0)
            self.cost.queue_s[name] = self._inflight[name] * job / workers

    # ------------------------------------------------------------------ store
    def store(self, keys: list[bytes], tensors: list[Any], owners: Sequence[Owner] | None = None) -> None:
        """Write computed blocks down: host now (a reference), disk/remote in the background.
        `owners`: each block's Tenancy, its owner id precomputed (or a tenant's name); the
        tenant's data key encrypts the block on disk and remote."""
        tenancies = [as_tenancy(o) for o in owners] if owners is not None else [ANONYMOUS] * len(keys)
        host = self.tiers.get("host")
        lower: list[str] = [n for n in ("disk", "remote") if n in self.tiers]
        if self.config.cache_write_policy == "write_back" and host is not None:
            lower = []  # host evictions demote them later
        if host is not None:
            # Tail first: a prefix's head ends up most recent, so host evicts tails before heads.
            for key, kv, owner in zip(reversed(keys), reversed(tensors), reversed(tenancies)):
                if key not in host:
                    entry = HostEntry(kv, owner, time.monotonic(), self.fence.stamp(owner.owner_id))
                    host.put(key, entry, self.block_bytes)
            for owner in set(tenancies):
                self.tenants.enforce_host_quota(owner.tenant)
        if lower:
            self._submit_store(keys, tensors, tenancies, lower)

    def _on_host_evict(self, key: bytes, entry: HostEntry) -> None:
        if self.config.cache_write_policy != "write_back" or self._closed:
            return
        lower: list[str] = [n for n in ("disk", "remote") if n in self.tiers]
        if lower:
            self.stats.demotions += 1
            self._submit_store([key], [entry.kv], [as_tenancy(entry.owner)], lower, [entry.stamp])

    def _submit_store(
        self,
        keys: list[bytes],
        tensors: list[Any],
        owners: list[Tenancy],
        names: list[str],
        stamps: list[Stamp] | None = None,
    ) -> None:
        """Queue a store; each block carries its owner's stamp of now (or of when the host
        tier got it, for a demotion), so a purge in between fences it off."""
        if stamps is None:
            stamps = [self.fence.stamp(o.owner_id) for o in owners]
        with self._lock:
            if self._pending_stores + len(keys) > self.config.max_pending_stores:
                self.stats.stores_dropped += len(keys)
                return
            self._pending_stores += len(keys)
        self._pool.submit(self._store, keys, tensors, owners, names, stamps)

    def _store(
        self,
        keys: list[bytes],
        tensors: list[Any],
        owners: list[Tenancy],
        names: list[str],
        stamps: list[Stamp] | None = None,
    ) -> None:
        try:
            stamps = stamps or [self.fence.stamp(o.owner_id) for o in owners]
            groups: dict[tuple[Tenancy, Stamp], list[int]] = {}
            for i, group in enumerate(zip(owners, stamps)):
                groups.setdefault(group, []).append(i)
            for (owner, stamp), idx in groups.items():
                with self.fence.enter(owner.owner_id, stamp) as ok:
                    if not ok:
                        self.stats.stores_fenced += len(idx)
                        continue
                    self._store_owned([keys[i] for i in idx], [tensors[i] for i in idx], owner, names)
        except Exception:  # a store is best effort; tiers count their own errors
            logger.exception("store to %s failed", names)
        finally:
            with self._cond:
                self._pending_stores -= len(keys)
                self._cond.notify_all()

    def _store_owned(self, keys: list[bytes], tensors: list[Any], owner: Tenancy, names: list[str]) -> None:
        """Write one owner's blocks and record them in its manifests (inside its fence)."""
        stored: dict[str, list[bytes]] = {}
        for key, kv in zip(keys, tensors):
            data = None
            for name in names:
                tier = self.tiers[name]
                if name == "disk" and tier.contains_prefix([key], count=False):
                    continue
                if data is None:
                    try:
                        data = self._encode(kv, key, owner)
                    except (KeyDestroyedError, KeyringError):
                        return  # no data key to be had now (Redis down): nothing is stored
                if tier.put(key, data, self.tenants.remote_ttl(owner.tenant) if name == "remote" else None):
                    stored.setdefault(name, []).append(key)
        for name, done in stored.items():
            self.tiers[name].record_owner(owner.owner_id, done)
            if name == "disk":
                self.tenants.enforce_disk_quota(owner)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued stores are written (tests, shutdown). True if drained."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending_stores == 0, timeout_s)

    # ------------------------------------------------------------------ stats / lifecycle
    def tier_stats(self) -> dict[str, TierStats]:
        return {name: tier.stats for name, tier in self.tiers.items()}

    def usage(self) -> dict[str, tuple[int, int | None]]:
        return {name: (tier.usage_bytes, tier.capacity_bytes) for name, tier in self.tiers.items()}

    def close(self) -> None:
        self._closed = True
        self.flush(5.0)
        self.tenants.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for tier in self.tiers.values():
            if hasattr(tier, "close") and tier.name != "host":
                tier.close()
