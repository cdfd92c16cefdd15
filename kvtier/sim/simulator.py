"""Replay a Mooncake-format request trace through kvtier's own cache code, with no model.

Trace format (one JSON object per line): ``timestamp`` (ms), ``input_length``, ``output_length``,
``hash_ids`` (one opaque id per ``block_tokens``-token block of the input, chained: equal ids at
the same position mean an equal prefix).

What runs is the engine's code: the device pool is ``BlockPool`` + ``PrefixIndex`` (LRU/LFU,
leaves first), the tiers below are the engine's ``TierHierarchy`` with its ``HostTier``
(sim/tiers.py: payload-free entries, a file-less disk index, loads and stores run in order
in this thread), and each restore is decided by ``CostModel.decide`` with fixed speeds. Per
request, in timestamp order (stable for equal timestamps), the steps the engine takes for one
request that arrives alone (kvtier/sched/scheduler.py ``_admit``/``_try_restore``,
kvtier/engine/core.py ``step``)::

    keys      key_0 = hash_id_key(root_key(b"sim"), id_0), key_i = hash_id_key(key_{i-1}, id_i)
    match     d = device prefix (PrefixIndex.match_keys); TierHierarchy.touch refreshes their
              host entries
    runs      TierHierarchy.runs(keys, d): the stored blocks after it, fastest tier first
    decide    CostModel.decide(...) -> restore k of them ('always': all of them)
    admit     reference the d hits; take k blocks; load them (promotes disk hits into host);
              take the other n - d - k blocks (device evictions go to the write-back log)
    store     write_back: evicted blocks -> host (host evictions demote to disk);
              selective: blocks on their Nth hit
    compute   register the n - d blocks; free all (last first): cached and evictable
    store     write_through: the blocks just computed (not those restored) -> every tier

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

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.cost.model import CostModel, TierRun, take_runs
from kvtier.kvcache.block_pool import BlockPool
from kvtier.kvcache.keys import BlockKey, hash_id_key, root_key
from kvtier.kvcache.prefix_index import CachedBlock, PrefixIndex
from kvtier.sim.config import DEFAULT_PREFILL_S_PER_TOKEN, SimConfig
from kvtier.sim.tiers import PAYLOAD, MemoryTier, SerialExecutor, SimHierarchy
from kvtier.tiers.hierarchy import TierConfig

SIM_ROOT = root_key(b"sim")


@dataclass(slots=True)
class SimRequest:
    timestamp: float
    input_length: int
    keys: list[BlockKey]
    block_tokens: list[int]
    """Tokens of each block (the last one usually partial)."""


def load_trace(
    path: str | Path | Iterable[dict], block_tokens: int = 512, limit: int | None = None
) -> list[SimRequest]:
    """Parse a trace (a path or an iterable of dicts), sort it by timestamp, chain the keys."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if isinstance(path, (str, Path)):
        records = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON: {e}") from None
    else:
        records = list(path)
    if limit is not None:
        records = records[:limit]
    records.sort(key=lambda r: r.get("timestamp", 0))  # stable: equal timestamps keep file order
    memo: dict[tuple[BlockKey, int], BlockKey] = {}
    out: list[SimRequest] = []
    for r in records:
        ids = r["hash_ids"]
        length = int(r.get("input_length", len(ids) * block_tokens))
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
        out.append(SimRequest(float(r.get("timestamp", 0)), length, keys, toks))
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
    stored_blocks: int = 0
    """Blocks past the device prefix that some tier held (TierHierarchy.runs), per request."""
    restored_blocks: int = 0
    """Stored blocks restored (host + disk hits)."""
    recomputed_stored_blocks: int = 0
    """Stored blocks recomputed instead: the cost model's choice, or a load that failed."""
    restore_decisions: dict[str, int] = field(default_factory=dict)
    """Requests per CostModel decision kind: none, recompute, restore, partial."""
    device_evictions: int = 0
    host_evictions: int = 0
    disk_evictions: int = 0
    promotions: int = 0
    """Disk hits copied into host on restore."""
    demotions: int = 0
    """Host evictions written down to disk (write_back)."""
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

    def to_dict(self, tiers: bool = True) -> dict:
        d = asdict(self)
        if not tiers:
            for k in list(d):
                if k.startswith(("host_", "disk_")) or k in self._TIER_FIELDS:
                    del d[k]
        return d


def _build_tiers(config: SimConfig) -> tuple[SimHierarchy | None, CostModel]:
    """The engine's hierarchy over payload-free tiers, and a cost model with fixed speeds."""
    from kvtier.tiers.host import HostTier

    sp = config.speeds
    tiers: dict = {}
    if config.host_cache_bytes:
        tiers["host"] = HostTier(config.host_cache_bytes)
    if config.disk_cache_bytes:
        tiers["disk"] = MemoryTier(config.disk_cache_bytes)
    speeds = {"host": (sp.host_bytes_per_s, sp.host_latency_s), "disk": (sp.disk_bytes_per_s, sp.disk_latency_s)}
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
    """One capacity point: a BlockPool of `device_blocks` with its PrefixIndex and, when the
    config has tier capacities, the engine's TierHierarchy below it. Call `replay(requests)`
    (repeatedly, to feed more), then `result()`.

    `config` (a SimConfig) and keyword overrides of its fields: TraceSimulator(8, host_blocks=4)."""

    def __init__(self, device_blocks: int, config: SimConfig | None = None, **overrides: Any) -> None:
        self.config = config = replace(config or SimConfig(), **overrides)
        self.index = PrefixIndex(config.policy)
        self.pool = BlockPool(device_blocks, self.index)
        self.tiers, self.cost = _build_tiers(config)
        wp = config.write_policy if self.tiers is not None else None
        self._write_through = wp == "write_through"
        self._selective = wp == "selective"
        self._restore_all = config.restore_policy == "always"
        if wp == "write_back":
            self.pool.eviction_log = []  # KVCacheManager.set_store_policy("write_back") does the same
        self._to_store: list[BlockKey] = []
        """Selective: blocks on their Nth hit, written down before the request computes."""
        bb = config.kv_block_bytes
        host, disk = config.host_cache_bytes, config.disk_cache_bytes
        self.point = SimPoint(
            device_blocks,
            config.policy,
            config.write_policy,
            config.restore_policy,
            host_blocks=host // bb if host else None,
            disk_blocks=disk // config.frame_bytes if disk else None,
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
            self._replay_one(req)
        self._elapsed += time.perf_counter() - t0

    def _replay_one(self, req: SimRequest) -> None:
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
            return
        pool, index, hier = self.pool, self.index, self.tiers
        if n > pool.num_blocks:
            p.oversized_requests += 1
            return
        # match: the device prefix; then what the tiers below hold after it, and the decision
        hits = index.match_keys(keys)
        d = len(hits)
        t_cached = sum(toks[:d])
        p.device_hit_blocks += d
        p.device_hit_tokens += t_cached
        k = 0
        t_restore = 0.0
        if hier is not None:
            if d:
                hier.touch(keys[:d])  # as Scheduler._try_restore: device hits refresh host entries
            runs = hier.runs(keys, d)
            decision = self.cost.decide(t_cached, runs, req.input_length, restore_all=self._restore_all)
            p.restore_decisions[decision.kind] = p.restore_decisions.get(decision.kind, 0) + 1
            p.stored_blocks += sum(r.num_blocks for r in runs)
            k, t_restore = decision.num_blocks, decision.t_restore_s
        # admit: reference the device prefix (KVCacheManager.allocate_new), then take blocks
        ids = [node.block_id for node in hits]
        for b in ids:
            pool.ref(b)
        self._record_hits(hits)
        loaded = 0
        if k:
            new = pool.allocate(k)  # allocate_restore
            plan = take_runs(runs, k)
            result = hier.submit_load(keys[d : d + k], plan).result()
            loaded = len(result.tensors)
            t_cached += self._count_restored(plan, toks, d, loaded)
            new += pool.allocate(n - d - k)  # the rest, once the load is in (allocate_more)
        else:
            new = pool.allocate(n - d)
        if hier is not None:
            p.recomputed_stored_blocks += sum(r.num_blocks for r in runs) - loaded
            self._store_pending()  # the step's first store: write-back evictions, selective hits
        # compute: register the blocks, then the request ends and frees them (last first)
        computed: list[BlockKey] = []
        parent = keys[d - 1] if d else SIM_ROOT
        for j, bid in enumerate(new):
            key = keys[d + j]
            if not pool.cache_block(bid, key, parent, None, d + j == 0):
                raise AssertionError("simulator: a missing block could not be registered")
            if self._write_through and j >= loaded:  # restored blocks are already below
                computed.append(key)
            parent = key
        ids.extend(new)
        pool.free_blocks(ids)
        if computed:
            hier.store(computed, [PAYLOAD] * len(computed))
        p.restore_s += t_restore
        p.prefill_saved_s += t_cold - t_restore - prefill.estimate(req.input_length - t_cached, t_cached)

    def _record_hits(self, hits: list[CachedBlock]) -> None:
        record = self.index.record_hit
        for node in hits:
            record(node)
            if self._selective and node.hits == self.config.selective_min_hits:
                self._to_store.append(node.key)

    def _count_restored(self, plan: list[TierRun], toks: list[int], d: int, loaded: int) -> int:
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
            else:
                p.disk_hit_blocks += take
                p.disk_hit_tokens += t
            i += take
            left -= take
            total += t
        p.restored_blocks += loaded
        return total

    def _store_pending(self) -> None:
        """KVCacheManager.take_blocks_to_store + TierHierarchy.store, as EngineCore._store_blocks."""
        todo, self._to_store = self._to_store, []
        log = self.pool.eviction_log
        if log:
            todo.extend(key for _, key, _ in log)
            log.clear()
        if todo:
            self.tiers.store(todo, [PAYLOAD] * len(todo))

    def result(self) -> SimPoint:
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
        p.hit_blocks = p.device_hit_blocks + p.host_hit_blocks + p.disk_hit_blocks
        p.hit_tokens = p.device_hit_tokens + p.host_hit_tokens + p.disk_hit_tokens
        tb, tt = p.total_blocks or 1, p.total_tokens or 1
        p.block_hit_rate = p.hit_blocks / tb
        p.token_hit_rate = p.hit_tokens / tt
        p.device_block_hit_rate = p.device_hit_blocks / tb
        p.device_token_hit_rate = p.device_hit_tokens / tt
        p.host_block_hit_rate = p.host_hit_blocks / tb
        p.host_token_hit_rate = p.host_hit_tokens / tt
        p.disk_block_hit_rate = p.disk_hit_blocks / tb
        p.disk_token_hit_rate = p.disk_hit_tokens / tt
        p.sim_seconds = self._elapsed
        return p

    def check_integrity(self) -> None:
        """No request holds a block between requests; pool, index and tiers agree with themselves."""
        self.pool.check_integrity(expected_refs={})
        host = self.host
        if host is not None:
            assert host.usage_bytes <= host.capacity_bytes, "host tier over capacity"
            assert host.usage_bytes == len(host) * self.config.kv_block_bytes, "host bytes miscounted"
        disk = self.disk
        if disk is not None:
            assert disk.usage_bytes <= disk.capacity_bytes, "disk tier over capacity"
            assert disk.usage_bytes == len(disk) * self.config.frame_bytes, "disk bytes miscounted"
        assert not self._to_store and not self.pool.eviction_log, "stores left pending between requests"


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
    sp = config.speeds
    return {
        "num_requests": len(requests),
        "total_blocks": sum(len(r.keys) for r in requests),
        "total_tokens": sum(r.input_length for r in requests),
        "block_tokens": config.block_tokens,
        "block_bytes": config.kv_block_bytes,
        "policy": config.policy,
        "write_policy": config.write_policy,
        "restore_policy": config.restore_policy,
        "host_blocks": points[0]["host_blocks"] if points and config.has_tiers else None,
        "disk_blocks": points[0]["disk_blocks"] if points and config.has_tiers else None,
        "host_bytes": config.host_cache_bytes,
        "disk_bytes": config.disk_cache_bytes,
        "speeds": asdict(sp),
        "ideal_block_hit_rate": ideal_block_hit_rate(requests),
        "ideal_token_hit_rate": ideal_token_hit_rate(requests),
        "points": points,
    }
