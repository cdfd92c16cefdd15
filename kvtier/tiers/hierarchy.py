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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier import threads
from kvtier.cost.model import CostModel, TierRun
from kvtier.tiers.base import FaultConfig, TierError, TierStats
from kvtier.tiers.purge import ALL, OwnerFence, PurgeLedger, unlink_remote

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back", "selective")
DEFAULT_OWNER = "_default"
"""The data key of blocks that belong to no named tenant (offline use, a single-tenant server)."""


@functools.lru_cache(maxsize=4096)
def owner_id(owner: str | None) -> str:
    """A tenant's name as stored beside its blocks: hashed, so names never reach the disk."""
    import hashlib

    return hashlib.sha256((owner or DEFAULT_OWNER).encode("utf-8")).hexdigest()[:32]


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
        self.owner_quota: dict[str | None, tuple[int | None, int | None]] = {}
        """Per-tenant (host_bytes, disk_bytes) caps; a tenant over its cap loses its own oldest
        blocks first, never another tenant's."""
        self.owner_ttl_s: dict[str | None, float] = {}
        """Per-tenant time to live of stored KV (set by the server from its tenant config)."""
        self.keys = None
        self.revoked_owners: set[str | None] = set()
        """Tenants whose fleet data key another instance destroyed or replaced: the engine
        purges its own copies of them (AsyncEngine) and clears the entry."""
        if config.master_key_file:
            from kvtier.tiers.keyring import FleetKeyring, read_master_key

            self.keys = FleetKeyring(
                read_master_key(config.master_key_file),
                self.tiers["remote"],
                check_interval_s=config.key_check_interval_s,
                on_revoked=self._on_key_revoked,
            )
        elif config.key_dir:
            from kvtier.tiers.crypto import KeyStore

            self.keys = KeyStore(config.key_dir)
        self.cost = cost or CostModel(self.names, block_bytes, block_size)
        self._pool = executor or ThreadPoolExecutor(
            max_workers=config.io_threads, thread_name_prefix="kvtier-io", initializer=threads.on_helper_thread
        )
        self._admin: ThreadPoolExecutor | None = None  # purges, sweeps: off the engine thread
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # pending stores drained (flush)
        self.fence = OwnerFence()
        self.ledger = PurgeLedger(_ledger_path(config, fingerprint))
        self._held: set[str] = set()  # owner ids fenced until their pending remote purge is done
        for oid in self.ledger.pending():
            self.fence.begin(oid)
            self._held.add(oid)
        self._pending_stores = 0
        self._inflight: dict[str, int] = {name: 0 for name in self.names}
        self.stats = HierarchyStats()
        self._closed = False

    def use_fleet_keys(self, master_key_file: str, check_interval_s: float = 1.0) -> None:
        """Switch to fleet keys (kvtier.tiers.keyring) before any request runs: what
        `master_key_file` in the config does, for a caller that built the hierarchy already."""
        from kvtier.tiers.keyring import FleetKeyring, read_master_key

        if "remote" not in self.tiers:
            raise ValueError("--kv-master-key-file needs --remote-cache-url: the wrapped data keys live there")
        self.keys = FleetKeyring(
            read_master_key(master_key_file),
            self.tiers["remote"],
            check_interval_s=check_interval_s,
            on_revoked=self._on_key_revoked,
        )

    def _open_tiers(self, config: TierConfig, fingerprint: bytes) -> dict[str, Any]:
        """The tiers `config` describes, fastest first."""
        tiers: dict[str, Any] = {}
        if config.host_cache_bytes:
            from kvtier.tiers.host import HostTier

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
        """Stored blocks from keys[start]: consecutive runs, each in the fastest tier holding it.
        `count=False` for a lookup that repeats one already counted (see contains_prefix)."""
        runs: list[TierRun] = []
        p = start
        for _ in range(16):
            if p >= len(keys):
                break
            n, name = 0, None
            for name in ("host", "disk"):
                tier = self.tiers.get(name)
                if tier is not None:
                    n = tier.contains_prefix(keys[p:], count=count)
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
        """The owner's cipher (None: no encryption). Raises KeyDestroyedError / KeyringError
        when there is none to be had: the caller skips the block (a store) or misses (a load)."""
        return None if self.keys is None else self.keys.cipher(owner or DEFAULT_OWNER)

    def _encode(self, kv: Any, key: bytes, owner: str | None) -> bytes:
        """The frame a disk or remote tier stores for one block."""
        from kvtier.tiers.codec import encode

        return encode(
            kv, fingerprint=self.fingerprint, key=key, compression=self.config.compression, cipher=self._cipher(owner)
        )

    def _decode(self, tier: Any, data: bytes, key: bytes, owner: str | None) -> Any | None:
        """A frame's KV, or None (reported to `tier` as corrupt) when it does not decode."""
        from kvtier.tiers.codec import CodecError, decode
        from kvtier.tiers.crypto import KeyDestroyedError
        from kvtier.tiers.keyring import KeyringError

        try:
            cipher = self._cipher(owner)
        except (KeyDestroyedError, KeyringError):
            return None  # no key to be had now: a miss, the entry stays
        try:
            return decode(data, fingerprint=self.fingerprint, key=key, cipher=cipher)
        except CodecError:
            fresh = self._recheck_key(owner, cipher)
            if fresh is not None:  # another instance made the entry with the fleet's newer key
                try:
                    return decode(data, fingerprint=self.fingerprint, key=key, cipher=fresh)
                except CodecError:
                    pass
            tier.report_corrupt(key)
            return None

    def _recheck_key(self, owner: str | None, used: Any) -> Any | None:
        """Fleet keys: the owner's current cipher if it differs from `used`, else None."""
        if used is None or not hasattr(self.keys, "check"):
            return None
        try:
            fresh = self.keys.check(owner or DEFAULT_OWNER)
        except Exception:  # noqa: BLE001 - Redis unreachable, a wrong master key: treat as corrupt
            return None
        return fresh if fresh is not None and fresh.key_id != used.key_id else None

    def _on_key_revoked(self, tenant: str) -> None:
        """The fleet keyring saw `tenant`'s key destroyed or replaced by another instance."""
        with self._lock:
            self.revoked_owners.add(None if tenant == DEFAULT_OWNER else tenant)

    def refresh_key(self, owner: str | None) -> None:
        """Fleet keys: re-read `owner`'s wrapped key if the cached one is older than the check
        interval (any thread; a revocation lands in `revoked_owners`). No-op otherwise."""
        refresh = getattr(self.keys, "refresh", None)
        if refresh is not None:
            refresh(owner or DEFAULT_OWNER)

    def take_revoked(self) -> list[str | None]:
        with self._lock:
            out, self.revoked_owners = list(self.revoked_owners), set()
        return out

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
        stamp = self.fence.stamp(owner_id(owner))
        return self._pool.submit(self._fenced_load, keys, plan, time.perf_counter(), owner, stamp)

    def _fenced_load(
        self, keys: list[bytes], plan: list[str], submitted: float, owner: str | None, stamp: tuple[int, int]
    ) -> LoadResult:
        """A load of a tenant purged since it was queued (or being purged) loads nothing."""
        with self.fence.enter(owner_id(owner), stamp) as ok:
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
        owner: str | None = None,
        stamp: tuple[int, int] | None = None,
    ) -> LoadResult:
        t_start = time.perf_counter()
        stamp = stamp if stamp is not None else self.fence.stamp(owner_id(owner))
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
                    kv = None if entry is None or entry[3] != stamp else entry[0]
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
                            host.put(key, (kv, owner, time.monotonic(), stamp), self.block_bytes)
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
                    host.put(key, (kv, owner, time.monotonic(), self.fence.stamp(owner_id(owner))), self.block_bytes)
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
            kv, owner, _, stamp = entry
            self._submit_store([key], [kv], [owner], lower, [stamp])

    def _submit_store(
        self,
        keys: list[bytes],
        tensors: list[Any],
        owners: list[str | None],
        names: list[str],
        stamps: list[tuple[int, int]] | None = None,
    ) -> None:
        """Queue a store; each block carries its owner's stamp of now (or of when the host
        tier got it, for a demotion), so a purge in between fences it off."""
        if stamps is None:
            stamps = [self.fence.stamp(owner_id(o)) for o in owners]
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
        owners: list[str | None],
        names: list[str],
        stamps: list[tuple[int, int]] | None = None,
    ) -> None:
        try:
            stamps = stamps or [self.fence.stamp(owner_id(o)) for o in owners]
            groups: dict[tuple[str | None, tuple[int, int]], list[int]] = {}
            for i, group in enumerate(zip(owners, stamps)):
                groups.setdefault(group, []).append(i)
            for (owner, stamp), idx in groups.items():
                with self.fence.enter(owner_id(owner), stamp) as ok:
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

    def _store_owned(self, keys: list[bytes], tensors: list[Any], owner: str | None, names: list[str]) -> None:
        """Write one owner's blocks and record them in its manifests (inside its fence)."""
        from kvtier.tiers.crypto import KeyDestroyedError
        from kvtier.tiers.keyring import KeyringError

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
                if tier.put(key, data, self._remote_ttl(owner) if name == "remote" else None):
                    stored.setdefault(name, []).append(key)
        for name, done in stored.items():
            self.tiers[name].record_owner(owner_id(owner), done)
            cap = self.owner_quota.get(owner, (None, None))[1]
            if name == "disk" and cap is not None:
                self._enforce_disk_quota(self.tiers[name], owner, cap)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued stores are written (tests, shutdown). True if drained."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending_stores == 0, timeout_s)

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

    # ------------------------------------------------------------------ purges
    def submit_admin(self, fn: Any, *args: Any) -> Future:
        """Run `fn(*args)` on the admin worker (one thread: purges, sweeps, usage), never on
        the engine thread and never behind the loads and stores of the I/O pool."""
        if self._admin is None:
            self._admin = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvtier-admin", initializer=threads.on_helper_thread
            )
        return self._admin.submit(fn, *args)

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
        self.fence.begin(oid)
        host = self.tiers.get("host")
        num_host = host.purge_where(lambda e: e[1] == owner) if host is not None else 0
        forget = getattr(self.keys, "forget", None)
        if forget is not None:
            forget(owner or DEFAULT_OWNER)  # this process stops using the key at once
        return self.submit_admin(self._finish_purge, owner, oid, num_host, everywhere)

    def _finish_purge(self, owner: str | None, oid: str, num_host: int, everywhere: bool) -> dict[str, Any]:
        settled = False
        try:
            self.fence.wait_quiet(oid)  # stores and loads that began before the fence
            counts: dict[str, Any] = {}
            host = self.tiers.get("host")
            if host is not None:  # again: promotions of loads that were in flight
                counts["host"] = num_host + host.purge_where(lambda e: e[1] == owner)
            disk = self.tiers.get("disk")
            if disk is not None:
                counts["disk"] = disk.purge(disk.owner_keys(oid))
                disk.forget_owner(oid)
            pending: list[str] = []
            if everywhere:
                if "remote" in self.tiers:
                    try:
                        counts["remote"] = self._purge_remote(oid)
                    except TierError as e:
                        logger.warning("purge of tenant %s: remote tier not purged (%s); pending", oid, e)
                        counts["remote"] = None
                        pending.append("remote")
                if self.keys is not None and not hasattr(self.keys, "check"):
                    counts["key_destroyed"] = int(self.keys.destroy(owner or DEFAULT_OWNER))
                elif self.keys is not None:
                    counts["key_destroyed"] = 0 if pending else 1
            counts["pending"] = pending
            self._settle(oid, pending)
            settled = True
            return counts
        finally:
            if not settled:
                self.fence.end(oid)

    def _settle(self, oid: str, pending: list[str]) -> None:
        """After a purge attempt: record or clear `oid`'s pending part, and lift the fence
        once nothing is pending (the ledger's hold keeps it up until then)."""
        if pending:
            self.ledger.add(oid, pending)
            if oid in self._held:
                self.fence.end(oid)
            else:
                self._held.add(oid)
            return
        self.ledger.done(oid)
        self.fence.end(oid)
        if oid in self._held:
            self._held.discard(oid)
            self.fence.end(oid)

    def _purge_remote(self, oid: str) -> int:
        """Delete `oid`'s Redis entries (ALL: every entry of this model configuration), its
        owner set and, with fleet keys, its wrapped data key. Raises TierError."""
        remote = self.tiers["remote"]
        if oid == ALL:
            n = remote.call("purge", remote._clear)
            if hasattr(self.keys, "check"):
                self.keys.destroy_all()
            return n
        n = unlink_remote(remote, remote.owner_keys(oid, strict=True))
        remote.forget_owner(oid, strict=True)
        if hasattr(self.keys, "check"):
            self.keys.destroy_oid(oid)
        return n

    def retry_pending_purges(self, wait_gate_s: float = 5.0) -> dict[str, list[str]]:
        """Finish the pending purges whose tiers answer now (admin worker). A tier in back-off
        is waited for (at most `wait_gate_s`) so that a caller retrying right after the
        backend returned gets its answer. Returns what is still pending per owner id."""
        remote = self.tiers.get("remote")
        for oid in self.ledger.pending():
            if remote is not None and not remote.healthy:
                time.sleep(min(remote.health.retry_in_s, wait_gate_s))
            try:
                if remote is not None:
                    self._purge_remote(oid)
            except TierError as e:
                logger.info("pending purge of %s still pending: %s", oid, e)
                continue
            self.fence.begin(oid)
            self._settle(oid, [])
        return {oid: rec["tiers"] for oid, rec in self.ledger.pending().items()}

    def pending_purges(self) -> dict[str, list[str]]:
        """{owner id: tiers} of purges not finished yet."""
        return {oid: rec["tiers"] for oid, rec in self.ledger.pending().items()}

    def purge_all(self) -> dict[str, Any]:
        """Delete every stored block of this model configuration from every tier and destroy
        every data key (blocking; the server uses begin_purge_all)."""
        return self.begin_purge_all().result()

    def begin_purge_all(self) -> Future:
        self.fence.begin(ALL)
        host = self.tiers.get("host")
        num_host = host.clear() if host is not None else 0
        return self.submit_admin(self._finish_purge_all, num_host)

    def _finish_purge_all(self, num_host: int) -> dict[str, Any]:
        settled = False
        try:
            self.fence.wait_quiet(ALL)
            counts: dict[str, Any] = {}
            for name, tier in self.tiers.items():
                if name == "host":
                    counts[name] = num_host + tier.clear()
                elif name == "disk":
                    counts[name] = tier.clear()
            pending: list[str] = []
            if "remote" in self.tiers:
                try:
                    counts["remote"] = self._purge_remote(ALL)
                except TierError as e:
                    logger.warning("purge of every tenant: remote tier not purged (%s); pending", e)
                    counts["remote"] = None
                    pending.append("remote")
            if self.keys is not None and not hasattr(self.keys, "check"):
                counts["keys_destroyed"] = self.keys.destroy_all()
            counts["pending"] = pending
            self._settle(ALL, pending)
            settled = True
            return counts
        finally:
            if not settled:
                self.fence.end(ALL)

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

    def close(self) -> None:
        self._closed = True
        self.flush(5.0)
        if self._admin is not None:
            self._admin.shutdown(wait=True)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for tier in self.tiers.values():
            if hasattr(tier, "close") and tier.name != "host":
                tier.close()
