"""Token-budget scheduler: continuous batching with chunked prefill and preemption.

Each step every request wants `num_tokens - num_computed_tokens` more tokens computed (a
decoding request wants 1). Running requests go first, most important first; then waiting
requests are admitted while the token budget, `max_num_seqs` and the pool allow. A waiting
request whose next uncached block is being computed by a running prefill waits for it instead
of computing it again (requests arriving together with one new shared prefix compute it once;
the others are admitted as prefix hits a step or a few later). There are no prefill or decode
phases. When the pool cannot grow a running request, the least important
running request (lowest priority, then latest arrival) is preempted: its blocks are freed (its
full blocks stay cached, so resuming is mostly a prefix hit) and it waits at the head.
With LoRA, the running (and loading) requests use at most `max_loras` distinct adapters: a
waiting request whose adapter would be one more is passed over (others may go first, as in
vLLM) until a request of another adapter ends or is preempted.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvtier.kvcache.keys import chain_keys
from kvtier.kvcache.manager import KVCacheManager, cdiv
from kvtier.sched.admission import plan_restore
from kvtier.sched.output import ScheduledSeq, SchedulerOutput
from kvtier.sched.queues import make_queue
from kvtier.sched.request import Request, RequestStatus

logger = logging.getLogger("kvtier.sched")


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
    """Decides each step's work (`schedule`) and applies its result (`update_from_output`).

    Owns the live `Request`s and their queues (waiting, running, loading); the KVCacheManager
    it is given holds their blocks, and the tiers (if any) restore stored prefixes. Called by
    EngineCore on the engine thread only (the simulator and tests drive it directly); it is not
    thread-safe. The tiers' futures (loads, remote lookups) complete on other threads and are
    only polled here.

    Invariants (`check_integrity`): every live request is in exactly one queue; running and
    loading requests hold blocks and waiting ones hold none; a running request has computed
    no more tokens than it has; plus KVCacheManager's invariants."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, tiers: Any = None, max_loras: int = 0) -> None:
        self.config = config
        self.kv = kv
        self.tiers = tiers
        """A TierHierarchy (duck-typed: runs/submit_load/cost), or None for device only."""
        self.max_loras = max_loras
        """Most distinct LoRA adapters among the running and loading requests (0: LoRA off)."""
        self.num_lora_waits = 0
        """Times a waiting request was passed over because every adapter slot was taken."""
        self.waiting = make_queue(config.policy, config.aging_steps)
        self.running: list[Request] = []
        self.loading: list[Request] = []
        self.restore_decisions: Counter[str] = Counter()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_failed_loads = 0
        """Restores whose load raised: their blocks were recomputed (each is logged)."""
        self.num_inflight_waits = 0
        """Times a waiting request was held because its next block was being computed by a
        running prefill (it is admitted as a prefix hit once that block is cached)."""
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
                f"{self.kv.num_blocks * self.kv.block_size}; lower max_tokens or enlarge the pool"
            )
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
        # A parent that finished this step (max_tokens=1, a stop token) has freed its KV: the
        # child then waits like a new request (its prompt is a prefix hit) or ends at once.
        if not parent.status.finished and self.kv.fork(parent.req_id, child.req_id, parent.num_computed_tokens):
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            child.first_scheduled_time = parent.first_scheduled_time
            self.running.append(child)
        else:  # no parent KV or no block for the copy: recompute later (mostly a prefix hit)
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
        elif req.status == RequestStatus.LOADING:
            self.loading.remove(req)
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
        req.tier_queried = False
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.push_front(req)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        now = time.monotonic()
        if self.loading:
            self._finish_loads()
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
        out.block_loads = self.kv.take_loads()
        return out

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        cfg = self.config
        bs = self.kv.block_size
        inflight: set[bytes] | None = None  # built when a waiting request first needs it
        admitted: list[tuple[Request, int]] = []  # (request, its first uncached block) admitted here
        adapters: set[bytes] | None = None  # keys of the adapters in use, built when first needed
        for req in self.waiting.ordered():
            if len(self.running) + len(self.loading) >= cfg.max_num_seqs or budget <= 0:
                break
            if req.remote_lookup is not None and not req.remote_lookup.done():
                continue  # its remote lookup is on the way; others may go first meanwhile
            if req.lora is not None:
                if adapters is None:
                    adapters = self._adapters_in_use()
                if req.lora.key not in adapters and len(adapters) >= self.max_loras:
                    self.num_lora_waits += 1
                    continue  # no adapter slot: wait for one to free; others may go first
            if req.sampling.prompt_logprobs is None:
                match = self.kv.match(req.all_token_ids, req.root_key)
            else:  # every prompt position needs its logits: nothing is reused
                match = self.kv.match(req.all_token_ids[:1], req.root_key)
            d = len(match.block_ids)
            if d < (len(req.all_token_ids) - 1) // bs and req.sampling.prompt_logprobs is None:
                # it has blocks a running prefill may be computing
                if inflight is None:
                    inflight = self._inflight_keys()
                for other, first in admitted:
                    inflight.update(self._prompt_keys(other)[first:])
                admitted.clear()
                if inflight and self._prompt_keys(req)[d] in inflight:
                    # its next block is being computed by a running prefill: wait for the hit
                    # rather than compute the same KV twice (a burst sharing a new prefix)
                    self.num_inflight_waits += 1
                    continue
            if self.tiers is not None and req.sampling.prompt_logprobs is None and self._try_restore(req, match, now):
                if adapters is not None and req.lora is not None:
                    adapters.add(req.lora.key)
                continue
            num_cached = match.num_cached_tokens(bs)
            n = req.num_tokens - num_cached
            if n > budget and not cfg.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate_new(
                req.req_id, req.all_token_ids, req.root_key, match, n, req.tenancy, req.lora_request
            ):
                break  # head of line waits for blocks; nobody overtakes it
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_cached
                req.cached_by_tier = {"device": num_cached}
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            out.seqs.append(self._seq(req, n))
            budget -= n
            admitted.append((req, d))
            if adapters is not None and req.lora is not None:
                adapters.add(req.lora.key)
        return budget

    def _adapters_in_use(self) -> set[bytes]:
        """Keys of the LoRA adapters of the running and loading requests (each holds a slot)."""
        return {r.lora.key for r in (*self.running, *self.loading) if r.lora is not None}

    def _prompt_keys(self, req: Request) -> list[bytes]:
        """Chained keys of the full blocks of req.all_token_ids[:-1] (the blocks a later request
        can hit; the last token is always computed), cached on the request."""
        bs = self.kv.block_size
        num_full = (len(req.all_token_ids) - 1) // bs
        keys = req.tier_keys
        if keys is None or len(keys) < num_full:
            keys = req.tier_keys = chain_keys(req.root_key, req.all_token_ids, bs, num_blocks=num_full)
        return keys[:num_full]

    def _inflight_keys(self) -> set[bytes]:
        """Keys of the blocks running prefills hold but have not computed yet."""
        bs = self.kv.block_size
        keys: set[bytes] = set()
        for req in self.running:
            done, num_full = req.num_computed_tokens // bs, (len(req.all_token_ids) - 1) // bs
            if done < num_full:
                keys.update(self._prompt_keys(req)[done:num_full])
        return keys

    # ------------------------------------------------------------------ tiers below
    def _try_restore(self, req: Request, match, now: float) -> bool:
        """Start restoring the stored blocks after the device prefix if the cost model says it
        beats recomputing them; the request then waits in `loading`. False: admit as usual."""
        bs = self.kv.block_size
        tokens = req.all_token_ids
        num_full = (len(tokens) - 1) // bs
        keys = self._prompt_keys(req)
        d = len(match.block_ids)
        remote = req.remote_lookup.result() if req.remote_lookup is not None else 0
        # one counted query per admission, as the device's: a request that waits for space
        # and tries again is not a new query (nor a new decision)
        first = not req.tier_queried
        req.tier_queried = True
        plan = plan_restore(self.tiers, keys[:num_full], d, d * bs, len(tokens), remote_prefix=remote, count=first)
        decision = plan.decision
        if first:
            self.restore_decisions[decision.kind] += 1
        if req.restore_decision is None:
            req.restore_decision = decision.kind
        if decision.num_blocks == 0:
            return False
        k = decision.num_blocks
        restore_keys = keys[d : d + k]
        if not self.kv.allocate_restore(
            req.req_id, tokens, req.root_key, match, restore_keys, req.tenancy, req.lora_request
        ):
            return False
        req.load_future = self.tiers.submit_load(restore_keys, plan.load_runs(), owner=req.tenancy)
        req.restore_keys = restore_keys
        self.waiting.remove(req)
        self.loading.append(req)
        req.status = RequestStatus.LOADING
        req.num_computed_tokens = d * bs
        if req.num_cached_tokens is None:
            req.num_cached_tokens = d * bs
            req.cached_by_tier = {"device": d * bs}
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        return True

    def _finish_loads(self) -> None:
        """Move requests whose restore finished to running (failed blocks are recomputed)."""
        bs = self.kv.block_size
        for req in [r for r in self.loading if r.load_future.done()]:
            try:
                result = req.load_future.result()
                tensors, per_tier = result.tensors, result.per_tier
                req.restore_s += result.seconds + result.queue_s
            except Exception:  # a broken load is a miss: recompute, and say so
                self.num_failed_loads += 1
                logger.warning(
                    "request %s: restoring %d blocks from the tiers failed; they are recomputed",
                    req.req_id,
                    len(req.restore_keys or ()),
                    exc_info=True,
                )
                tensors, per_tier = [], {}
            assert req.restore_keys is not None and req.num_cached_tokens is not None  # set by _try_restore
            n = self.kv.finish_restore(req.req_id, req.restore_keys, tensors)
            req.num_computed_tokens += n * bs
            if req.num_preemptions == 0:  # the first admission is what the request reports
                for name, count in per_tier.items():
                    req.cached_by_tier[name] = req.cached_by_tier.get(name, 0) + count * bs
                req.num_cached_tokens += n * bs
            req.load_future = None
            req.restore_keys = None
            self.loading.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING

    def pending_futures(self) -> list[Any]:
        """Background work the scheduler is waiting for (loads, remote lookups)."""
        out = [r.load_future for r in self.loading]
        out += [r.remote_lookup for r in self.waiting if r.remote_lookup is not None and not r.remote_lookup.done()]
        return out

    def _seq(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        return ScheduledSeq(
            req_id=req.req_id,
            token_ids=req.all_token_ids[start : start + n],
            start_pos=start,
            block_ids=self.kv.block_ids(req.req_id),
            sample=start + n == req.num_tokens,
            lora=req.lora,
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
        loading = {r.req_id for r in self.loading}
        assert not running & waiting and not loading & (running | waiting), "a request is in two queues"
        assert running | waiting | loading == set(self.requests), "a live request is in no queue"
        for req in self.loading:
            assert self.kv.has_request(req.req_id), f"loading {req.req_id} holds no blocks"
        for req in self.running:
            assert self.kv.has_request(req.req_id), f"running {req.req_id} holds no blocks"
            assert req.num_computed_tokens <= req.num_tokens
        for req in self.waiting:
            assert not self.kv.has_request(req.req_id), f"waiting {req.req_id} holds blocks"
        in_use = self._adapters_in_use()
        assert len(in_use) <= self.max_loras, f"{len(in_use)} LoRA adapters in use; max_loras is {self.max_loras}"
