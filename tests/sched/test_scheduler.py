"""Scheduler + KVCacheManager, driven without a model: the runner's work is pretended by
feeding a fixed token back for every sampled sequence. Every scenario ends in check_integrity()."""

from __future__ import annotations

import pytest

from kvtier.kvcache import KVCacheManager, root_key
from kvtier.sampling_params import SamplingParams
from kvtier.sched.request import Request, RequestStatus
from kvtier.sched.scheduler import Scheduler, SchedulerConfig

ROOT = root_key(b"test-model")


def make(num_blocks=32, block_size=4, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, block_size))


def req(rid: str, n_prompt: int, max_tokens: int = 4, priority: int = 0, base: int = 0, **sp) -> Request:
    return Request(
        rid,
        [base + i for i in range(n_prompt)],
        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **sp),
        ROOT,
        priority=priority,
    )


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {seq.req_id: token for seq in out.seqs if seq.sample}
    finished = s.update_from_output(out, sampled)
    s.check_integrity()
    return out, finished


def run_all(s: Scheduler, limit: int = 1000) -> list:
    outs = []
    for _ in range(limit):
        if not s.has_unfinished:
            return outs
        outs.append(step(s)[0])
    raise AssertionError("scheduler did not finish")


def test_token_budget_and_chunked_prefill():
    s = make(max_num_batched_tokens=8)
    s.add_request(req("a", 20))
    sizes = []
    while not s.requests["a"].is_prefill_done:
        out, _ = step(s)
        sizes.append(out.num_batched_tokens)
        assert out.num_batched_tokens <= 8
    assert sizes == [8, 8, 4]  # the last chunk samples the first token
    out, _ = step(s)
    assert [len(x.token_ids) for x in out.seqs] == [1] and out.seqs[0].sample


def test_decode_and_prefill_share_a_step():
    s = make(max_num_batched_tokens=10)
    s.add_request(req("a", 6))
    step(s)  # a prefilled
    s.add_request(req("b", 30))
    out, _ = step(s)
    assert [(x.req_id, len(x.token_ids)) for x in out.seqs] == [("a", 1), ("b", 9)]


def test_no_chunking_waits_for_a_whole_prompt():
    s = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    s.add_request(req("a", 6))
    s.add_request(req("b", 6))
    out, _ = step(s)
    assert [x.req_id for x in out.seqs] == ["a"]


def test_max_num_seqs():
    s = make(max_num_seqs=2)
    for r in "abc":
        s.add_request(req(r, 4, base=ord(r) * 100))
    out, _ = step(s)
    assert {x.req_id for x in out.seqs} == {"a", "b"}
    run_all(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_finish_frees_blocks_and_keeps_them_cached():
    s = make()
    s.add_request(req("a", 9, max_tokens=3))
    run_all(s)
    assert s.kv.num_free_blocks == 32
    assert len(s.kv.index) == 2  # 11 computed tokens (9 prompt + 2 fed back) -> 2 full blocks
    s.add_request(req("b", 9, max_tokens=3))
    step(s)
    assert s.requests["b"].num_cached_tokens == 8
    run_all(s)


def test_preemption_picks_latest_arrival_and_resumes_with_prefix_hit():
    # 3 requests x (8 prompt + 8 out) = 4 blocks each at block_size 4; a pool of 9 blocks runs out.
    s = make(num_blocks=9, block_size=4)
    for r in "abc":
        s.add_request(req(r, 8, max_tokens=8, base=ord(r) * 100))
    preempted = []
    outs = run_all(s)
    for out in outs:
        preempted += out.preempted_req_ids
    assert preempted and preempted[0] == "c"
    assert s.num_preemptions == len(preempted)


def test_preemption_victim_is_lowest_priority():
    s = make(num_blocks=9, block_size=4, policy="priority")
    s.add_request(req("a", 8, max_tokens=8, priority=5, base=100))
    s.add_request(req("b", 8, max_tokens=8, priority=0, base=200))
    s.add_request(req("c", 8, max_tokens=8, priority=1, base=300))
    preempted = []
    for out in run_all(s):
        preempted += out.preempted_req_ids
    assert preempted and preempted[0] == "a"


def test_preempted_request_keeps_its_output_and_reuses_cached_blocks():
    s = make(num_blocks=9, block_size=4)
    for r in "abc":
        s.add_request(req(r, 8, max_tokens=8, base=ord(r) * 100))
    victim = None
    while victim is None:
        out, _ = step(s)
        if out.preempted_req_ids:
            victim = s.requests[out.preempted_req_ids[0]]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    n_out = victim.num_output_tokens
    while victim.status != RequestStatus.RUNNING:
        out, _ = step(s)
    seq = next(x for x in out.seqs if x.req_id == victim.req_id)
    assert seq.start_pos > 0  # resumed from cached blocks, not from scratch
    assert victim.num_output_tokens >= n_out
    run_all(s)


def test_priority_queue_orders_admission_and_aging_prevents_starvation():
    s = make(max_num_seqs=1, policy="priority", aging_steps=2)
    s.add_request(req("low", 4, max_tokens=2, priority=3, base=100))
    s.add_request(req("high", 4, max_tokens=2, priority=0, base=200))
    out, _ = step(s)
    assert [x.req_id for x in out.seqs] == ["high"]
    order = []
    # keep adding high-priority work; "low" must still get in thanks to aging
    for i in range(30):
        if i % 2 == 0:
            s.add_request(req(f"h{i}", 4, max_tokens=2, priority=0, base=1000 + i * 10))
        out, _ = step(s)
        order += [x.req_id for x in out.seqs if x.start_pos == 0]
    assert "low" in order
    run_all(s)


def test_fcfs_head_of_line_is_not_overtaken():
    s = make(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    s.add_request(req("big", 20, max_tokens=8, base=100))  # 7 blocks
    step(s)
    s.add_request(req("big2", 20, max_tokens=8, base=200))  # cannot fit yet
    s.add_request(req("small", 2, max_tokens=2, base=300))  # would fit, must wait its turn
    out, _ = step(s)
    assert [x.req_id for x in out.seqs] == ["big"]
    run_all(s)


def test_abort_frees_every_block():
    s = make()
    s.add_request(req("a", 10, max_tokens=50))
    s.add_request(req("b", 10, max_tokens=50, base=500))
    step(s)
    step(s)
    s.abort_request("a")
    s.check_integrity()
    assert not s.kv.has_request("a")
    s.abort_request("b")
    s.check_integrity()
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert s.abort_request("b") is None


def test_abort_between_schedule_and_update_is_safe():
    s = make()
    s.add_request(req("a", 10))
    out = s.schedule()
    s.abort_request("a")
    s.update_from_output(out, {"a": 1})
    s.check_integrity()
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_request_larger_than_pool_is_rejected_clearly():
    s = make(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="device pool"):
        s.add_request(req("a", 20, max_tokens=4))
    s.check_integrity()


def test_duplicate_request_id_is_rejected():
    s = make()
    s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", 4))


def test_stop_token_and_max_tokens():
    s = make()
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7]), ROOT))
    _out, finished = step(s, token=7)
    assert finished and finished[0].status == RequestStatus.FINISHED_STOPPED
    s.add_request(req("b", 3, max_tokens=2))
    run_all(s)
    s.check_integrity()


def shared(rid: str, prefix: int, unique: int, root=ROOT) -> Request:
    """A prompt of `prefix` shared tokens, then `unique` tokens of its own."""
    tokens = list(range(prefix)) + [1000 + 10 * ord(rid[0]) + i for i in range(unique)]
    return Request(rid, tokens, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), root)


def test_a_burst_sharing_a_new_prefix_computes_it_once():
    s = make(max_num_batched_tokens=64)
    for r in "abc":
        s.add_request(shared(r, 12, 3))
    out, _ = step(s)
    # only a computes the shared blocks; b and c wait for them instead of computing them too
    assert [(x.req_id, x.start_pos, len(x.token_ids)) for x in out.seqs] == [("a", 0, 15)]
    assert s.num_inflight_waits == 2
    out, _ = step(s)
    assert [(x.req_id, x.start_pos, len(x.token_ids)) for x in out.seqs] == [("a", 15, 1), ("b", 12, 3), ("c", 12, 3)]
    assert s.requests["b"].num_cached_tokens == s.requests["c"].num_cached_tokens == 12
    run_all(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_long_shared_prefix_is_waited_for_across_its_chunks():
    s = make(num_blocks=64, max_num_batched_tokens=16)
    s.add_request(shared("a", 40, 2))
    s.add_request(shared("b", 40, 5))
    starts = []
    for _ in range(4):
        out, _ = step(s)
        starts.append([(x.req_id, x.start_pos, len(x.token_ids)) for x in out.seqs])
    # b waits while a's chunks compute the shared blocks, then hits all 40 shared tokens
    assert starts[:3] == [[("a", 0, 16)], [("a", 16, 16)], [("a", 32, 10)]]
    assert starts[3] == [("a", 42, 1), ("b", 40, 5)]
    run_all(s)


def test_other_salts_and_unrelated_prompts_do_not_wait():
    s = make(max_num_batched_tokens=64)
    s.add_request(shared("a", 12, 3))
    s.add_request(shared("b", 12, 3, root=root_key(b"test-model", "tenant-b")))  # same tokens, other salt
    s.add_request(req("c", 15, base=500))
    out, _ = step(s)
    assert sorted(x.req_id for x in out.seqs) == ["a", "b", "c"] and s.num_inflight_waits == 0
    run_all(s)


def test_a_preempted_holder_does_not_strand_the_waiter():
    s = make(num_blocks=8, max_num_batched_tokens=8)
    s.add_request(shared("a", 16, 3))  # 19 tokens, chunks of 8: holds the shared blocks for 3 steps
    s.add_request(shared("b", 16, 3))
    step(s)
    s._preempt(s.requests["a"])  # the holder goes back to waiting (its computed blocks stay cached)
    s.check_integrity()
    run_all(s)  # both finish: nothing waits on a request that is not running
