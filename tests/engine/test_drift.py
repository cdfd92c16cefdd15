"""The online KV drift monitor: which requests it samples, what it compares, and that it never
changes what is served. Tiny random float32 model (byte_model_dir); drift values themselves are
only meaningful on trained weights (docs/benchmarks.md), so these tests assert structure:
zero drift where the KV is full precision, nonzero where it is quantized."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.engine.drift import KL_BUCKETS, DriftConfig, DriftStats, _sampled, divergence

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompts(n: int, length: int = 24) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 + 3 for j in range(length + i)] for i in range(n)]


def make_llm(model_dir, rate: float, kv: str = "auto", **kw) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        num_device_blocks=96,
        block_size=4,
        kv_drift_sample_rate=rate,
        kv_cache_dtype=kv,
        **kw,
    )


# -- the math -------------------------------------------------------------------------------------


def test_divergence_matches_closed_form():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.5, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.6, 0.3, 0.1], [0.25, 0.25, 0.5]], dtype=torch.float64)
    kl, agree = divergence(p.log(), q.log())
    expected0 = 0.7 * math.log(0.7 / 0.6) + 0.2 * math.log(0.2 / 0.3)
    expected1 = 0.5 * math.log(2) * 2  # the reference's zero-probability token contributes nothing
    assert kl.tolist() == pytest.approx([expected0, expected1], rel=1e-9)
    assert agree.tolist() == [True, False]
    same, agree_same = divergence(q.log(), q.log())
    assert same.tolist() == [0.0, 0.0] and agree_same.all()


def test_kl_histogram_buckets_per_request_mean():
    st = DriftStats()
    st.add(torch.tensor([1e-7, 3e-7], dtype=torch.float64), torch.tensor([True, True]), 1.0, 1.0)
    st.add(torch.tensor([0.5], dtype=torch.float64), torch.tensor([False]), 2.0, 1.5)
    assert st.num_samples == 2 and st.num_tokens == 3
    assert st.kl_bucket_counts[0] == 1  # mean 2e-7 <= 1e-6
    assert st.kl_bucket_counts[KL_BUCKETS.index(1.0)] == 1  # mean 0.5 in (0.3, 1]
    assert st.top1_agreement == pytest.approx(2 / 3)
    assert st.mean_kl == pytest.approx((4e-7 + 0.5) / 3)


def test_sampling_is_deterministic_per_request_id_and_follows_the_rate():
    ids = [f"req-{i}" for i in range(4000)]
    picked = [i for i in ids if _sampled(7, i, 0.25)]
    assert picked == [i for i in ids if _sampled(7, i, 0.25)]
    assert 0.22 < len(picked) / len(ids) < 0.28
    assert picked != [i for i in ids if _sampled(8, i, 0.25)]  # the seed matters
    assert not any(_sampled(7, i, 0.0) for i in ids) and all(_sampled(7, i, 1.0) for i in ids)


def test_config_rejects_a_rate_outside_0_1(byte_model_dir):
    with pytest.raises(ValueError, match="kv_drift_sample_rate"):
        DriftConfig(sample_rate=1.5)
    with pytest.raises(ValueError, match="kv_drift_sample_rate"):
        make_llm(byte_model_dir, -0.1)


# -- the monitor in the engine ----------------------------------------------------------------------


def test_rate_zero_builds_no_monitor(byte_model_dir):
    llm = make_llm(byte_model_dir, 0.0)
    assert llm.engine.drift is None
    llm.generate(prompts(2), GREEDY)
    llm.check_integrity()


def test_full_precision_kv_shows_no_drift_and_served_tokens_do_not_change(byte_model_dir):
    plain = make_llm(byte_model_dir, 0.0)
    watched = make_llm(byte_model_dir, 1.0)
    ps = prompts(3) + prompts(1)  # the repeat hits the prefix cache
    expected = [o.outputs[0].token_ids for o in plain.generate(ps, GREEDY)]
    outs = watched.generate(ps, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    st = watched.engine.drift.stats
    assert watched.engine.drift.num_pending == 0  # compared before generate() returned
    assert st.num_samples == 4 and st.num_tokens == 4 * GREEDY.max_tokens
    assert st.mean_kl < 1e-9 and st.top1_agreement == 1.0
    assert abs(st.served_nll_sum - st.full_nll_sum) < 1e-3
    watched.check_integrity()


def test_quantized_kv_drift_is_measured(byte_model_dir):
    outs = {}
    stats = {}
    for kv in ("auto", "fp8_e5m2"):
        llm = make_llm(byte_model_dir, 1.0, kv=kv)
        outs[kv] = llm.generate(prompts(3, length=40), GREEDY)
        stats[kv] = llm.engine.drift.stats
        llm.check_integrity()
    assert stats["fp8_e5m2"].num_tokens == stats["auto"].num_tokens == 3 * GREEDY.max_tokens
    assert stats["fp8_e5m2"].mean_kl > 1e-7 > stats["auto"].mean_kl
    assert stats["fp8_e5m2"].kl_max >= stats["fp8_e5m2"].mean_kl


def test_only_sampled_requests_are_compared_and_positions_are_capped(byte_model_dir):
    llm = make_llm(byte_model_dir, 0.5)
    llm.engine.drift.config = DriftConfig(sample_rate=0.5, seed=0, max_positions=4)
    sp = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    ps = prompts(12)
    outs = llm.generate(ps, sp)
    expected = [o.request_id for o in outs if _sampled(0, o.request_id, 0.5)]
    assert 0 < len(expected) < len(ps)
    st = llm.engine.drift.stats
    assert st.num_samples == len(expected)
    assert st.num_tokens == 4 * len(expected)  # the first 4 generated positions of each


def test_aborted_request_compares_what_it_generated(byte_model_dir):
    llm = make_llm(byte_model_dir, 1.0)
    engine = llm.engine
    rid = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    generated = 0
    while generated < 3:
        for out in engine.step():
            generated = len(out.outputs[0].token_ids)
    engine.abort_request(rid)
    never = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=5))
    engine.abort_request(never)  # aborted before its first token: nothing to compare
    assert engine.drift.run_pending() == 1
    st = engine.drift.stats
    assert st.num_samples == 1 and st.num_tokens == generated and st.num_skipped == 1
    llm.check_integrity()


def test_sampled_n_greater_than_one_tracks_the_first_sample(byte_model_dir):
    llm = make_llm(byte_model_dir, 1.0)
    sp = SamplingParams(max_tokens=5, temperature=0.8, n=3, seed=1, ignore_eos=True)
    out = llm.generate(prompts(1), sp)[0]
    assert len(out.outputs) == 3
    st = llm.engine.drift.stats
    assert st.num_samples == 1 and st.num_tokens == 5 and st.mean_kl < 1e-9
    llm.check_integrity()


def test_preempted_requests_line_up_their_positions(byte_model_dir):
    """A preempted request is recomputed and resumes at its next token: every generated position
    is compared once, against the right full-precision row (auto KV: no drift)."""
    llm = LLM(str(byte_model_dir), dtype="float32", num_device_blocks=20, block_size=4, kv_drift_sample_rate=1.0)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts(4), sp)
    assert sum(o.num_preemptions for o in outs) > 0
    st = llm.engine.drift.stats
    assert st.num_samples == 4 and st.num_tokens == 4 * 12
    assert st.mean_kl < 1e-9 and st.top1_agreement == 1.0
    llm.check_integrity()
