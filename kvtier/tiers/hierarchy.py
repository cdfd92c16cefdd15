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
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvtier.cost.model import CostModel, TierRun
from kvtier.tiers.base import FaultConfig, TierStats

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back", "selective")
DEFAULT_OWNER = "_default"


@functools.lru_cache(maxsize=4096)
def owner_id(owner: str | None) -> str:
    """A tenant's name as stored beside its blocks: hashed, so names never reach the disk."""
    import hashlib

    return hashlib.sha256((owner or DEFAULT_OWNER).encode("utf-8")).hexdigest()[:32]
"""The data key of blocks that belong to no named tenant (offline use, a single-tenant server)."""
TIER_ORDER = ("host", "disk", "remote")


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
            raise ValueError(f"cache_write_policy must be one of {WRITE_POLICIES}, got "
                             f"{self.cache_write_policy!r}")
        if self.host_cache_bytes is not None and self.host_cache_bytes <= 0:
            raise ValueError("host_cache_bytes must be positive")
        if self.disk_cache_bytes is not None and self.disk_cache_dir is None:
            raise ValueError("disk_cache_bytes needs disk_cache_dir")
        if self.restore_policy not in ("cost", "always"):
            raise ValueError("restore_policy must be 'cost' or 'always'")
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


class TierHierarchy:
    def __init__(self, config: TierConfig, *, fingerprint: bytes, block_bytes: int,
                 block_size: int, cost: CostModel | None = None, tiers: dict[str, Any] | None = None,
                 executor: Executor | None = None) -> None:
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
        self.owner_quota: dict[str | None, tuple[int | None, int | None]] = {}
        """Per-tenant (host_bytes, disk_bytes) caps; a tenant over its cap loses its own oldest
        blocks first, never another tenant's."""
        self.owner_ttl_s: dict[str | None, float] = {}
        """Per-tenant time to live of stored KV (set by the server from its tenant config)."""
        self.keys = None
        if config.key_dir:
            from kvtier.tiers.crypto import KeyStore
            self.keys = KeyStore(config.key_dir)
        self.cost = cost or CostModel(self.names, block_bytes, block_size)
        self._pool = executor or ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix="kvtier-io")
        self._lock = threading.Lock()
        self._pending_stores = 0
        self._inflight: dict[str, int] = {name: 0 for name in self.names}
        self.stats = HierarchyStats()
        self._closed = False

    def _open_tiers(self, config: TierConfig, fingerprint: bytes) -> dict[str, Any]:
        """The tiers `config` describes, fastest first."""
        tiers: dict[str, Any] = {}
        if config.host_cache_bytes:
            from kvtier.tiers.host import HostTier
            tiers["host"] = HostTier(config.host_cache_bytes, faults=config.fault_for("host"),
                                     on_evict=self._on_host_evict)
        if config.disk_cache_dir:
            from kvtier.tiers.disk import DiskTier
            tiers["disk"] = DiskTier(config.disk_cache_dir, config.disk_cache_bytes or 16 << 30,
                                     fingerprint=fingerprint, faults=config.fault_for("disk"))
        if config.remote_cache_url:
            from kvtier.tiers.remote import RemoteTier
            tiers["remote"] = RemoteTier(config.remote_cache_url, fingerprint=fingerprint,
                                         ttl_s=config.remote_ttl_s, timeout_s=config.remote_timeout_s,
                                         faults=config.fault_for("remote"))
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

    def runs(self, keys: list[bytes], start: int, remote_prefix: int = 0) -> list[TierRun]:
        """Stored blocks from keys[start]: consecutive runs, each in the fastest tier holding it."""
        runs: list[TierRun] = []
        p = start
        for _ in range(16):
            if p >= len(keys):
                break
            n, name = 0, None
            for name in ("host", "disk"):
                tier = self.tiers.get(name)
                if tier is not None:
                    n = tier.contains_prefix(keys[p:])
                    if n:
                        break
            if not n and remote_prefix > p:
                n, name = remote_prefix - p, "remote"
            if not n:
                break
            runs.append(TierRun(name, n))
            p += n
        return runs

    def touch(self, keys: list[bytes]) -> None:
        """A device hit on `keys` (a prefix): refresh their host entries, head of the prefix
        last (most recent), as a restore does. Without it, an inclusive host tier ages out
        exactly the blocks that are hottest on device, and loses them for when the device
        evicts them (the simulator measured 28.0% vs 28.8% block hits on the conversation
        trace at 10k device blocks)."""
        host = self.tiers.get("host")
        if host is not None and keys:
            host.touch(reversed(keys))

    # ------------------------------------------------------------------ load
    def _cipher(self, owner: str | None):
        return None if self.keys is None else self.keys.cipher(owner or DEFAULT_OWNER)

    def _encode(self, kv: Any, key: bytes, owner: str | None) -> bytes:
        """The frame a disk or remote tier stores for one block."""
        from kvtier.tiers.codec import encode

        return encode(kv, fingerprint=self.fingerprint, key=key, compression=self.config.compression,
                      cipher=self._cipher(owner))

    def _decode(self, tier: Any, data: bytes, key: bytes, owner: str | None) -> Any | None:
        """A frame's KV, or None (reported to `tier` as corrupt) when it does not decode."""
        from kvtier.tiers.codec import CodecError, decode

        try:
            return decode(data, fingerprint=self.fingerprint, key=key, cipher=self._cipher(owner))
        except CodecError:
            tier.report_corrupt(key)
            return None

    def submit_load(self, keys: list[bytes], runs: list[TierRun], owner: str | None = None) -> Future:
        """Read the blocks of `runs` (in order) for `keys`; the result is a LoadResult."""
        plan: list[str] = []
        for run in runs:
            plan += [run.tier] * run.num_blocks
        assert len(plan) == len(keys)
        with self._lock:
            for name in set(plan):
                self._inflight[name] += 1
            self._update_queue_estimates()
        return self._pool.submit(self._load, keys, plan, time.perf_counter(), owner)

    def _load(self, keys: list[bytes], plan: list[str], submitted: float, owner: str | None = None) -> LoadResult:
        t_start = time.perf_counter()
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
                    kv = None if entry is None else entry[0]
                else:
                    if name == "remote" and key not in prefetched:
                        # one round trip for the next run of remote blocks (up to 32)
                        batch = [k for k, n in zip(keys[i:i + 32], plan[i:i + 32]) if n == "remote"]
                        prefetched.update(zip(batch, tier.get_many(batch)))
                    data = prefetched.pop(key) if key in prefetched else tier.get(key)
                    kv = None if data is None else self._decode(tier, data, key, owner)
                    if kv is not None:
                        host = self.tiers.get("host")
                        if host is not None:
                            host.put(key, (kv, owner, time.monotonic()), self.block_bytes)
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
            host.touch(reversed(keys[:len(out)]))  # keep the head of a restored prefix longest
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
    def store(self, keys: list[bytes], tensors: list[Any], owners: list[str | None] | None = None) -> None:
        """Write computed blocks down: host now (a reference), disk/remote in the background.
        `owners`: each block's tenant (its data key encrypts the block on disk and remote)."""
        owners = owners if owners is not None else [None] * len(keys)
        host = self.tiers.get("host")
        lower = [n for n in ("disk", "remote") if n in self.tiers]
        if self.config.cache_write_policy == "write_back" and host is not None:
            lower = []  # host evictions demote them later
        if host is not None:
            # Tail first: a prefix's head ends up most recent, so host evicts tails before heads.
            for key, kv, owner in zip(reversed(keys), reversed(tensors), reversed(owners)):
                if key not in host:
                    host.put(key, (kv, owner, time.monotonic()), self.block_bytes)
            for owner in set(owners):
                cap = self.owner_quota.get(owner, (None, None))[0]
                if cap is not None:
                    self._enforce_host_quota(host, owner, cap)
        if lower:
            self._submit_store(keys, tensors, owners, lower)

    def _on_host_evict(self, key: bytes, entry: Any) -> None:
        if self.config.cache_write_policy != "write_back" or self._closed:
            return
        lower = [n for n in ("disk", "remote") if n in self.tiers]
        if lower:
            self.stats.demotions += 1
            kv, owner, _ = entry
            self._submit_store([key], [kv], [owner], lower)

    def _submit_store(self, keys: list[bytes], tensors: list[Any], owners: list[str | None],
                      names: list[str]) -> None:
        with self._lock:
            if self._pending_stores + len(keys) > self.config.max_pending_stores:
                self.stats.stores_dropped += len(keys)
                return
            self._pending_stores += len(keys)
        self._pool.submit(self._store, keys, tensors, owners, names)

    def _store(self, keys: list[bytes], tensors: list[Any], owners: list[str | None],
               names: list[str]) -> None:
        stored: dict[tuple[str, str | None], list[bytes]] = {}
        try:
            for key, kv, owner in zip(keys, tensors, owners):
                data = None
                for name in names:
                    tier = self.tiers[name]
                    if name == "disk" and tier.contains_prefix([key]):
                        continue
                    if data is None:
                        data = self._encode(kv, key, owner)
                    if tier.put(key, data, self._remote_ttl(owner) if name == "remote" else None):
                        stored.setdefault((name, owner), []).append(key)
            for (name, owner), done in stored.items():
                self.tiers[name].record_owner(owner_id(owner), done)
                cap = self.owner_quota.get(owner, (None, None))[1]
                if name == "disk" and cap is not None:
                    self._enforce_disk_quota(self.tiers[name], owner, cap)
        except Exception:  # a store is best effort; tiers count their own errors
            logger.exception("store to %s failed", names)
        finally:
            with self._lock:
                self._pending_stores -= len(keys)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued stores are written (tests, shutdown). True if drained."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._pending_stores == 0:
                    return True
            time.sleep(0.002)
        return False

    # ------------------------------------------------------------------ tenants
    def _enforce_host_quota(self, host: Any, owner: str | None, cap_bytes: int) -> None:
        with host._lock:
            mine = [k for k, v in host._entries.items() if v[1] == owner]  # least recent first
        excess = len(mine) * self.block_bytes - cap_bytes
        for key in mine:
            if excess <= 0:
                break
            if host.delete(key):
                excess -= self.block_bytes
                self.stats.quota_evictions += 1

    def _enforce_disk_quota(self, disk: Any, owner: str | None, cap_bytes: int) -> None:
        keys = disk.owner_keys(owner_id(owner))  # oldest write first
        with disk._lock:
            present = [(k, disk._index[k]) for k in keys if k in disk._index]
        excess = sum(size for _, size in present) - cap_bytes
        for key, size in present:
            if excess <= 0:
                break
            if disk.delete(key):
                excess -= size
                self.stats.quota_evictions += 1

    def _remote_ttl(self, owner: str | None) -> float | None:
        ttls = [t for t in (self.config.remote_ttl_s, self.owner_ttl_s.get(owner)) if t is not None]
        return min(ttls) if ttls else None

    def expire_owner(self, owner: str | None, ttl_s: float) -> dict[str, int]:
        """Delete `owner`'s blocks stored more than `ttl_s` ago from host and disk (Redis
        entries carry the TTL themselves)."""
        counts: dict[str, int] = {}
        host = self.tiers.get("host")
        if host is not None:
            cutoff = time.monotonic() - ttl_s
            counts["host"] = host.purge_where(lambda e: e[1] == owner and e[2] < cutoff)
        disk = self.tiers.get("disk")
        if disk is not None:
            counts["disk"] = disk.expire_owner(owner_id(owner), ttl_s)
        return counts

    def purge_owner(self, owner: str | None) -> dict[str, int]:
        """Delete every stored block of `owner` from every tier and destroy its data key."""
        self.flush()
        oid = owner_id(owner)
        counts: dict[str, int] = {}
        host = self.tiers.get("host")
        if host is not None:
            counts["host"] = host.purge_where(lambda entry: entry[1] == owner)
        for name in ("disk", "remote"):
            tier = self.tiers.get(name)
            if tier is not None:
                keys = tier.owner_keys(oid)
                counts[name] = tier.purge(keys)
                tier.forget_owner(oid)
        if self.keys is not None:
            counts["key_destroyed"] = int(self.keys.destroy(owner or DEFAULT_OWNER))
        return counts

    def purge_all(self) -> dict[str, int]:
        """Delete every stored block of this model configuration from every tier and destroy
        every data key."""
        self.flush()
        counts = {name: tier.clear() for name, tier in self.tiers.items()}
        if self.keys is not None:
            counts["keys_destroyed"] = self.keys.destroy_all()
        return counts

    def owner_usage(self, owner: str | None) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        host = self.tiers.get("host")
        if host is not None:
            with host._lock:
                n = sum(1 for v in host._entries.values() if v[1] == owner)
            out["host"] = {"blocks": n, "bytes": n * self.block_bytes}
        for name in ("disk", "remote"):
            tier = self.tiers.get(name)
            if tier is not None:
                keys = tier.owner_keys(owner_id(owner))
                n = tier.contains_count(keys) if hasattr(tier, "contains_count") else len(keys)
                out[name] = {"blocks": n}
        return out

    # ------------------------------------------------------------------ stats / lifecycle
    def tier_stats(self) -> dict[str, TierStats]:
        return {name: tier.stats for name, tier in self.tiers.items()}

    def usage(self) -> dict[str, tuple[int, int | None]]:
        return {name: (tier.usage_bytes, tier.capacity_bytes) for name, tier in self.tiers.items()}

    def set_faults(self, tier: str, config: FaultConfig | None) -> None:
        self.tiers[tier].faults = config

    def close(self) -> None:
        self._closed = True
        self.flush(5.0)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for tier in self.tiers.values():
            if hasattr(tier, "close") and tier.name != "host":
                tier.close()
