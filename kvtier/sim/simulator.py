"""Replay a Mooncake-format request trace through kvtier's own cache code, with no model.

Trace format (kvtier/trace.py reads it; one JSON object per line): ``timestamp`` (ms),
``input_length``, ``output_length``, ``hash_ids`` (one opaque id per ``block_tokens``-token block
of the input, chained: equal ids at the same position mean an equal prefix).

What runs is the engine's code: the device pool is a ``KVCacheManager`` (``BlockPool`` +
``PrefixIndex``, LRU/LFU, leaves first, and its store policy), the tiers below are the engine's
``TierHierarchy`` with its ``HostTier`` (sim/tiers.py: payload-free entries, a file-less disk
index, a remote (Redis) index that a simulated fleet shares, loads and stores run in order in
this thread), and each restore is decided by the
scheduler's ``plan_restore`` (kvtier/sched/admission.py) over a ``CostModel`` with fixed speeds.
Per request, in timestamp order (stable for equal timestamps), the steps the engine takes for
one request that arrives alone (kvtier/sched/scheduler.py ``_admit``/``_try_restore``,
kvtier/engine/core.py ``step``)::

    keys      key_0 = hash_id_key(root_key(b"sim"), id_0), key_i = hash_id_key(key_{i-1}, id_i)
    remote    r = leading keys the remote tier holds (the engine's background lookup)
    match     d = device prefix (PrefixIndex.match_keys)
    decide    plan_restore: TierHierarchy.touch refreshes the hits' host entries;
              TierHierarchy.runs(keys, d, r) finds the stored blocks after them, fastest tier
              first; CostModel.decide -> restore k of them ('always': all of them)
    admit     KVCacheManager.allocate_restore: reference the d hits, take k blocks; load them
              (promotes disk and remote hits into host); allocate_more: the other n - d - k blocks
              (without a restore: allocate_new takes the n - d); device evictions go to the
              write-back log
    store     take_blocks_to_store -> TierHierarchy.store: write_back: evicted blocks -> host
              (host evictions demote to disk); selective: blocks on their Nth hit
    compute   register the n - d blocks; free all (last first): cached and evictable
    store     write_through: the blocks just computed (not those restored) -> every tier

`TraceSimulator.handle` is that sequence for one request on one instance; kvtier/sim/fleet.py
runs several simulators (instances) and routes each request to one of them, the remote tier
one object shared by all (a block stored by one instance is a remote hit for another).

The blocks are registered with ``BlockPool.cache_block`` under the trace's keys (the manager's
``cache_blocks`` derives keys from token ids, which a trace does not have), so the simulator
applies write_through's rule itself: what was computed, not what was restored.

A request with more blocks than the device pool cannot be held at once: it counts as all-miss
and touches nothing. The trace's last block is usually partial; the simulator caches it like a
full one (the engine caches full blocks only: tests/sim/test_sim_vs_engine.py feeds the engine
full blocks plus one token, and then both agree block for block).

Hit rates: block = hit blocks / blocks; token = hit tokens / input tokens, block ``i`` carrying
``min(block_tokens, input_length - i * block_tokens)`` tokens. A stored block the cost model
chooses to recompute is not a hit. Prefill saved = sum over requests of prefill(all tokens)
- (restore time + prefill(tokens left after the cached prefix)), with the model
``t = a*n + b*n*(c + n/2)`` (n new tokens after c cached).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.cost.model import CostModel, TierRun
from kvtier.kvcache.block_pool import BlockToStore
from kvtier.kvcache.keys import BlockKey, hash_id_key, root_key
from kvtier.kvcache.manager import KVCacheManager, PrefixMatch
from kvtier.sched.admission import plan_restore
from kvtier.sim.config import DEFAULT_PREFILL_S_PER_TOKEN, SimConfig
from kvtier.sim.tiers import PAYLOAD, MemoryTier, SerialExecutor, SharedMemoryTier, SimHierarchy
from kvtier.tiers.hierarchy import TierConfig
from kvtier.trace import TraceRecord, as_records, by_time, read_trace

SIM_ROOT = root_key(b"sim")
_REQ = "sim"
"""The request id the simulator admits each request under (one at a time)."""


@dataclass(slots=True)
class SimRequest:
    timestamp: float
    input_length: int
    keys: list[BlockKey]
    block_tokens: list[int]
    """Tokens of each block (the last one usually partial)."""
    output_length: int = 0
    """Tokens generated (the fleet's load model counts their decode time)."""


@dataclass(slots=True)
class RequestOutcome:
    """What one request got on the instance that ran it (TraceSimulator.handle)."""

    hit_tokens: int
    """Input tokens not computed: device hits and restored blocks."""
    prefill_s: float
    """Estimated time to its first output: restore time + prefill of the tokens left."""


def load_trace(
    path: str | Path | Iterable[dict | TraceRecord], block_tokens: int = 512, limit: int | None = None
) -> list[SimRequest]:
    """Read a trace (a path, or records as dicts; kvtier.trace checks them), keep the first
    `limit`, sort them by timestamp (stable) and chain their keys."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if isinstance(path, (str, Path)):
        records = read_trace(path, limit)
    else:
        items = list(path)
        records = as_records(items if limit is None else items[:limit])
    memo: dict[tuple[BlockKey, int], BlockKey] = {}
    out: list[SimRequest] = []
    for r in by_time(records):
        ids = r.hash_ids
        # A block holds at most block_tokens tokens: a trace replayed with fewer tokens per id
        # than it was recorded with (the fleet benchmark's 8 for Mooncake's 512) has shorter
        # prompts, whatever its input_length says.
        length = min(r.num_tokens(block_tokens), len(ids) * block_tokens)
        keys: list[BlockKey] = []
        parent = SIM_ROOT
        for hid in ids:
            mk = (parent, hid)
            k = memo.get(mk)
            if k is None:
                k = memo[mk] = hash_id_key(parent, hid)
            keys.append(k)
            parent = k
        toks = [max(0, min(block_tokens, length - i * block_tokens)) for i in range(len(ids))]
        out.append(SimRequest(r.time_ms, length, keys, toks, r.output_length or 0))
    return out


def ideal_block_hit_rate(requests: Sequence[SimRequest]) -> float:
    """Block hit rate with unlimited capacity: a chained key misses only on its first occurrence."""
    seen: set[BlockKey] = set()
    total = hits = 0
    for req in requests:
        for k in req.keys:
            total += 1
            if k in seen:
                hits += 1
            else:
                seen.add(k)
    return hits / total if total else 0.0


def ideal_token_hit_rate(requests: Sequence[SimRequest]) -> float:
    seen: set[BlockKey] = set()
    total = sum(r.input_length for r in requests)
    hits = 0
    for req in requests:
        for k, t in zip(req.keys, req.block_tokens):
            if k in seen:
                hits += t
            else:
                seen.add(k)
    return hits / total if total else 0.0


@dataclass
class SimPoint:
    device_blocks: int
    policy: str
    write_policy: str = "write_through"
    restore_policy: str = "cost"
    block_hit_rate: float = 0.0
    token_hit_rate: float = 0.0
    num_requests: int = 0
    total_blocks: int = 0
    total_tokens: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    device_hit_blocks: int = 0
    device_hit_tokens: int = 0
    device_block_hit_rate: float = 0.0
    device_token_hit_rate: float = 0.0
    host_blocks: int | None = None
    """Host tier capacity in whole blocks (None: no host tier)."""
    disk_blocks: int | None = None
    """Disk tier capacity in whole frames (None: no disk tier)."""
    host_hit_blocks: int = 0
    """Blocks restored from host (what the engine reports as cached_tokens_by_tier['host'])."""
    host_hit_tokens: int = 0
    host_block_hit_rate: float = 0.0
    host_token_hit_rate: float = 0.0
    disk_hit_blocks: int = 0
    disk_hit_tokens: int = 0
    disk_block_hit_rate: float = 0.0
    disk_token_hit_rate: float = 0.0
    remote_blocks: int | None = None
    """Remote tier capacity in whole frames (None: no remote tier; left out of to_dict)."""
    remote_hit_blocks: int = 0
    remote_hit_tokens: int = 0
    remote_block_hit_rate: float = 0.0
    remote_token_hit_rate: float = 0.0
    cross_instance_hit_blocks: int = 0
    """Remote hits on blocks this instance never stored: another instance's stores (fleet)."""
    cross_instance_hit_tokens: int = 0
    cross_instance_block_hit_rate: float = 0.0
    cross_instance_token_hit_rate: float = 0.0
    stored_blocks: int = 0
    """Blocks past the device prefix that some tier held (TierHierarchy.runs), per request."""
    restored_blocks: int = 0
    """Stored blocks restored (host + disk + remote hits)."""
    recomputed_stored_blocks: int = 0
    """Stored blocks recomputed instead: the cost model's choice, or a load that failed."""
    restore_decisions: dict[str, int] = field(default_factory=dict)
    """Requests per CostModel decision kind: none, recompute, restore, partial."""
    device_evictions: int = 0
    host_evictions: int = 0
    disk_evictions: int = 0
    remote_evictions: int = 0
    promotions: int = 0
    """Disk and remote hits copied into host on restore."""
    demotions: int = 0
    """Host evictions written down to disk and remote (write_back)."""
    load_failures: int = 0
    """Planned restores that found the block gone (a promotion evicted it): recomputed."""
    oversized_requests: int = 0
    """Requests with more blocks than the device pool: counted all-miss, not inserted."""
    block_bytes: int = 0
    host_bytes_read: int = 0
    host_bytes_written: int = 0
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    """Disk traffic counts frames (block_bytes + a 100-byte header)."""
    remote_bytes_read: int = 0
    remote_bytes_written: int = 0
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    prefill_total_s: float = 0.0
    """Prefill of every input token with no cache at all."""
    restore_s: float = 0.0
    """Estimated time of the restores chosen (CostModel.restore_s at the given speeds)."""
    prefill_saved_s: float = 0.0
    """prefill_total_s - (restore time + prefill of the tokens not cached), over all requests."""
    sim_seconds: float = 0.0

    _TIER_FIELDS = (
        "write_policy",
        "restore_policy",
        "device_hit_blocks",
        "device_hit_tokens",
        "device_block_hit_rate",
        "device_token_hit_rate",
        "stored_blocks",
        "restored_blocks",
        "recomputed_stored_blocks",
        "restore_decisions",
        "promotions",
        "demotions",
        "load_failures",
        "restore_s",
    )

    def to_dict(self, tiers: bool = True, remote: bool | None = None) -> dict:
        """The fields as a dict; `tiers=False` leaves out every tier field, `remote=False` the
        remote tier's (default: kept when there is a remote tier)."""
        d = asdict(self)
        if remote is None:
            remote = self.remote_blocks is not None
        drop: tuple[str, ...] = () if tiers else ("host_", "disk_")
        if not (tiers and remote):
            drop += ("remote_", "cross_instance_")
        for k in list(d):
            if k.startswith(drop) or (not tiers and k in self._TIER_FIELDS):
                del d[k]
        return d

    def finish(self) -> SimPoint:
        """Totals and rates from the counts (after they change)."""
        self.hit_blocks = self.device_hit_blocks + self.host_hit_blocks + self.disk_hit_blocks + self.remote_hit_blocks
        self.hit_tokens = self.device_hit_tokens + self.host_hit_tokens + self.disk_hit_tokens + self.remote_hit_tokens
        tb, tt = self.total_blocks or 1, self.total_tokens or 1
        self.block_hit_rate = self.hit_blocks / tb
        self.token_hit_rate = self.hit_tokens / tt
        for name in ("device", "host", "disk", "remote", "cross_instance"):
            setattr(self, f"{name}_block_hit_rate", getattr(self, f"{name}_hit_blocks") / tb)
            setattr(self, f"{name}_token_hit_rate", getattr(self, f"{name}_hit_tokens") / tt)
        return self


def new_remote_tier(config: SimConfig) -> SharedMemoryTier | None:
    """The remote tier `config` describes (None: none), to share between simulators."""
    nbytes = config.remote_cache_bytes
    return SharedMemoryTier(nbytes) if nbytes else None


def _build_tiers(config: SimConfig, remote: SharedMemoryTier | None = None) -> tuple[SimHierarchy | None, CostModel]:
    """The engine's hierarchy over payload-free tiers, and a cost model with fixed speeds.
    `remote`: the remote tier (shared by a fleet's instances), if there is one."""
    from kvtier.tiers.host import HostTier

    sp = config.speeds
    tiers: dict = {}
    if config.host_cache_bytes:
        tiers["host"] = HostTier(config.host_cache_bytes)
    if config.disk_cache_bytes:
        tiers["disk"] = MemoryTier(config.disk_cache_bytes, alloc_bytes=config.disk_alloc_bytes)
    if remote is not None:
        tiers["remote"] = remote
    speeds = {
        "host": (sp.host_bytes_per_s, sp.host_latency_s),
        "disk": (sp.disk_bytes_per_s, sp.disk_latency_s),
        "remote": (sp.remote_bytes_per_s, sp.remote_latency_s),
    }
    cost = CostModel.fixed(
        config.kv_block_bytes,
        config.block_tokens,
        read_bytes_per_s={name: speeds[name][0] for name in tiers},
        latency_s={name: speeds[name][1] for name in tiers},
        prefill_s_per_token=sp.prefill_s_per_token,
        prefill_s_per_token_pair=sp.prefill_s_per_token_pair,
    )
    if not tiers:
        return None, cost
    tier_config = TierConfig(
        cache_write_policy=config.write_policy,
        selective_min_hits=config.selective_min_hits,
        restore_policy=config.restore_policy,
        io_threads=1,
    )
    hierarchy = SimHierarchy(
        tier_config,
        fingerprint=SIM_ROOT,
        block_bytes=config.kv_block_bytes,
        block_size=config.block_tokens,
        cost=cost,
        tiers=tiers,
        executor=SerialExecutor(),
        frame_bytes=config.frame_bytes,
    )
    return hierarchy, cost


class TraceSimulator:
    """One capacity point of the device pool, replaying requests through the engine's own cache
    code: a KVCacheManager (BlockPool + PrefixIndex, its store policy) of `device_blocks` blocks
    and, when the config has tier capacities, the engine's TierHierarchy below it, with each
    restore decided by `plan_restore` (the scheduler's decision).

    Contract: `replay(requests)` runs the requests one at a time in the order given, each alone
    and to completion (every block freed, its stores done) before the next (`handle` runs one
    and says what it got); call it repeatedly to feed more. `result()` gives the counts so far
    (a SimPoint, updated in place by later replays). Between calls no request holds a block, which `check_integrity()` asserts. One
    simulator is not thread-safe; nothing in it reads a clock except `sim_seconds`.

    `config` (a SimConfig) and keyword overrides of its fields: TraceSimulator(8, host_blocks=4).
    `shared_remote`: the remote tier to use, one object shared by the instances of a simulated
    fleet (kvtier/sim/fleet.py; default: a tier of its own when the config has a remote
    capacity); `instance`: this simulator's number in the fleet (from 0), which the shared tier
    records as the writer of what it stores."""

    def __init__(
        self,
        device_blocks: int,
        config: SimConfig | None = None,
        *,
        shared_remote: SharedMemoryTier | None = None,
        instance: int = 0,
        **overrides: Any,
    ) -> None:
        self.config = config = replace(config or SimConfig(), **overrides)
        self.kv = KVCacheManager(device_blocks, config.block_tokens, eviction_policy=config.policy)
        self.index, self.pool = self.kv.index, self.kv.pool
        self.instance = instance
        self.remote = shared_remote if shared_remote is not None else new_remote_tier(config)
        self.tiers, self.cost = _build_tiers(config, self.remote)
        wp = config.write_policy if self.tiers is not None else None
        self.kv.set_store_policy(wp, config.selective_min_hits)
        self._write_through = wp == "write_through"
        bb = config.kv_block_bytes
        host, disk = config.host_cache_bytes, config.disk_cache_bytes
        self.point = SimPoint(
            device_blocks,
            config.policy,
            config.write_policy,
            config.restore_policy,
            host_blocks=host // bb if host else None,
            disk_blocks=disk // config.disk_frame_charge_bytes if disk else None,
            remote_blocks=self.remote.capacity_bytes // config.frame_bytes if self.remote is not None else None,
            block_bytes=bb,
            prefill_s_per_token=config.speeds.prefill_s_per_token,
        )
        self._elapsed = 0.0

    @property
    def host(self) -> Any:
        """The host tier (a HostTier), or None."""
        return None if self.tiers is None else self.tiers.tiers.get("host")

    @property
    def disk(self) -> Any:
        """The disk tier (a MemoryTier), or None."""
        return None if self.tiers is None else self.tiers.tiers.get("disk")

    def replay(self, requests: Iterable[SimRequest]) -> None:
        t0 = time.perf_counter()
        for req in requests:
            self.handle(req)
        self._elapsed += time.perf_counter() - t0

    def handle(self, req: SimRequest) -> RequestOutcome:
        """Run one request on this instance, alone and to completion (the steps in the module's
        docstring); the counts go to `result()`."""
        p = self.point
        keys, toks = req.keys, req.block_tokens
        n = len(keys)
        p.num_requests += 1
        p.total_blocks += n
        p.total_tokens += req.input_length
        prefill = self.cost.prefill
        t_cold = prefill.estimate(req.input_length, 0)
        p.prefill_total_s += t_cold
        if n == 0:
            return RequestOutcome(0, t_cold)
        kv, hier, bs = self.kv, self.tiers, self.config.block_tokens
        if n > kv.num_blocks:
            p.oversized_requests += 1
            return RequestOutcome(0, t_cold)
        remote_prefix = 0
        if self.remote is not None:
            self.remote.writer = self.instance  # what this request stores is this instance's
            remote_prefix = self.remote.contains_prefix(keys)  # as the engine's lookup at arrival
        # match: the device prefix; then what the tiers below hold after it, and the decision
        hits = self.index.match_keys(keys)
        d = len(hits)
        t_cached = sum(toks[:d])
        p.device_hit_blocks += d
        p.device_hit_tokens += t_cached
        match = PrefixMatch([node.block_id for node in hits], keys[:d])
        tokens = range(req.input_length)  # the manager only counts them
        plan = None
        if hier is not None:  # as Scheduler._try_restore
            plan = plan_restore(hier, keys, d, t_cached, req.input_length, remote_prefix=remote_prefix)
            kind = plan.decision.kind
            p.restore_decisions[kind] = p.restore_decisions.get(kind, 0) + 1
            p.stored_blocks += plan.num_stored_blocks
        # admit: reference the device prefix and take blocks (the restore's first, loaded before
        # the rest are taken); device evictions go to the write-back log
        k = plan.num_blocks if plan is not None else 0
        loaded = 0
        if plan is not None and k:
            assert hier is not None
            admitted = kv.allocate_restore(_REQ, tokens, SIM_ROOT, match, keys[d : d + k])
            load_runs = plan.load_runs()
            result = hier.submit_load(keys[d : d + k], load_runs).result()
            loaded = len(result.tensors)
            t_cached += self._count_restored(load_runs, keys, toks, d, loaded)
            admitted = admitted and kv.allocate_more(_REQ, n * bs)
        else:
            admitted = kv.allocate_new(_REQ, tokens, SIM_ROOT, match, (n - d) * bs)
        if not admitted:  # nothing else holds a block: n blocks always fit
            raise AssertionError("simulator: a request that fits the pool was not admitted")
        if plan is not None:
            p.recomputed_stored_blocks += plan.num_stored_blocks - loaded
        self._store(kv.take_blocks_to_store())  # the step's first store: write-back evictions, selective hits
        # compute: register the blocks, then the request ends and frees them (last first)
        computed: list[BlockKey] = []
        parent = keys[d - 1] if d else SIM_ROOT
        for j, bid in enumerate(kv.block_ids(_REQ)[d:]):
            key = keys[d + j]
            if not self.pool.cache_block(bid, key, parent, None, d + j == 0):
                raise AssertionError("simulator: a missing block could not be registered")
            if self._write_through and j >= loaded:  # as KVCacheManager.cache_blocks: restored blocks are below
                computed.append(key)
            parent = key
        kv.free(_REQ)
        if computed and hier is not None:
            hier.store(computed, [PAYLOAD] * len(computed))
        t_restore = plan.decision.t_restore_s if plan is not None else 0.0
        p.restore_s += t_restore
        t_prefill = t_restore + prefill.estimate(req.input_length - t_cached, t_cached)
        p.prefill_saved_s += t_cold - t_prefill
        return RequestOutcome(t_cached, t_prefill)

    def _count_restored(self, plan: list[TierRun], keys: list[BlockKey], toks: list[int], d: int, loaded: int) -> int:
        """Per-tier hits of the first `loaded` blocks of `plan`; returns their tokens."""
        p = self.point
        i, left, total = d, loaded, 0
        for run in plan:
            take = min(run.num_blocks, left)
            if take <= 0:
                break
            t = sum(toks[i : i + take])
            if run.tier == "host":
                p.host_hit_blocks += take
                p.host_hit_tokens += t
            elif run.tier == "disk":
                p.disk_hit_blocks += take
                p.disk_hit_tokens += t
            else:
                p.remote_hit_blocks += take
                p.remote_hit_tokens += t
                remote, me = self.remote, self.instance
                assert remote is not None
                for j in range(i, i + take):  # promotion into host leaves the remote entry in place
                    if remote.stored_by_other(keys[j], me):
                        p.cross_instance_hit_blocks += 1
                        p.cross_instance_hit_tokens += toks[j]
            i += take
            left -= take
            total += t
        p.restored_blocks += loaded
        return total

    def _store(self, todo: list[BlockToStore]) -> None:
        """KVCacheManager.take_blocks_to_store -> TierHierarchy.store, as EngineCore._store_blocks."""
        if todo and self.tiers is not None:
            self.tiers.store([t.key for t in todo], [PAYLOAD] * len(todo), [t.owner for t in todo])

    def result(self) -> SimPoint:
        """The counts so far. A shared remote tier's evictions and bytes are the whole fleet's
        (kvtier/sim/fleet.py counts them once)."""
        p = self.point
        p.device_evictions = self.pool.num_evicted_blocks
        if self.tiers is not None:
            stats = self.tiers.tier_stats()
            for name, s in stats.items():
                setattr(p, f"{name}_evictions", s.evictions)
                setattr(p, f"{name}_bytes_read", s.bytes_read)
                setattr(p, f"{name}_bytes_written", s.bytes_written)
            hs = self.tiers.stats
            p.promotions, p.demotions, p.load_failures = hs.promotions, hs.demotions, hs.load_failures
        p.finish()
        p.sim_seconds = self._elapsed
        return p

    def check_integrity(self) -> None:
        """No request holds a block between requests; pool, index and tiers agree with themselves."""
        self.kv.check_integrity()
        assert not self.kv.has_request(_REQ), "a request holds blocks between requests"
        host = self.host
        if host is not None:
            assert host.usage_bytes <= host.capacity_bytes, "host tier over capacity"
            assert host.usage_bytes == len(host) * self.config.kv_block_bytes, "host bytes miscounted"
        disk = self.disk
        if disk is not None:
            assert disk.usage_bytes <= disk.capacity_bytes, "disk tier over capacity"
            assert disk.usage_bytes == len(disk) * self.config.disk_frame_charge_bytes, "disk bytes miscounted"
        remote = self.remote
        if remote is not None:
            assert remote.usage_bytes <= remote.capacity_bytes, "remote tier over capacity"
            assert remote.usage_bytes == len(remote) * self.config.frame_bytes, "remote bytes miscounted"
        assert not self.pool.eviction_log, "stores left pending between requests"


def simulate(
    requests: Sequence[SimRequest], device_blocks: Sequence[int], config: SimConfig | None = None, **overrides: Any
) -> dict:
    """Every capacity point; the dict the CLI prints with --json. `overrides`: SimConfig fields."""
    config = replace(config or SimConfig(), **overrides)
    points = []
    for cap in device_blocks:
        sim = TraceSimulator(cap, config)
        sim.replay(requests)
        sim.check_integrity()
        points.append(sim.result().to_dict(tiers=config.has_tiers))
    out = trace_summary(requests, config)
    out["points"] = points
    return out


def trace_summary(requests: Sequence[SimRequest], config: SimConfig) -> dict:
    """The head of `simulate`'s dict: the trace's totals, the configuration, the ideal hit rates."""
    sp = config.speeds
    speeds = asdict(sp)
    remote: dict[str, Any] = {}
    remote_bytes = config.remote_cache_bytes
    if remote_bytes:
        remote = {"remote_blocks": remote_bytes // config.frame_bytes, "remote_bytes": remote_bytes}
    else:  # as before there was a remote tier
        del speeds["remote_bytes_per_s"], speeds["remote_latency_s"]
    has_tiers = config.has_tiers
    return {
        "num_requests": len(requests),
        "total_blocks": sum(len(r.keys) for r in requests),
        "total_tokens": sum(r.input_length for r in requests),
        "block_tokens": config.block_tokens,
        "block_bytes": config.kv_block_bytes,
        "policy": config.policy,
        "write_policy": config.write_policy,
        "restore_policy": config.restore_policy,
        "host_blocks": config.host_cache_bytes // config.kv_block_bytes
        if has_tiers and config.host_cache_bytes
        else None,
        "disk_blocks": config.disk_cache_bytes // config.disk_frame_charge_bytes
        if has_tiers and config.disk_cache_bytes
        else None,
        "host_bytes": config.host_cache_bytes,
        "disk_bytes": config.disk_cache_bytes,
        **remote,
        "speeds": speeds,
        "ideal_block_hit_rate": ideal_block_hit_rate(requests),
        "ideal_token_hit_rate": ideal_token_hit_rate(requests),
    }
