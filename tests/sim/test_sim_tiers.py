"""The simulator's stand-ins for what carries no decision: MemoryTier behaves as DiskTier's
index does, SerialExecutor runs jobs as one I/O worker would, SimHierarchy is the engine's
TierHierarchy with sizes for frames."""

from __future__ import annotations

import random

import pytest

from kvtier.cost.model import CostModel, TierRun
from kvtier.sim.tiers import PAYLOAD, MemoryTier, SerialExecutor, SimHierarchy
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.hierarchy import TierConfig
from kvtier.tiers.host import HostTier


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_memory_tier_evicts_and_orders_like_the_disk_tier(tmp_path, seed):
    rng = random.Random(seed)
    disk = DiskTier(tmp_path / "d", 1, fingerprint=bytes(16))
    unit = disk.charged_bytes(1)  # the file system's allocation unit: both charge whole units
    disk.close()
    disk = DiskTier(tmp_path / "d", 10 * unit, fingerprint=bytes(16))
    mem = MemoryTier(10 * unit, alloc_bytes=unit)
    for step in range(600):
        op, k = rng.random(), key(rng.randrange(40))
        if op < 0.45:
            size = rng.choice([90, unit - 1, unit, unit + 1, 3 * unit, 11 * unit])  # 11 units: too large for either
            payload = bytes(size)
            assert mem.put(k, payload) == disk.put(k, payload), step
        elif op < 0.75:
            got_m, got_d = mem.get(k), disk.get(k)
            assert (got_m is None) == (got_d is None) and (got_m is None or len(got_m) == len(got_d)), step
        elif op < 0.9:
            keys = [key(rng.randrange(40)) for _ in range(rng.randint(1, 4))]
            assert mem.contains_prefix(keys) == disk.contains_prefix(keys), step
        else:
            assert mem.delete(k) == disk.delete(k), step
        assert list(mem.keys()) == list(disk.keys()), step  # same entries, same LRU order
        assert mem.usage_bytes == disk.usage_bytes, step
    sm, sd = mem.stats, disk.stats
    assert (sm.evictions, sm.puts, sm.hits, sm.bytes_read, sm.bytes_written, sm.lookup_hits) == (
        sd.evictions,
        sd.puts,
        sd.hits,
        sd.bytes_read,
        sd.bytes_written,
        sd.lookup_hits,
    )
    disk.close()


def test_serial_executor_runs_a_job_submitted_by_a_job_after_it():
    ex = SerialExecutor()
    order: list[str] = []

    def outer() -> str:
        inner = ex.submit(order.append, "inner")
        order.append("outer")
        assert not inner.done()  # queued behind the running job, as on one worker thread
        return "ok"

    res = ex.submit(outer)
    assert res.done() and res.result() == "ok" and order == ["outer", "inner"]
    failed = ex.submit(lambda: 1 / 0)
    assert isinstance(failed.exception(), ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
        failed.result()


def _hierarchy(write_policy: str, host_blocks: int, disk_blocks: int) -> SimHierarchy:
    tiers = {"host": HostTier(host_blocks * 100), "disk": MemoryTier(disk_blocks * 200, alloc_bytes=1)}
    cost = CostModel(list(tiers), 100, 4)
    return SimHierarchy(
        TierConfig(cache_write_policy=write_policy, io_threads=1),
        fingerprint=bytes(16),
        block_bytes=100,
        block_size=4,
        cost=cost,
        tiers=tiers,
        executor=SerialExecutor(),
        frame_bytes=200,
    )


def test_sim_hierarchy_is_the_engines_write_through_and_promotion():
    h = _hierarchy("write_through", host_blocks=2, disk_blocks=10)
    ks = [key(i) for i in range(4)]
    h.store(ks, [PAYLOAD] * 4)
    host, disk = h.tiers["host"], h.tiers["disk"]
    assert list(host.keys()) == ks[1::-1]  # tail stored first: the head is most recent, and stays
    assert list(disk.keys()) == ks and disk.usage_bytes == 800
    assert h.runs(ks, 0) == [TierRun("host", 2), TierRun("disk", 2)]
    res = h.submit_load(ks[2:], [TierRun("disk", 2)]).result()
    assert res.per_tier == {"disk": 2} and res.tensors == [PAYLOAD, PAYLOAD]
    assert list(host.keys()) == [ks[3], ks[2]] and h.stats.promotions == 2
    assert h.cost.tiers["disk"].read_bytes_per_s.count == 1  # the engine's class measures, unless frozen


def test_sim_hierarchy_write_back_demotes_host_evictions():
    h = _hierarchy("write_back", host_blocks=2, disk_blocks=10)
    ks = [key(i) for i in range(3)]
    h.store(ks, [PAYLOAD] * 3)
    assert list(h.tiers["host"].keys()) == ks[1::-1] and list(h.tiers["disk"].keys()) == [ks[2]]
    assert h.stats.demotions == 1
