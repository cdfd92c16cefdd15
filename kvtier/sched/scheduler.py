"""Token-budget scheduler: continuous batching with chunked prefill and preemption.

Each step every request wants `num_tokens - num_computed_tokens` more tokens computed (a
decoding request wants 1). Running requests go first, most important first; then waiting
requests are admitted while the token budget, `max_num_seqs` and the pool allow. There are no
prefill or decode phases. When the pool cannot grow a running request, the least important
running request (lowest priority, then latest arrival) is preempted: its blocks are freed (its
full blocks stay cached, so resuming is mostly a prefix hit) and it waits at the head.
"""

from __future__ import annotations

from dataclasses import dataclass
import time

from kvtier.kvcache.manager import KVCacheManager, cdiv
from kvtier.sched.output import ScheduledSeq, SchedulerOutput
from kvtier.sched.queues import make_queue
from kvtier.sched.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits and queue policy."""

    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks plus decode tokens)."""
    policy: str = "fcfs"
    """'fcfs' or 'priority' (lower value first, with aging)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps; otherwise a prompt must fit one step's budget."""
    aging_steps: int = 64
    """Priority policy: a waiting request gains one level per this many steps."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions_total: int = 0
    kv_cache_usage: float = 0.0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = make_queue(config.policy, config.aging_steps)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrivals = 0

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        max_total = req.num_prompt_tokens + (req.sampling.max_tokens or 0)
        if req.max_model_len is not None:
            max_total = min(max_total, req.max_model_len)
        if cdiv(max_total, self.kv.block_size) > self.kv.num_blocks:
            raise ValueError(
                f"request needs up to {max_total} tokens of KV but the device pool holds "
                f"{self.kv.num_blocks * self.kv.block_size}; lower max_tokens or enlarge the pool")
        req.arrival_seq = self._arrivals
        self._arrivals += 1
        self.requests[req.req_id] = req
        req.status = RequestStatus.WAITING
        self.waiting.push(req)

    def add_forked(self, child: Request, parent: Request) -> None:
        """Start one of a parent's n samples from the parent's KV (shared full blocks)."""
        child.arrival_seq = parent.arrival_seq
        self.requests[child.req_id] = child
        child.num_cached_tokens = parent.num_cached_tokens
        if self.kv.fork(parent.req_id, child.req_id, parent.num_computed_tokens):
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            child.first_scheduled_time = parent.first_scheduled_time
            self.running.append(child)
        else:  # no block for the copy: recompute later (mostly a prefix hit)
            child.status = RequestStatus.WAITING
            self.waiting.push(child)

    def abort_request(self, req_id: str) -> Request | None:
        req = self.requests.get(req_id)
        if req is None or req.status.finished:
            return None
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def finish_request(self, req_id: str, status: RequestStatus) -> None:
        req = self.requests.get(req_id)
        if req is not None and not req.status.finished:
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.status.finished:
            self.waiting.remove(req)
        req.status = status
        req.finished_time = time.monotonic()
        self.kv.free(req.req_id)
        del self.requests[req.req_id]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ schedule
    def _rank(self, req: Request) -> tuple[int, int]:
        return (req.priority, req.arrival_seq)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.req_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.push_front(req)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        now = time.monotonic()
        self.running.sort(key=self._rank)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not cfg.enable_chunked_prefill and n < req.num_tokens - req.num_computed_tokens:
                i += 1
                continue
            while not self.kv.allocate_more(req.req_id, req.num_computed_tokens + n):
                victim = self.running[-1]  # least important; never one already scheduled
                self._preempt(victim)
                out.preempted_req_ids.append(victim.req_id)
                if victim is req:
                    break
            else:
                out.seqs.append(self._seq(req, n))
                budget -= n
                i += 1
        if not out.preempted_req_ids:
            budget = self._admit(out, budget, now)
        for req in self.waiting:
            req.waited_steps += 1
        out.block_copies = self.kv.take_copies()
        return out

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        cfg = self.config
        bs = self.kv.block_size
        for req in self.waiting.ordered():
            if len(self.running) >= cfg.max_num_seqs or budget <= 0:
                break
            match = self.kv.match(req.all_token_ids, req.root_key)
            num_cached = match.num_cached_tokens(bs)
            n = req.num_tokens - num_cached
            if n > budget and not cfg.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate_new(req.req_id, req.all_token_ids, req.root_key, match, n):
                break  # head of line waits for blocks; nobody overtakes it
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            out.seqs.append(self._seq(req, n))
            budget -= n
        return budget

    def _seq(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        return ScheduledSeq(
            req_id=req.req_id,
            token_ids=req.all_token_ids[start:start + n],
            start_pos=start,
            block_ids=self.kv.block_ids(req.req_id),
            sample=start + n == req.num_tokens,
        )

    # ------------------------------------------------------------------ update
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance requests by what the step computed; returns requests that finished."""
        finished: list[Request] = []
        now = time.monotonic()
        for seq in out.seqs:
            req = self.requests.get(seq.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += seq.num_tokens
            self.kv.cache_blocks(req.req_id, req.all_token_ids, req.num_computed_tokens)
            if not seq.sample:
                continue
            req.append_output(sampled[req.req_id])
            if req.first_token_time is None:
                req.first_token_time = now
            status = req.check_stop()
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        self.kv.end_step()
        return finished

    # ------------------------------------------------------------------ stats / checks
    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions, self.kv.usage)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        running = {r.req_id for r in self.running}
        waiting = {r.req_id for r in self.waiting}
        assert not running & waiting, "a request is both running and waiting"
        assert running | waiting == set(self.requests), "a live request is neither running nor waiting"
        for req in self.running:
            assert self.kv.has_request(req.req_id), f"running {req.req_id} holds no blocks"
            assert req.num_computed_tokens <= req.num_tokens
        for req in self.waiting:
            assert not self.kv.has_request(req.req_id), f"waiting {req.req_id} holds blocks"
