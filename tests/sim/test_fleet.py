"""Fleet simulator (kvtier.sim.fleet): routing policies, the shared remote tier, the load model,
the fleet ceiling and the CLI's fleet mode. Properties that must hold, not tuned numbers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.sim import SimConfig, TraceSimulator, ideal_token_hit_rate, load_trace
from kvtier.sim.fleet import ROUTINGS, FleetSimulator, RouterConfig, simulate_fleet, sum_points
from kvtier.sim.tiers import SharedMemoryTier

REPO = Path(__file__).resolve().parents[2]
BT = 4


def rec(ids, ts=0, length=None, out=1):
    return {
        "timestamp": ts,
        "input_length": len(ids) * BT if length is None else length,
        "output_length": out,
        "hash_ids": list(ids),
    }


def hot_trace(num=300, prefixes=6, length=10, seed=0, gap_ms=1000):
    """`prefixes` distinct prefixes of `length` blocks; each request is one of them, cut to 6..10
    blocks (its last block partial). 6 x 10 blocks exceed one 35-block pool and fit three."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        p = rng.randrange(prefixes)
        n = rng.randint(length - 4, length)
        ids = [p * 1000 + j for j in range(n)]
        out.append(rec(ids, ts=i * gap_ms, length=n * BT - rng.randrange(BT), out=2))
    return out


def config(**kw):
    return SimConfig(block_tokens=BT, block_bytes=100, **kw)


def _comparable(d):
    d = dict(d)
    d.pop("sim_seconds")
    return d


@pytest.mark.parametrize("routing", ROUTINGS)
def test_one_instance_is_the_single_instance_simulator(routing):
    """A fleet of one, whatever the router, counts exactly what TraceSimulator counts."""
    rng = random.Random(5)
    records = [
        rec([rng.randrange(4)] + [rng.randrange(3) for _ in range(rng.randint(0, 6))], ts=rng.randrange(10_000))
        for _ in range(400)
    ]
    reqs = load_trace(records, BT)
    cfg = config(host_blocks=6, disk_blocks=10, remote_blocks=12, write_policy="write_back")
    single = TraceSimulator(5, cfg)
    single.replay(reqs)
    fleet = FleetSimulator(1, 5, cfg, routing)
    fleet.replay(reqs)
    fleet.check_integrity()
    res = fleet.result()
    want = single.result().to_dict()
    assert want["remote_hit_blocks"] > 0 and want["host_hit_blocks"] > 0 and want["disk_hit_blocks"] > 0
    assert want["cross_instance_hit_blocks"] == 0  # one instance: every remote entry is its own
    assert {k: res[k] for k in want if k != "sim_seconds"} == _comparable(want)
    assert res["per_instance"][0]["requests"] == len(reqs) and res["request_share_imbalance"] == 1.0


def test_sum_points_adds_counts_and_recomputes_rates():
    reqs = load_trace(hot_trace(num=60), BT)
    a, b = TraceSimulator(12, config()), TraceSimulator(12, config())
    a.replay(reqs[:30])
    b.replay(reqs[30:])
    total = sum_points([a.result(), b.result()])
    one = TraceSimulator(12, config())
    one.replay(reqs)
    assert total.num_requests == 60 and total.total_tokens == one.result().total_tokens
    assert total.hit_tokens == a.point.hit_tokens + b.point.hit_tokens
    assert total.token_hit_rate == pytest.approx(total.hit_tokens / total.total_tokens)


@pytest.mark.parametrize("seed", [0, 1])
def test_routers_on_hot_prefixes_that_fit_the_fleet_not_one_instance(seed):
    reqs = load_trace(hot_trace(seed=seed), BT)
    ideal = ideal_token_hit_rate(reqs)
    res = simulate_fleet(reqs, [35], 3, config=config())
    pt = res["points"][0]
    rate = {name: p["token_hit_rate"] for name, p in pt["policies"].items()}
    ceiling = pt["ceiling"]
    assert ceiling["device_blocks"] == 105 and ceiling["routing"] == "ceiling"
    assert ceiling["token_hit_rate"] == pytest.approx(ideal)  # one pool holds every prefix
    # routing by where the prefixes are beats spraying them over every pool, by a wide margin
    assert rate["kv_aware"] >= rate["round_robin"] + 0.2
    assert rate["oracle"] >= rate["kv_aware"] >= rate["round_robin"]
    assert rate["prefix"] >= rate["round_robin"] + 0.2
    for name, r in rate.items():
        assert ceiling["token_hit_rate"] >= r, name
        p = pt["policies"][name]
        assert p["num_requests"] == len(reqs) and p["total_tokens"] == ceiling["total_tokens"]
        assert sum(q["requests"] for q in p["per_instance"]) == len(reqs)
        assert sum(q["hit_tokens"] for q in p["per_instance"]) == p["hit_tokens"]
        assert p["block_hit_rate"] <= 1.0 and p["request_share_imbalance"] >= 1.0
    # one instance alone cannot hold them: the fleet's routing is what wins
    single = TraceSimulator(35, config())
    single.replay(reqs)
    assert single.result().token_hit_rate < rate["kv_aware"] - 0.2
    # round robin spreads requests evenly
    assert pt["policies"]["round_robin"]["request_share_imbalance"] == pytest.approx(1.0, abs=0.01)


def test_shared_remote_tier_serves_one_instances_blocks_to_another():
    """Round robin over 2 instances sharing a remote tier: the prefix instance 0 computed is a
    remote hit on instance 1, counted as cross-instance; the third request hits device."""
    records = [rec([1, 2, 3, 4], ts=0), rec([1, 2, 3, 4], ts=10_000), rec([1, 2, 3, 4], ts=20_000)]
    reqs = load_trace(records, BT)
    fleet = FleetSimulator(2, 8, config(remote_blocks=50, restore_policy="always"), "round_robin")
    fleet.replay(reqs)
    fleet.check_integrity()
    res = fleet.result()
    assert fleet.routed_to == [0, 1, 0]
    assert res["remote_hit_blocks"] == 4 and res["cross_instance_hit_blocks"] == 4
    assert res["cross_instance_hit_tokens"] == 16 and res["device_hit_blocks"] == 4
    assert [q["cross_instance_hit_tokens"] for q in res["per_instance"]] == [0, 16]
    assert res["remote_blocks"] == 50 and res["remote_bytes_written"] > 0

    # without the shared tier instance 1 computes it again
    alone = FleetSimulator(2, 8, config(restore_policy="always"), "round_robin")
    alone.replay(reqs)
    assert alone.result()["hit_blocks"] == 4 and "remote_hit_blocks" not in alone.result()


def test_own_remote_blocks_are_not_cross_instance():
    """A block an instance stored, lost from its device and restored from the shared tier is a
    remote hit, not a cross-instance one."""
    ids = [[1, 2, 3, 4], [20, 21], [7, 8, 9, 10], [22, 23], [1, 2, 3, 4]]
    records = [rec(b, ts=i) for i, b in enumerate(ids)]
    fleet = FleetSimulator(2, 4, config(remote_blocks=50, restore_policy="always"), "round_robin")
    fleet.replay(load_trace(records, BT))
    res = fleet.result()
    assert fleet.routed_to == [0, 1, 0, 1, 0]
    assert res["remote_hit_blocks"] == 4 and res["device_hit_blocks"] == 0
    assert res["cross_instance_hit_blocks"] == 0


def test_shared_tier_remembers_its_writers_until_eviction():
    t = SharedMemoryTier(200)  # two 100-byte entries
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    t.writer = 0
    t.put(a, bytes(100))
    t.writer = 1
    t.put(a, bytes(100))
    assert not t.stored_by_other(a, 0) and not t.stored_by_other(a, 1) and t.stored_by_other(a, 2)
    t.put(b, bytes(100))
    t.put(c, bytes(100))  # evicts a
    assert t.contains_prefix([a], count=False) == 0 and not t.stored_by_other(a, 2)  # gone
    t.put(a, bytes(100))  # a new entry: instance 0's old write no longer counts
    assert t.stored_by_other(a, 0) and not t.stored_by_other(a, 1)


def test_shared_tier_heals_round_robin():
    reqs = load_trace(hot_trace(), BT)
    res = simulate_fleet(reqs, [35], 3, ["round_robin", "kv_aware"], config(remote_blocks=200))
    pt = res["points"][0]
    rr = pt["policies"]["round_robin"]
    assert rr["cross_instance_hit_tokens"] > 0 and rr["remote_hit_tokens"] >= rr["cross_instance_hit_tokens"]
    without = simulate_fleet(reqs, [35], 3, ["round_robin"], config())["points"][0]["policies"]["round_robin"]
    assert rr["token_hit_rate"] > without["token_hit_rate"] + 0.2
    assert pt["ceiling"]["token_hit_rate"] >= pt["policies"]["kv_aware"]["token_hit_rate"]


def test_prefix_router_threshold_and_blind_to_evictions():
    def routes(records, **router):
        fleet = FleetSimulator(2, 4, config(), "prefix", RouterConfig(**router))
        fleet.replay(load_trace(records, BT))
        return fleet

    base = [rec([1, 2, 3, 4], ts=0), rec([1, 20, 21, 22], ts=1000), rec([1, 2, 3, 30], ts=2000)]
    # 1 of 4 blocks matches instance 0 (0.25 < 0.5): least loaded, then fewest routed; 3 of 4: instance 0
    assert routes(base).routed_to == [0, 1, 0]
    assert routes(base, cache_threshold=0.2).routed_to == [0, 0, 0]
    # below the threshold: the smallest tree (fewest blocks sent), not the fewest requests
    small = [rec([1, 2, 3, 4, 5, 6], ts=0), rec([7], ts=1000), rec([8], ts=2000)]
    assert routes(small).routed_to == [0, 1, 1]
    # instance 0 evicted [1, 2, 3, 4] for [9 ..]; the router only knows it sent it there
    evicting = [rec([1, 2, 3, 4], ts=0), rec([5, 6, 7, 8], ts=1000), rec([9, 10, 11, 12], ts=2000)]
    fleet = routes([*evicting, rec([1, 2, 3, 4], ts=3000)])
    assert fleet.routed_to == [0, 1, 0, 0]
    assert fleet.result()["hit_blocks"] == 0


def test_oracle_sees_the_disk_a_kv_aware_router_does_not():
    records = [rec([b * 4 + j for j in range(4)], ts=b * 1000) for b in range(5)]  # P, Q, R, S, T
    records.append(rec([0, 1, 2, 3], ts=5000))  # P again: only on instance 0's disk now
    reqs = load_trace(records, BT)
    cfg = config(disk_blocks=50, restore_policy="always")
    out = {}
    for routing in ("kv_aware", "oracle"):
        fleet = FleetSimulator(2, 4, cfg, routing)
        fleet.replay(reqs)
        out[routing] = (fleet.routed_to, fleet.result())
    assert out["kv_aware"][0] == [0, 1, 0, 1, 0, 1]  # nothing on device: fewest routed
    assert out["oracle"][0][-1] == 0 and out["oracle"][1]["disk_hit_blocks"] == 4
    assert out["kv_aware"][1]["hit_blocks"] == 0


def test_load_model_in_flight_counts():
    """Six requests at once that each run for seconds: loads at the arrivals are exact."""
    records = [rec([100 + i], ts=0, out=100) for i in range(6)]
    fleet = FleetSimulator(3, 8, config(), "round_robin", RouterConfig(decode_s_per_token=1.0))
    fleet.replay(load_trace(records, BT))
    res = fleet.result()
    # loads at arrivals: 000, 100, 110, 111, 211, 221 -> per instance 7, 5, 3 of 15
    assert [q["mean_in_flight"] for q in res["per_instance"]] == pytest.approx([7 / 6, 5 / 6, 3 / 6])
    assert res["mean_in_flight"] == pytest.approx(15 / 6 / 3)
    assert res["load_imbalance"] == pytest.approx(7 * 3 / 15)
    assert res["peak_in_flight"] == 2

    # a request finishes after its prefill + output_length x decode_s_per_token
    records = [rec([1], ts=0, out=5), rec([2], ts=4000), rec([3], ts=6000)]
    fleet = FleetSimulator(2, 8, config(), "round_robin", RouterConfig(decode_s_per_token=1.0))
    fleet.replay(load_trace(records, BT))
    assert [q["peak_in_flight"] for q in fleet.result()["per_instance"]] == [1, 0]
    assert fleet.result()["per_instance"][0]["mean_in_flight"] == pytest.approx(1 / 3)


def test_kv_aware_cost_trades_hits_for_load():
    """Every request shares one prefix and they pile up. kv_aware's cost (prefill blocks left
    + decode blocks in flight) sends them to the instance holding the prefix until its work in
    flight outweighs the prefill it saves; with the prefill weighted heavily it sends them all."""
    records = [rec([1, 2, 3, 4, 1000 + i], ts=i, out=1000) for i in range(30)]
    reqs = load_trace(records, BT)
    greedy = FleetSimulator(3, 64, config(), "kv_aware", RouterConfig(overlap_weight=1e6))
    greedy.replay(reqs)
    assert greedy.result()["request_share_imbalance"] == pytest.approx(3.0)
    balanced = FleetSimulator(3, 64, config(), "kv_aware", RouterConfig())
    balanced.replay(reqs)
    res = balanced.result()
    assert res["request_share_imbalance"] < 1.5 and res["peak_in_flight"] <= 12
    assert res["hit_blocks"] > 0
    balanced.check_integrity()


def test_prefix_router_load_guard_spreads_a_hot_prefix():
    """The text router follows its tree until the load is imbalanced (max - min > abs and
    max > rel x min), then sends to the least loaded."""
    records = [rec([1, 2, 3, 4, 1000 + i], ts=i, out=1000) for i in range(30)]
    reqs = load_trace(records, BT)
    greedy = FleetSimulator(3, 64, config(), "prefix", RouterConfig(balance_abs_threshold=1000))
    greedy.replay(reqs)
    assert greedy.result()["request_share_imbalance"] == pytest.approx(3.0)
    guarded = FleetSimulator(3, 64, config(), "prefix", RouterConfig(balance_abs_threshold=2))
    guarded.replay(reqs)
    res = guarded.result()
    assert res["request_share_imbalance"] < 1.5 and res["peak_in_flight"] <= 12
    assert res["hit_blocks"] > 0
    guarded.check_integrity()


def test_deterministic():
    reqs = load_trace(hot_trace(num=120, seed=3), BT)
    cfg = config(host_blocks=8, remote_blocks=40)
    runs = [simulate_fleet(reqs, [20, 35], 3, config=cfg) for _ in range(2)]
    for r in runs:
        for pt in r["points"]:
            pt["ceiling"].pop("sim_seconds")
            for p in pt["policies"].values():
                p.pop("sim_seconds")
    assert runs[0] == runs[1]
    assert list(runs[0]["points"][0]["policies"]) == list(ROUTINGS)


def test_bad_arguments():
    with pytest.raises(ValueError, match="routing"):
        FleetSimulator(2, 8, config(), "random")
    with pytest.raises(ValueError, match="instances"):
        FleetSimulator(0, 8, config())
    with pytest.raises(ValueError, match="routing"):
        simulate_fleet([], [8], 2, ["round_robin", "nope"], config())
    with pytest.raises(ValueError, match="cache_threshold"):
        RouterConfig(cache_threshold=1.5)
    with pytest.raises(ValueError, match="remote"):
        SimConfig(remote_blocks=1, remote_bytes=100)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvtier", "simulate", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


def test_cli_fleet(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in hot_trace(num=80)))
    common = [str(trace), "--block-tokens", "4", "--block-bytes", "100", "--device-blocks", "35"]
    out = _cli(*common, "--instances", "3", "--routing", "round_robin,prefix,kv_aware,oracle")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for name in ("ceiling", *ROUTINGS):
        assert sum(line.startswith(name) for line in lines) == 1, (name, out.stdout)
    assert "(ceiling: 105)" in out.stdout

    out = _cli(*common, "--instances", "2", "--routing", "kv_aware", "--shared-remote-blocks", "100", "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["instances"] == 2 and res["routing"] == ["kv_aware"] and res["remote_blocks"] == 100
    pt = res["points"][0]
    assert list(pt["policies"]) == ["kv_aware"] and pt["ceiling"]["device_blocks"] == 70
    assert "cross_instance_hit_tokens" in pt["policies"]["kv_aware"]
    assert len(pt["policies"]["kv_aware"]["per_instance"]) == 2

    # --instances 1 is the single-instance output, routing or not
    one = _cli(*common, "--json")
    assert one.returncode == 0, one.stderr
    one_r = _cli(*common, "--json", "--instances", "1", "--routing", "oracle")
    a, b = json.loads(one.stdout), json.loads(one_r.stdout)
    for r in (a, b):
        r["points"][0].pop("sim_seconds")
    assert a == b and "instances" not in a

    # --output-tokens replaces the trace's output lengths in the load model: shorter requests,
    # fewer in flight
    slow = ("--instances", "3", "--routing", "kv_aware", "--decode-s-per-token", "1", "--json")
    long_out = json.loads(_cli(*common, *slow, "--output-tokens", "5").stdout)
    short = _cli(*common, *slow, "--output-tokens", "1")
    assert short.returncode == 0, short.stderr
    fast = _cli(*common, *slow, "--output-tokens", "1", "--speedup", "4")  # arrivals 4x closer: more
    assert fast.returncode == 0, fast.stderr
    runs = (long_out, json.loads(short.stdout), json.loads(fast.stdout))
    flight = [r["points"][0]["policies"]["kv_aware"]["mean_in_flight"] for r in runs]
    assert flight[1] < flight[0] and flight[2] > flight[1]

    bad = _cli(*common, "--instances", "2", "--routing", "random")
    assert bad.returncode == 2 and "routing" in bad.stderr
    bad = _cli(*common, "--instances", "2", "--plot", str(tmp_path / "p.png"))
    assert bad.returncode == 2 and "--plot" in bad.stderr


def test_a_trace_replayed_with_fewer_tokens_per_id_has_shorter_prompts():
    """A block holds at most block_tokens: Mooncake's 512-token ids replayed as 8 tokens each
    (the fleet benchmark) give prompts of 8 per id, whatever input_length says."""
    records = [rec([1, 2, 3], length=1300), rec([1, 2], length=700)]
    native = load_trace(records, 512)
    assert [r.input_length for r in native] == [1300, 700]
    assert native[0].block_tokens == [512, 512, 276]
    small = load_trace(records, 8)
    assert [r.input_length for r in small] == [24, 16]
    assert small[0].block_tokens == [8, 8, 8]


def test_conversation_trace_ideal_block_hit_rate():
    """The whole conversation trace with unlimited capacity: 36.6% of blocks are hits."""
    trace = Path("/work/shared/data/traces/conversation_trace.jsonl")
    if not trace.exists():
        trace = REPO.parent / "shared" / "data" / "traces" / "conversation_trace.jsonl"
    if not trace.exists():
        pytest.skip("the shared traces are not beside this checkout")
    from kvtier.sim import ideal_block_hit_rate

    reqs = load_trace(trace)
    assert len(reqs) == 12031
    assert ideal_block_hit_rate(reqs) == pytest.approx(0.366, abs=5e-4)
