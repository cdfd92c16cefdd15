"""Trace simulator: known hit counts on hand-made traces, tiers, invariants, the CLI contract."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.sim import TraceSimulator, ideal_block_hit_rate, load_trace, simulate

REPO = Path(__file__).resolve().parents[2]


def rec(ids, length=None, ts=0, bt=4):
    return {"timestamp": ts, "input_length": len(ids) * bt if length is None else length,
            "output_length": 1, "hash_ids": list(ids)}


def run(records, cap, policy="lru", bt=4, **kw):
    sim = TraceSimulator(cap, policy, block_bytes=kw.pop("block_bytes", 100), **kw)
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
    sim.pool.check_integrity(expected_refs={})
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
    sim.pool.check_integrity(expected_refs={})
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
    sim.pool.check_integrity(expected_refs={})


def test_host_tier_counts_and_bytes():
    # device 1, host 2: A, B, A -> A was demoted to host by B and hits there
    sim, p = run([rec([1], ts=0), rec([2], ts=1), rec([1], ts=2)], 1, host_blocks=2)
    assert (p.device_hit_blocks, p.host_hit_blocks, p.disk_hit_blocks) == (0, 1, 0)
    assert p.host_hit_tokens == 4 and p.host_token_hit_rate == pytest.approx(4 / 12)
    assert p.bytes_device_to_host == 200 and p.bytes_host_to_device == 100
    assert p.block_hit_rate == pytest.approx(1 / 3)
    assert 1 not in sim.host  # tiers are exclusive: the restored block moved up
    sim.pool.check_integrity(expected_refs={})


def test_prefix_continues_from_device_through_host_and_disk():
    # device 4, host 1, disk 10: r0 [1,2,3]; r1 [7,8,9,6] demotes all of r0 (leaves first): host
    # keeps the last demoted (key 1), disk gets (1,2,3) and (1,2). r2 [1,2,3,4] (partial last
    # block): key 1 is in host, keys 2 and 3 on disk, 4 nowhere.
    recs = [rec([1, 2, 3], ts=0), rec([7, 8, 9, 6], ts=1), rec([1, 2, 3, 4], 14, ts=2)]
    sim, p = run(recs, 4, host_blocks=1, disk_blocks=10)
    assert (p.device_hit_blocks, p.host_hit_blocks, p.disk_hit_blocks) == (0, 1, 2)
    assert p.hit_tokens == 12 and p.total_tokens == 12 + 16 + 14
    assert p.bytes_disk_to_device == 200 and p.bytes_host_to_device == 100
    assert p.prefill_saved_s == pytest.approx(12 * p.prefill_s_per_token)
    sim.pool.check_integrity(expected_refs={})
    # a device hit followed by host hits
    recs2 = [rec([1, 2], ts=0), rec([1, 7], ts=1), rec([1, 2], ts=2)]
    _, q = run(recs2, 2, host_blocks=4)  # r1 evicts (1,2) to host, keeps key 1 on device
    assert (q.device_hit_blocks, q.host_hit_blocks) == (1 + 1, 1)


def random_trace(n=300, seed=0):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(1, 6))] for _ in range(20)]
    out = []
    for i in range(n):
        ids = list(rng.choice(prefixes)) + [10_000 + rng.randrange(50) for _ in range(rng.randint(0, 5))]
        out.append(rec(ids, len(ids) * 4 - rng.randrange(4), ts=i))
    return out


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("cap", [3, 8, 25, 10_000])
def test_invariants_after_replay_and_capacity_monotone_tiers(policy, cap):
    recs = random_trace()
    reqs = load_trace(recs, 4)
    sim = TraceSimulator(cap, policy, host_blocks=30, disk_blocks=60)
    sim.replay(reqs)
    p = sim.result()
    sim.pool.check_integrity(expected_refs={})
    assert sum(b.ref_cnt for b in sim.pool.blocks) == 0
    assert len(sim.index) <= cap and len(sim.host) <= 30 and len(sim.disk) <= 60
    # device, host and disk hold disjoint keys
    dev = {n.key for n in sim.index.nodes()}
    assert not (dev & set(sim.host.entries)) and not (dev & set(sim.disk.entries))
    assert not (set(sim.host.entries) & set(sim.disk.entries))
    ideal = ideal_block_hit_rate(reqs)
    assert p.block_hit_rate <= ideal + 1e-12
    if cap == 10_000:
        assert p.block_hit_rate == pytest.approx(ideal) and p.host_hit_blocks == 0


def test_simulate_dict_and_more_capacity_helps_on_this_trace():
    reqs = load_trace(random_trace(seed=1), 4)
    res = simulate(reqs, [5, 50, 5000], block_tokens=4)
    rates = [pt["block_hit_rate"] for pt in res["points"]]
    assert rates[0] <= rates[1] <= rates[2] == pytest.approx(res["ideal_block_hit_rate"])
    assert "host_hit_blocks" not in res["points"][0]
    res2 = simulate(reqs, [5], host_blocks=100, block_tokens=4)
    assert res2["points"][0]["host_hit_blocks"] > 0


def test_sim_imports_no_torch():
    code = "import sys, kvtier.sim, kvtier.sim.simulator; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvtier", "simulate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))


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

    out = _cli(str(trace), "--block-tokens", "4", "--sweep", "1,2", "--host-blocks", "5", "--disk-blocks", "5",
               "--policy", "lfu", "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert [pt["device_blocks"] for pt in res["points"]] == [1, 2]
    for key in ("host_block_hit_rate", "host_token_hit_rate", "disk_block_hit_rate", "bytes_host_to_device",
                "prefill_saved_s"):
        assert key in res["points"][0]

    out = _cli(str(trace), "--block-tokens", "4", "--device-blocks", "3", "--device-blocks", "10")
    assert out.returncode == 0, out.stderr
    assert "block_hit" in out.stdout and len(out.stdout.strip().splitlines()) == 4

    out = _cli(str(trace), "--block-tokens", "4")
    assert out.returncode == 2 and "--device-blocks" in out.stderr
    out = _cli(str(trace), "--device-blocks", "0")
    assert out.returncode == 2
