"""The restore-or-recompute decision follows the measured speeds."""

from __future__ import annotations

import pytest

from kvtier.cost import CostModel, PrefillEstimator, TierRun

BS = 16
BLOCK_BYTES = 16 * 12 * 1024  # reference model, bf16


def model(read_bw: dict[str, float], latency: dict[str, float], a=1e-3, b=1e-8) -> CostModel:
    cm = CostModel(list(read_bw), BLOCK_BYTES, BS, h2d_bytes_per_s=1e10)
    cm.prefill = PrefillEstimator(a=a, b=b)
    for name, bw in read_bw.items():
        cm.tiers[name].read_bytes_per_s.update(bw)
        cm.tiers[name].lookup_s.update(latency[name])
    return cm


def test_nothing_stored_means_nothing_to_decide():
    cm = model({"host": 1e10}, {"host": 1e-5})
    d = cm.decide(0, [], 100)
    assert d.kind == "none" and d.num_blocks == 0


def test_fast_tier_restores_everything():
    cm = model({"host": 1e10}, {"host": 1e-5})
    d = cm.decide(0, [TierRun("host", 127)], 2048)
    assert d.kind == "restore" and d.num_blocks == 127 and d.per_tier == {"host": 127}
    assert d.t_total_s < d.t_all_recompute_s


def test_slow_tier_recomputes_short_prefixes_but_restores_long_ones():
    # 50 ms latency, 200 MB/s: one block reads in ~1 ms; prefill is 1 ms/token.
    cm = model({"disk": 2e8}, {"disk": 0.05})
    short = cm.decide(0, [TierRun("disk", 2)], 40)  # 32 tokens: 32 ms to recompute < 50 ms
    long = cm.decide(0, [TierRun("disk", 127)], 2048)  # 2 s to recompute >> 0.05 + 0.12 s
    assert short.kind == "recompute" and short.num_blocks == 0
    assert long.kind == "restore" and long.num_blocks == 127


def test_partial_restore_takes_the_fast_tier_and_recomputes_after_a_slow_one():
    # host is fast; remote is so slow per byte that recomputing beats reading it
    cm = model({"host": 1e10, "remote": 1e6}, {"host": 1e-5, "remote": 1e-3})
    d = cm.decide(0, [TierRun("host", 10), TierRun("remote", 50)], 1000)
    assert d.kind == "partial" and d.per_tier == {"host": 10} and d.num_blocks == 10


def test_queue_delay_counts():
    cm = model({"disk": 1e9}, {"disk": 1e-4})
    assert cm.decide(0, [TierRun("disk", 4)], 80).kind == "restore"
    cm.queue_s["disk"] = 1.0  # a long queue in front of the disk
    assert cm.decide(0, [TierRun("disk", 4)], 80).kind == "recompute"


def test_prefill_estimator_learns_a_linear_plus_attention_cost():
    est = PrefillEstimator()
    true_a, true_b = 5e-4, 2e-8
    for n, c in [(16, 0), (512, 0), (2048, 0), (4, 2048), (256, 1024), (1024, 512)] * 20:
        x = est.features(n, c)
        est.observe(x, true_a * x[0] + true_b * x[1])
    assert est.estimate(2048, 0) == pytest.approx(true_a * 2048 + true_b * 2048 * 1024, rel=0.05)
    assert est.estimate(4, 2048) == pytest.approx(true_a * 4 + true_b * 4 * 2050, rel=0.1)
