"""Trace simulator: known hit counts on hand-made traces, tiers, invariants, the CLI contract."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cost.model import CostModel, TierRun, take_runs
from kvtier.sim import SimConfig, TierSpeeds, TraceSimulator, ideal_block_hit_rate, load_trace, simulate

REPO = Path(__file__).resolve().parents[2]


def rec(ids, length=None, ts=0, bt=4):
    return {
        "timestamp": ts,
        "input_length": len(ids) * bt if length is None else length,
        "output_length": 1,
        "hash_ids": list(ids),
    }


def run(records, cap, policy="lru", bt=4, **kw):
    sim = TraceSimulator(cap, policy=policy, block_tokens=bt, block_bytes=kw.pop("block_bytes", 100), **kw)
    sim.replay(load_trace(records, block_tokens=bt))
    return sim, sim.result()


# (ids, input_length) with block_tokens 4; the last block of r1 and r2 is partial
TINY = [rec([1, 2], 8, ts=0), rec([1, 2, 3], 10, ts=1), rec([1, 5], 6, ts=2)]


def test_tiny_trace_unlimited_capacity():
    sim, p = run(TINY, 10)
    assert (p.total_blocks, p.hit_blocks) == (7, 3)
    assert (p.total_tokens, p.hit_tokens) == (24, 12)  # r1 hits 8 tokens, r2 hits 4
    assert p.block_hit_rate == pytest.approx(3 / 7) and p.token_hit_rate == pytest.approx(0.5)
    assert p.device_evictions == 0
    assert ideal_block_hit_rate(load_trace(TINY, 4)) == pytest.approx(3 / 7)
    sim.check_integrity()
    assert len(sim.index) == 4


def test_timestamp_order_and_chained_keys():
    # out of file order: the [1, 2] record comes first in time; [9, 2] shares no prefix with it
    recs = [rec([1, 2], ts=5), rec([1, 2], ts=0), rec([9, 2], ts=7)]
    reqs = load_trace(recs, 4)
    assert [r.timestamp for r in reqs] == [0, 5, 7]
    assert reqs[0].keys == reqs[1].keys and reqs[2].keys[1] != reqs[0].keys[1]
    _, p = run(recs, 10)
    assert p.hit_blocks == 2


def test_eviction_at_small_capacity():
    # cap 3: r2 [1,5] hits 1 and must evict the LRU leaf (key of 1,2,3); r3 [1,2,3] then hits 2
    recs = TINY + [rec([1, 2, 3], 12, ts=3)]
    sim, p = run(recs, 3)
    assert p.hit_blocks == 3 + 2
    assert p.device_evictions == 2  # r2 evicts (1,2,3), r3 evicts (1,5)
    sim.check_integrity()
    _, big = run(recs, 100)
    assert big.hit_blocks == 3 + 3


def test_lru_vs_lfu():
    # cap 2, single-block requests A A A B C A: at C, LRU evicts A (freed earlier), LFU evicts B (no hits)
    recs = [rec([x], ts=i) for i, x in enumerate([1, 1, 1, 2, 3, 1])]
    sim_lru, lru = run(recs, 2, "lru")
    sim_lfu, lfu = run(recs, 2, "lfu")
    assert lru.hit_blocks == 2 and lfu.hit_blocks == 3
    sim_lru.pool.check_integrity(expected_refs={})
    sim_lfu.pool.check_integrity(expected_refs={})


def test_oversized_request_is_all_miss_and_not_inserted():
    sim, p = run([rec([1, 2, 3]), rec([1, 2, 3], ts=1)], 2)
    assert p.oversized_requests == 2 and p.hit_blocks == 0 and p.block_hit_rate == 0
    assert len(sim.index) == 0
    sim.check_integrity()


def test_host_tier_is_written_through_and_keeps_what_it_restores():
    # device 1, host 2: A, B, A -> A went to host when computed, the device lost it to B
    sim, p = run([rec([1], ts=0), rec([2], ts=1), rec([1], ts=2)], 1, host_blocks=2)
    assert (p.device_hit_blocks, p.host_hit_blocks, p.disk_hit_blocks) == (0, 1, 0)
    assert p.host_hit_tokens == 4 and p.host_token_hit_rate == pytest.approx(4 / 12)
    assert p.host_bytes_written == 200 and p.host_bytes_read == 100  # A and B written, A read
    assert p.block_hit_rate == pytest.approx(1 / 3)
    assert p.restore_decisions == {"none": 2, "restore": 1}
    keys = load_trace([rec([1])], 4)[0].keys
    assert keys[0] in sim.host  # inclusive: a restore copies, the host keeps its entry
    sim.check_integrity()


def test_prefix_continues_from_device_through_host_then_disk():
    # device 4, host 5, disk 10 (write-through: every computed block goes to both).
    # r0 [1,2,3]; r1 [1,7,8,9] hits 1 on device and evicts 3 and 2 from the device, and host
    # (LRU, stores tail first) drops 3 for 7. r2 [1,2,3,4] (last block partial): 1 on device,
    # 2 in host, 3 on disk only, 4 nowhere; the disk hit is promoted into host.
    recs = [rec([1, 2, 3], ts=0), rec([1, 7, 8, 9], ts=1), rec([1, 2, 3, 4], 14, ts=2)]
    sim, p = run(recs, 4, host_blocks=5, disk_blocks=10)
    assert (p.device_hit_blocks, p.host_hit_blocks, p.disk_hit_blocks) == (1 + 1, 1, 1)
    assert p.hit_tokens == 4 + 12 and p.total_tokens == 12 + 16 + 14
    assert p.restore_decisions == {"none": 2, "restore": 1}
    assert p.host_bytes_read == 100 and p.disk_bytes_read == 200  # a disk frame: block + 100-byte header
    assert p.promotions == 1 and p.disk_bytes_written == 200 * 7  # 1 2 3 7 8 9 4
    assert len(sim.disk) == 7 and len(sim.host) == 5
    sim.check_integrity()


def test_write_back_demotes_host_evictions_to_disk_in_order():
    # device 1, host 1, disk 5, write-back: A B C A. A reaches host when the device evicts it,
    # disk when host evicts it. The last A restores from disk; its promotion into host pushes
    # B down, then the device's eviction of C pushes A down again (already there: no write).
    recs = [rec([x], ts=i) for i, x in enumerate([1, 2, 3, 1])]
    sim, p = run(recs, 1, host_blocks=1, disk_blocks=5, write_policy="write_back")
    assert (p.device_hit_blocks, p.host_hit_blocks, p.disk_hit_blocks) == (0, 0, 1)
    assert p.demotions == 3 and p.promotions == 1
    assert p.disk_bytes_written == 2 * 200  # A, then B
    k = {x: load_trace([rec([x])], 4)[0].keys[0] for x in (1, 2, 3)}
    assert list(sim.host.keys()) == [k[3]] and list(sim.disk.keys()) == [k[1], k[2]]
    sim.check_integrity()


def test_selective_writes_a_block_down_on_its_second_hit():
    recs = [rec([1, 2], ts=i) for i in range(3)]
    sim, p = run(recs, 4, host_blocks=10, write_policy="selective")
    assert p.device_hit_blocks == 4 and p.host_bytes_written == 200  # written at r2, the 2nd hit
    assert len(sim.host) == 2
    sim.check_integrity()


# -- the restore-or-recompute decision at given speeds ---------------------------------------

SLOW_DISK = TierSpeeds(disk_bytes_per_s=100.0, disk_latency_s=0.0, prefill_s_per_token=1e-3)
"""A 100-byte block takes 1 s to read and 4 ms to recompute."""


def test_cost_model_recomputes_rather_than_read_a_slow_disk():
    recs = [rec([1], ts=0), rec([2], ts=1), rec([1], ts=2)]
    _, p = run(recs, 1, disk_blocks=10, speeds=SLOW_DISK)
    assert p.restore_decisions == {"none": 2, "recompute": 1}
    assert (p.disk_hit_blocks, p.stored_blocks, p.recomputed_stored_blocks) == (0, 1, 1)
    assert p.disk_bytes_read == 0 and p.restore_s == 0
    _, q = run(recs, 1, disk_blocks=10, speeds=SLOW_DISK, restore_policy="always")
    assert q.restore_decisions == {"none": 2, "restore": 1} and q.disk_hit_blocks == 1
    assert q.restore_s == pytest.approx(1.0)  # and it shows: time saved is negative
    assert q.prefill_saved_s == pytest.approx(4e-3 - 1.0)


def test_partial_restore_takes_host_and_recomputes_past_a_slow_disk():
    recs = [rec([1, 2, 3], ts=0), rec([1, 7, 8, 9], ts=1), rec([1, 2, 3, 4], 14, ts=2)]
    _, p = run(recs, 4, host_blocks=5, disk_blocks=10, speeds=SLOW_DISK)
    assert p.restore_decisions == {"none": 2, "partial": 1}
    assert (p.host_hit_blocks, p.disk_hit_blocks, p.recomputed_stored_blocks) == (1, 0, 1)


def test_prefill_saved_is_net_of_restore_time():
    speeds = TierSpeeds(host_bytes_per_s=1e5, host_latency_s=1e-3, prefill_s_per_token=1e-3)
    recs = [rec([1, 2], ts=0), rec([3, 4], ts=1), rec([1, 2], ts=2), rec([1, 2], ts=3)]
    _, p = run(recs, 2, host_blocks=10, speeds=speeds)
    # r2 restores 2 blocks from host (1 ms + 200 B / 100 kB/s = 3 ms < 8 ms of prefill); r3 hits
    # the device
    assert (p.host_hit_blocks, p.device_hit_blocks) == (2, 2)
    assert p.restore_s == pytest.approx(0.003)
    assert p.prefill_total_s == pytest.approx(32 * 1e-3)
    assert p.prefill_saved_s == pytest.approx(16 * 1e-3 - 0.003)
    # attention cost: t = a*n + b*n*(c + n/2); r3's 8 tokens saved with c = 0
    s2 = TierSpeeds(prefill_s_per_token=0.0, prefill_s_per_token_pair=1e-3)
    _, q = run([rec([1, 2], ts=0), rec([1, 2], ts=1)], 4, speeds=s2)
    assert q.prefill_saved_s == pytest.approx(1e-3 * 8 * 4)


def test_the_simulators_cost_model_keeps_the_speeds_it_was_given():
    cm = CostModel.fixed(100, 4, read_bytes_per_s={"disk": 1e3}, latency_s={"disk": 0.01}, prefill_s_per_token=1e-3)
    cm.tiers["disk"].observe_read(10**9, 1e-3)
    cm.tiers["disk"].observe_lookup(5.0)
    cm.tiers["disk"].observe_job(5.0)
    cm.prefill.observe((1.0, 1.0), 9.0)
    assert cm.restore_s({"disk": 2}) == pytest.approx(0.01 + 0.2)  # no h2d term: included in the tier's
    assert cm.prefill.estimate(8, 0) == pytest.approx(8e-3)
    runs = [TierRun("host", 2), TierRun("disk", 3)]
    assert take_runs(runs, 4) == [TierRun("host", 2), TierRun("disk", 2)]
    assert take_runs(runs, 1) == [TierRun("host", 1)] and take_runs(runs, 0) == []


def test_config_errors_say_what_to_do():
    with pytest.raises(ValueError, match="host_blocks or host_bytes"):
        SimConfig(host_blocks=2, host_bytes=100)
    with pytest.raises(ValueError, match="write_policy"):
        SimConfig(write_policy="later")
    with pytest.raises(ValueError, match="restore_policy"):
        SimConfig(restore_policy="never")
    with pytest.raises(ValueError, match="positive"):
        TierSpeeds(disk_bytes_per_s=0)


def test_capacities_in_bytes_count_whole_blocks():
    sim = TraceSimulator(4, block_tokens=4, block_bytes=100, host_bytes=250, disk_bytes=450, disk_alloc_bytes=1)
    assert (sim.point.host_blocks, sim.point.disk_blocks) == (2, 2)  # disk frames are 200 bytes
    sim.replay(load_trace([rec([1, 2, 3])], 4))
    assert (len(sim.host), len(sim.disk)) == (2, 2)
    sim.check_integrity()
    # the disk tier charges whole file-system blocks: a 200-byte frame costs 4096 by default
    sim = TraceSimulator(4, block_tokens=4, block_bytes=100, host_bytes=250, disk_bytes=3 * 4096 - 1)
    assert sim.point.disk_blocks == 2
    sim.replay(load_trace([rec([1, 2, 3])], 4))
    assert len(sim.disk) == 2 and sim.disk.usage_bytes == 2 * 4096
    sim.check_integrity()


def random_trace(n=300, seed=0):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(1, 6))] for _ in range(20)]
    out = []
    for i in range(n):
        ids = list(rng.choice(prefixes)) + [10_000 + rng.randrange(50) for _ in range(rng.randint(0, 5))]
        out.append(rec(ids, len(ids) * 4 - rng.randrange(4), ts=i))
    return out


@pytest.mark.parametrize("write_policy", ["write_through", "write_back", "selective"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("cap", [3, 8, 25, 10_000])
def test_invariants_after_replay(policy, cap, write_policy):
    recs = random_trace()
    reqs = load_trace(recs, 4)
    sim = TraceSimulator(
        cap, policy=policy, block_tokens=4, block_bytes=100, host_blocks=30, disk_blocks=60, write_policy=write_policy
    )
    sim.replay(reqs)
    p = sim.result()
    sim.check_integrity()
    assert sum(b.ref_cnt for b in sim.pool.blocks) == 0
    assert len(sim.index) <= cap and len(sim.host) <= 30 and len(sim.disk) <= 60
    assert p.hit_blocks == p.device_hit_blocks + p.restored_blocks
    assert p.restored_blocks + p.recomputed_stored_blocks == p.stored_blocks
    assert p.host_bytes_read == p.host_hit_blocks * 100 and p.disk_bytes_read == p.disk_hit_blocks * 200
    assert sum(p.restore_decisions.values()) == p.num_requests - p.oversized_requests
    ideal = ideal_block_hit_rate(reqs)
    assert p.block_hit_rate <= ideal + 1e-12
    if cap == 10_000:
        assert p.block_hit_rate == pytest.approx(ideal) and p.restored_blocks == 0


def test_write_through_keeps_every_computed_block_on_a_disk_that_never_fills():
    reqs = load_trace(random_trace(seed=3), 4)
    sim = TraceSimulator(12, block_tokens=4, host_blocks=10, disk_blocks=100_000)  # no request is oversized
    sim.replay(reqs)
    assert set(sim.disk.keys()) == {k for r in reqs for k in r.keys}
    assert sim.result().disk_evictions == 0
    sim.check_integrity()


def test_simulate_dict_and_more_capacity_helps_on_this_trace():
    reqs = load_trace(random_trace(seed=1), 4)
    res = simulate(reqs, [5, 50, 5000], block_tokens=4)
    rates = [pt["block_hit_rate"] for pt in res["points"]]
    assert rates[0] <= rates[1] <= rates[2] == pytest.approx(res["ideal_block_hit_rate"])
    assert "host_hit_blocks" not in res["points"][0]
    res2 = simulate(reqs, [5], host_blocks=100, block_tokens=4)
    assert res2["points"][0]["host_hit_blocks"] > 0
    assert res2["points"][0]["block_hit_rate"] > rates[0]
    assert res2["write_policy"] == "write_through" and res2["speeds"]["host_bytes_per_s"] == 7.2e9


def test_sim_imports_no_torch():
    code = "import sys, kvtier.sim, kvtier.sim.simulator; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvtier", "simulate", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


def test_cli_json_contract(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TINY))
    out = _cli(str(trace), "--block-tokens", "4", "--device-blocks", "3,10", "--policy", "lru", "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["ideal_block_hit_rate"] == pytest.approx(3 / 7)
    assert [pt["device_blocks"] for pt in res["points"]] == [3, 10]
    for pt in res["points"]:
        assert {"device_blocks", "block_hit_rate", "token_hit_rate"} <= set(pt)
    assert res["points"][1]["block_hit_rate"] == pytest.approx(3 / 7)
    assert res["points"][1]["token_hit_rate"] == pytest.approx(0.5)

    out = _cli(
        str(trace),
        "--block-tokens",
        "4",
        "--sweep",
        "1,2",
        "--host-blocks",
        "5",
        "--disk-blocks",
        "5",
        "--policy",
        "lfu",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert [pt["device_blocks"] for pt in res["points"]] == [1, 2]
    for key in (
        "host_block_hit_rate",
        "host_token_hit_rate",
        "disk_block_hit_rate",
        "host_bytes_read",
        "disk_bytes_written",
        "restore_decisions",
        "restored_blocks",
        "recomputed_stored_blocks",
        "prefill_saved_s",
        "restore_s",
    ):
        assert key in res["points"][0]

    out = _cli(
        str(trace),
        "--block-tokens",
        "4",
        "--device-blocks",
        "1",
        "--host-bytes",
        "96KiB",
        "--disk-blocks",
        "5",
        "--write-policy",
        "write_back",
        "--restore-policy",
        "always",
        "--disk-gbps",
        "0.5",
        "--prefill-s-per-token-pair",
        "1e-9",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["write_policy"] == "write_back" and res["restore_policy"] == "always"
    assert res["points"][0]["host_blocks"] == 2  # 96 KiB of 48 KiB blocks (4 tokens x 12 KiB)
    assert res["speeds"]["disk_bytes_per_s"] == 0.5e9 and res["speeds"]["prefill_s_per_token_pair"] == 1e-9

    out = _cli(str(trace), "--block-tokens", "4", "--device-blocks", "3", "--device-blocks", "10")
    assert out.returncode == 0, out.stderr
    assert "block_hit" in out.stdout and len(out.stdout.strip().splitlines()) == 4

    out = _cli(str(trace), "--block-tokens", "4")
    assert out.returncode == 2 and "--device-blocks" in out.stderr
    out = _cli(str(trace), "--device-blocks", "0")
    assert out.returncode == 2
    out = _cli(str(trace), "--device-blocks", "3", "--host-blocks", "2", "--host-bytes", "1MiB")
    assert out.returncode == 2 and "host" in out.stderr


def test_device_hits_keep_their_host_copies_fresh():
    """Inclusive write-through: a prefix hot on device is refreshed in the host LRU on every
    device hit (TierHierarchy.touch, as the engine's scheduler does), so traffic flowing through
    the host tier evicts colder blocks first and the hot prefix survives there for when the
    device evicts it."""
    records = [rec([1, 2], ts=0), rec([1, 2], ts=1), rec([7], ts=2), rec([1, 2], ts=3), rec([8], ts=4)]
    reqs = load_trace(records, block_tokens=4)
    sim = TraceSimulator(3, block_tokens=4, block_bytes=100, host_blocks=3, restore_policy="always")
    sim.replay(reqs)
    hot, cold = reqs[0].keys, reqs[2].keys
    # 7 was stored after 1 and 2, but 1 and 2 were hit on device since: 7 went first
    assert sim.host.contains_prefix(hot) == 2
    assert sim.host.contains_prefix(cold) == 0
    assert sim.host.contains_prefix(reqs[4].keys) == 1
    sim.check_integrity()
