"""The engine's own tier hierarchy with no payloads and no threads, for trace replay.

    simulator ──> SimHierarchy (= TierHierarchy: runs, loads, stores, promotion, demotion)
                      │ host:  HostTier            (the engine's class; entries hold a marker)
                      │ disk:  MemoryTier          (DiskTier's LRU index, no files)
                      │ remote: SharedMemoryTier   (Redis: one index a simulated fleet shares)
                      │ I/O:   SerialExecutor      (one worker, run in the caller's thread)
                      v
                  stats: TierStats per tier, HierarchyStats (the engine's counters)

Only what carries no decision is replaced: tensors by a marker, frames by their size, files by
an index, worker threads by a FIFO run in the caller's thread. A job submitted while another
runs (a write-back demotion during a load's promotion) runs after it, as with one I/O thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any

from kvtier.identity import Tenancy
from kvtier.tiers.base import Tier
from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.lru import ByteLRU

PAYLOAD = True
"""What the simulator stores as a block's KV (the hierarchy only needs it to be non-None)."""


class JobResult:
    """The part of a Future the hierarchy's callers use (done, result, exception), without the
    condition variable a thread-safe Future builds for every job."""

    __slots__ = ("_done", "_exc", "_value")

    def __init__(self) -> None:
        self._value: Any = None
        self._exc: BaseException | None = None
        self._done = False

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None) -> Any:
        if not self._done:
            raise RuntimeError("job not run yet: a job submitted by a job runs after it")
        if self._exc is not None:
            raise self._exc
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._exc


class SerialExecutor(Executor):
    """Runs submitted jobs in the caller's thread, one at a time, in submission order: what a
    single I/O worker does when the caller waits for every result before going on. Returns
    JobResult objects (done/result/exception), not Futures."""

    def __init__(self) -> None:
        self._queue: deque[tuple[JobResult, Callable[..., Any], tuple, dict]] = deque()
        self._running = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        job = JobResult()
        self._queue.append((job, fn, args, kwargs))
        if not self._running:  # a job submitted by a running job waits for it, FIFO
            self._running = True
            try:
                while self._queue:
                    res, f, a, kw = self._queue.popleft()
                    try:
                        res._value = f(*a, **kw)
                    except Exception as exc:  # noqa: BLE001 - like a worker thread: the result carries it
                        res._exc = exc
                    res._done = True
            finally:
                self._running = False
        return job

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._queue.clear()


class _Frame:
    """Stands for an encoded block: only its size matters to a tier."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes


class MemoryTier(Tier):
    """DiskTier's index without the files: LRU within a byte capacity; `get` makes an entry the
    most recent, `contains_prefix` does not; a put evicts least recent entries until the new
    frame fits. tests/sim/test_sim_tiers.py holds it to DiskTier on the same operations.

    Single-threaded and infallible: `contains_prefix`, `get` and `put` skip the health gate and
    fault injection of Tier (nothing here fails) and count straight into the stats.

    An entry costs its length in whole `alloc_bytes` units, as DiskTier charges what the file
    system allocates (DiskTier.charged_bytes); `alloc_bytes=1` counts lengths."""

    def __init__(self, capacity_bytes: int, name: str = "disk", alloc_bytes: int = 4096) -> None:
        super().__init__(name)
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if alloc_bytes < 1:
            raise ValueError(f"alloc_bytes must be >= 1, got {alloc_bytes}")
        self._capacity_bytes = int(capacity_bytes)
        self._alloc_bytes = int(alloc_bytes)
        self._index: ByteLRU[bytes, Any] = ByteLRU()  # key -> frame, LRU first

    # -- the hot operations, lean (same results and counters as Tier's, no locks or gate)
    def contains_prefix(self, keys: list[bytes], count: bool = True) -> int:
        n = self._contains_prefix(keys)
        if count:  # as Tier.contains_prefix: a repeated or store-side check is no query
            s = self._stats
            s.lookups += len(keys)
            s.lookup_hits += n
        return n

    def get(self, key: bytes) -> Any:
        data = self._get(key)
        s = self._stats
        s.queries += 1
        if data is not None:
            s.hits += 1
            s.bytes_read += len(data)
        return data

    def put(self, key: bytes, payload: Any, ttl_s: float | None = None) -> bool:
        stored = self._put(key, payload, ttl_s)
        if stored:
            s = self._stats
            s.puts += 1
            s.bytes_written += len(payload)
        return stored

    # -- backend
    def _contains_prefix(self, keys: list[bytes]) -> int:
        return self._index.count_prefix(keys)

    def _get(self, key: bytes) -> Any:
        entry = self._index.touch(key)
        return None if entry is None else entry.value

    def _put(self, key: bytes, payload: Any, ttl_s: float | None) -> bool:
        unit = self._alloc_bytes
        size = -(-len(payload) // unit) * unit
        if size > self._capacity_bytes:
            self._count_error("too_large")
            return False
        self._index.pop(key)
        self._stats.evictions += len(self._index.evict_to(self._capacity_bytes - size))
        self._index.insert(key, payload, size)
        return True

    def _delete(self, key: bytes) -> bool:
        return self._index.pop(key) is not None

    def _keys(self) -> Iterable[bytes]:
        return list(self._index)

    def _clear(self) -> int:
        return len(self._index.clear())

    @property
    def usage_bytes(self) -> int:
        return self._index.usage_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    def __len__(self) -> int:
        return len(self._index)

    # tenants: the simulator has none, the hierarchy still reports each store's owner
    def record_owner(self, owner_id: str, keys: list[bytes]) -> None:
        pass

    def owner_keys(self, owner_id: str, written_before: float | None = None) -> list[bytes]:
        return []

    def forget_owner(self, owner_id: str) -> None:
        pass


class SharedMemoryTier(MemoryTier):
    """The remote tier (Redis) as the simulator sees it: a MemoryTier that every instance of a
    simulated fleet holds the same object of, so a block one instance stores is restorable by
    every other. It remembers which instances wrote each entry since it was last inserted
    (`writer`: the instance whose request runs now, set by the simulator before each request;
    stores run in that request), so a restore can tell a block this instance never stored
    (`stored_by_other`: a cross-instance hit) from one it stored itself. `alloc_bytes=1`:
    Redis counts value lengths."""

    def __init__(self, capacity_bytes: int, name: str = "remote", alloc_bytes: int = 1) -> None:
        super().__init__(capacity_bytes, name=name, alloc_bytes=alloc_bytes)
        self.writer = 0
        self._writers: dict[bytes, int] = {}  # key -> bit mask of the instances that wrote it

    def _put(self, key: bytes, payload: Any, ttl_s: float | None) -> bool:
        fresh = key not in self._index  # an entry evicted since is a new entry: its writers restart
        stored = super()._put(key, payload, ttl_s)
        if stored:
            bit = 1 << self.writer
            self._writers[key] = bit if fresh else self._writers.get(key, 0) | bit
        return stored

    def stored_by_other(self, key: bytes, instance: int) -> bool:
        """`key` is held and `instance` did not write it (another instance did)."""
        return key in self._index and not self._writers.get(key, 0) >> instance & 1


class SimHierarchy(TierHierarchy):
    """TierHierarchy whose disk/remote frames are sizes: `_encode` gives a frame of the codec's
    size, `_decode` gives the marker back. Everything else is the engine's code."""

    def __init__(self, *args: Any, frame_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._frame = _Frame(frame_bytes)

    def _encode(self, kv: Any, key: bytes, owner: Tenancy) -> Any:
        return self._frame

    def _decode(self, tier: Any, data: Any, key: bytes, owner: Tenancy) -> Any | None:
        return PAYLOAD
