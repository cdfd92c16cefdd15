"""The scheduler's restore path with a fake tier hierarchy (no tensors, no threads): admission
into LOADING, `_finish_loads` on success, a short load and a load that raises (counted, logged,
recomputed), lookups counted once per admission. Every scenario ends in check_integrity()."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace

from kvtier.cost.model import RestoreDecision, TierRun
from kvtier.kvcache import KVCacheManager, root_key
from kvtier.sampling_params import SamplingParams
from kvtier.sched.request import Request, RequestStatus
from kvtier.sched.scheduler import Scheduler, SchedulerConfig

ROOT = root_key(b"restore-test")
BS = 4


@dataclass
class FakeTiers:
    """What the scheduler asks of a TierHierarchy: every block of the prompt is 'stored' in
    the host tier; `submit_load` hands back a future the test completes."""

    stored_blocks: int
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(restore_policy="always"))
    futures: list[Future] = field(default_factory=list)
    counted_lookups: int = 0

    def __post_init__(self) -> None:
        self.cost = self

    def touch(self, keys) -> None:
        pass

    def runs(self, keys, start, remote_prefix=0, count=True):
        if count:
            self.counted_lookups += 1
        n = min(self.stored_blocks, len(keys)) - start
        return [TierRun("host", n)] if n > 0 else []

    def decide(self, device_tokens, runs, prompt_tokens, restore_all=False):
        n = sum(r.num_blocks for r in runs)
        return RestoreDecision(n, {"host": n} if n else {}, 0.0, 0.0, 0.0, "restore" if n else "none")

    def submit_load(self, keys, runs, owner=None):
        f: Future = Future()
        f.keys = list(keys)  # type: ignore[attr-defined]
        self.futures.append(f)
        return f


def make(tiers: FakeTiers, num_blocks: int = 32) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(num_blocks, BS), tiers=tiers)


def request(rid: str, n: int) -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), ROOT)


def run(s: Scheduler, limit: int = 50) -> None:
    for _ in range(limit):
        if not s.has_unfinished:
            return
        out = s.schedule()
        s.update_from_output(out, {seq.req_id: 7 for seq in out.seqs if seq.sample})
        s.check_integrity()
    raise AssertionError("did not finish")


def _loaded(keys, n):
    return SimpleNamespace(tensors=[object()] * n, per_tier={"host": n}, seconds=0.001, queue_s=0.0)


def test_restore_admits_into_loading_then_runs_from_the_restored_blocks():
    tiers = FakeTiers(stored_blocks=4)
    s = make(tiers)
    s.add_request(request("a", 17))  # 4 full blocks stored; the 17th token is always computed
    out = s.schedule()
    r = s.requests["a"]
    assert r.status == RequestStatus.LOADING and not out.seqs and len(tiers.futures) == 1
    assert s.restore_decisions["restore"] == 1 and tiers.counted_lookups == 1
    s.check_integrity()
    tiers.futures[0].set_result(_loaded(tiers.futures[0].keys, 4))
    out = s.schedule()
    assert [len(x.token_ids) for x in out.seqs] == [1]  # only the last prompt token is computed
    assert r.num_cached_tokens == 16 and r.cached_by_tier == {"device": 0, "host": 16}
    assert [b.req_id for b in out.block_loads] == ["a"] * 4  # the runner writes them before the forward
    s.update_from_output(out, {"a": 7})
    run(s)
    assert s.num_failed_loads == 0


def test_short_load_recomputes_the_rest():
    tiers = FakeTiers(stored_blocks=4)
    s = make(tiers)
    s.add_request(request("a", 17))
    s.schedule()
    tiers.futures[0].set_result(_loaded(tiers.futures[0].keys, 1))  # stops at the first failure
    out = s.schedule()
    assert [len(x.token_ids) for x in out.seqs] == [13]
    assert s.requests["a"].num_cached_tokens == 4 and len(out.block_loads) == 1
    s.update_from_output(out, {"a": 7})
    run(s)


def test_load_that_raises_is_counted_logged_and_recomputed(caplog):
    tiers = FakeTiers(stored_blocks=4)
    s = make(tiers)
    s.add_request(request("a", 17))
    s.schedule()
    tiers.futures[0].set_exception(RuntimeError("codec bug"))
    with caplog.at_level(logging.WARNING, logger="kvtier.sched"):
        out = s.schedule()
    assert s.num_failed_loads == 1
    assert any("restoring 4 blocks" in m and "recomputed" in m for m in caplog.messages)
    assert [len(x.token_ids) for x in out.seqs] == [17]  # every prompt token computed
    assert s.requests["a"].num_cached_tokens == 0 and not out.block_loads
    s.update_from_output(out, {"a": 7})
    run(s)


def test_waiting_for_space_is_one_counted_lookup():
    """A request that cannot get blocks for its restore waits; its later tries are not new
    prefix-cache queries nor new decisions."""
    tiers = FakeTiers(stored_blocks=4)
    s = make(tiers, num_blocks=8)
    s.add_request(request("big", 28))  # 7 blocks of 8: the pool is nearly full while it runs
    s.schedule()
    tiers.futures[0].set_result(_loaded(tiers.futures[0].keys, 4))
    s.add_request(request("b", 17))
    for _ in range(3):
        out = s.schedule()
        s.update_from_output(out, {seq.req_id: 7 for seq in out.seqs if seq.sample})
        s.check_integrity()
    assert tiers.counted_lookups == 2  # one per request, not one per try
    assert sum(s.restore_decisions.values()) == 2
    for f in tiers.futures[1:]:
        if not f.done():
            f.set_result(_loaded(f.keys, len(f.keys)))
    run(s)
