"""Replay a Mooncake-format request trace through kvtier's own prefix cache.

Trace format (one JSON object per line): ``timestamp`` (ms), ``input_length``, ``output_length``,
``hash_ids`` (one opaque id per ``block_tokens``-token block of the input, chained: equal ids at
the same position mean an equal prefix).

Semantics, per request in timestamp order (stable for equal timestamps):

1. Keys are chained: ``key_0 = hash_id_key(root_key(b"sim"), id_0)``,
   ``key_i = hash_id_key(key_{i-1}, id_i)``.
2. The hit is the longest prefix of the request's blocks held by some tier: first the device
   prefix (``PrefixIndex.match_keys``), then it continues block by block through the host tier,
   then the disk tier (a block counts in the fastest tier holding it; the prefix stops at the
   first block in no tier). Tiers are exclusive: a block restored from host/disk moves to device.
3. Device hits are referenced (``BlockPool.ref`` + ``record_hit``); every other block is
   allocated and registered with ``BlockPool.cache_block``; then all are freed (last first), so
   they stay cached and evictable under the chosen policy (LRU/LFU, leaves only).
4. A device eviction demotes the block's key to the host tier (LRU, capacity in blocks), a host
   eviction demotes it to disk (LRU); a disk eviction drops it.
5. A request with more blocks than the device pool cannot be held at once: it counts as all-miss
   and is not inserted (nor does it touch any tier).

Hit rates: block = hit blocks / blocks; token = hit tokens / input tokens, block ``i`` carrying
``min(block_tokens, input_length - i * block_tokens)`` tokens (the last block is usually partial).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

from kvtier.kvcache.block_pool import BlockPool
from kvtier.kvcache.keys import BlockKey, hash_id_key, root_key
from kvtier.kvcache.prefix_index import PrefixIndex

DEFAULT_BYTES_PER_TOKEN = 12 * 1024
"""KV bytes per token of the reference model (12 KiB)."""
DEFAULT_PREFILL_S_PER_TOKEN = 0.78e-3
"""Prefill seconds per token measured on the reference model."""
SIM_ROOT = root_key(b"sim")


@dataclass(slots=True)
class SimRequest:
    timestamp: float
    input_length: int
    keys: list[BlockKey]
    block_tokens: list[int]
    """Tokens of each block (the last one usually partial)."""


def load_trace(path: str | Path | Iterable[dict], block_tokens: int = 512,
               limit: int | None = None) -> list[SimRequest]:
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


class _LRUTier:
    """Keys only, LRU, capacity in blocks."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"tier capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.entries: OrderedDict[BlockKey, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def pop(self, key: BlockKey) -> None:
        del self.entries[key]

    def put(self, key: BlockKey) -> list[BlockKey]:
        """Insert (most recent); returns the keys pushed out."""
        e = self.entries
        e[key] = None
        e.move_to_end(key)
        out = []
        while len(e) > self.capacity:
            out.append(e.popitem(last=False)[0])
        return out


@dataclass
class SimPoint:
    device_blocks: int
    policy: str
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
    disk_blocks: int | None = None
    host_hit_blocks: int = 0
    host_hit_tokens: int = 0
    host_block_hit_rate: float = 0.0
    host_token_hit_rate: float = 0.0
    disk_hit_blocks: int = 0
    disk_hit_tokens: int = 0
    disk_block_hit_rate: float = 0.0
    disk_token_hit_rate: float = 0.0
    device_evictions: int = 0
    host_evictions: int = 0
    disk_evictions: int = 0
    oversized_requests: int = 0
    """Requests with more blocks than the device pool: counted all-miss, not inserted."""
    block_bytes: int = 0
    bytes_device_to_host: int = 0
    bytes_host_to_disk: int = 0
    bytes_host_to_device: int = 0
    bytes_disk_to_device: int = 0
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    prefill_saved_s: float = 0.0
    """hit tokens (all tiers) x prefill_s_per_token: prefill time not spent (restore cost ignored)."""
    prefill_total_s: float = 0.0
    """input tokens x prefill_s_per_token: prefill with no cache at all."""
    sim_seconds: float = 0.0

    def to_dict(self, tiers: bool = True) -> dict:
        d = asdict(self)
        if not tiers:
            for k in list(d):
                if k.startswith(("host_", "disk_", "bytes_")) or k in ("device_hit_blocks", "device_hit_tokens",
                                                                      "device_block_hit_rate",
                                                                      "device_token_hit_rate"):
                    del d[k]
        return d


class TraceSimulator:
    """One capacity point: a BlockPool of `device_blocks` with its PrefixIndex, plus optional
    host/disk key tiers. Call `replay(requests)` (repeatedly, to feed more), then `result()`."""

    def __init__(self, device_blocks: int, policy: str = "lru", host_blocks: int | None = None,
                 disk_blocks: int | None = None, block_bytes: int = 512 * DEFAULT_BYTES_PER_TOKEN,
                 prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN) -> None:
        self.index = PrefixIndex(policy)
        self.pool = BlockPool(device_blocks, self.index)
        self.pool.eviction_log = []
        self.host = _LRUTier(host_blocks) if host_blocks else None
        self.disk = _LRUTier(disk_blocks) if disk_blocks else None
        self.point = SimPoint(device_blocks, policy, host_blocks=host_blocks, disk_blocks=disk_blocks,
                              block_bytes=block_bytes, prefill_s_per_token=prefill_s_per_token)
        self._elapsed = 0.0

    def _demote(self, keys: list[BlockKey]) -> None:
        p = self.point
        host, disk = self.host, self.disk
        for key in keys:
            if host is not None:
                p.bytes_device_to_host += p.block_bytes
                pushed = host.put(key)
            else:
                pushed = [key]
            for k2 in pushed:
                if host is not None:
                    p.host_evictions += 1
                if disk is not None:
                    p.bytes_host_to_disk += p.block_bytes
                    p.disk_evictions += len(disk.put(k2))

    def replay(self, requests: Iterable[SimRequest]) -> None:
        t0 = time.perf_counter()
        p = self.point
        pool, index = self.pool, self.index
        log = pool.eviction_log
        host, disk = self.host, self.disk
        cap = pool.num_blocks
        for req in requests:
            keys, toks = req.keys, req.block_tokens
            n = len(keys)
            p.num_requests += 1
            p.total_blocks += n
            p.total_tokens += req.input_length
            if n == 0:
                continue
            if n > cap:
                p.oversized_requests += 1
                continue
            # 1. device prefix
            hit_nodes = index.match_keys(keys)
            d = len(hit_nodes)
            # 2. continue through host, then disk
            i = d
            n_host = n_disk = 0
            t_host = t_disk = 0
            while i < n:
                k = keys[i]
                if host is not None and k in host:
                    host.pop(k)
                    n_host += 1
                    t_host += toks[i]
                elif disk is not None and k in disk:
                    disk.pop(k)
                    n_disk += 1
                    t_disk += toks[i]
                else:
                    break
                i += 1
            t_dev = sum(toks[:d])
            p.device_hit_blocks += d
            p.device_hit_tokens += t_dev
            p.host_hit_blocks += n_host
            p.host_hit_tokens += t_host
            p.disk_hit_blocks += n_disk
            p.disk_hit_tokens += t_disk
            p.bytes_host_to_device += n_host * p.block_bytes
            p.bytes_disk_to_device += n_disk * p.block_bytes
            # 3. reference the device hits, allocate + register the rest, free all
            ids = []
            for node in hit_nodes:
                pool.ref(node.block_id)
                index.record_hit(node)
                ids.append(node.block_id)
            new = pool.allocate(n - d)
            parent = keys[d - 1] if d else SIM_ROOT
            for j, bid in enumerate(new):
                k = keys[d + j]
                ok = pool.cache_block(bid, k, parent, None, d + j == 0)
                assert ok, "simulator: a missing block could not be registered"
                parent = k
            ids.extend(new)
            pool.free_blocks(ids)
            if log:
                p.device_evictions += len(log)
                if host is not None or disk is not None:
                    self._demote([e[1] for e in log])
                log.clear()
        self._elapsed += time.perf_counter() - t0

    def result(self) -> SimPoint:
        p = self.point
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
        p.prefill_saved_s = p.hit_tokens * p.prefill_s_per_token
        p.prefill_total_s = p.total_tokens * p.prefill_s_per_token
        p.sim_seconds = self._elapsed
        return p


def simulate(requests: Sequence[SimRequest], device_blocks: Sequence[int], policy: str = "lru",
             host_blocks: int | None = None, disk_blocks: int | None = None, block_tokens: int = 512,
             block_bytes: int | None = None,
             prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN) -> dict:
    """Every capacity point; the dict the CLI prints with --json."""
    if block_bytes is None:
        block_bytes = block_tokens * DEFAULT_BYTES_PER_TOKEN
    tiers = bool(host_blocks or disk_blocks)
    points = []
    for cap in device_blocks:
        sim = TraceSimulator(cap, policy, host_blocks, disk_blocks, block_bytes, prefill_s_per_token)
        sim.replay(requests)
        points.append(sim.result().to_dict(tiers=tiers))
    return {
        "num_requests": len(requests),
        "total_blocks": sum(len(r.keys) for r in requests),
        "total_tokens": sum(r.input_length for r in requests),
        "block_tokens": block_tokens,
        "policy": policy,
        "host_blocks": host_blocks,
        "disk_blocks": disk_blocks,
        "ideal_block_hit_rate": ideal_block_hit_rate(requests),
        "ideal_token_hit_rate": ideal_token_hit_rate(requests),
        "points": points,
    }
