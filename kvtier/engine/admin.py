"""EngineAdmin: the administration calls a serving front-end makes on an EngineCore (purges,
TTL sweeps, usage, integrity checks, fleet keys, the metrics' EngineStats), run by the one
engine loop (kvtier.engine.loop, on the server's engine thread or in the engine process). The
front-ends reach the core's tiers and tenant administration only through here (`core.admin`),
never through `core.tiers`.

Every `begin_*` runs its engine part at once and returns what it has now with the future of
the tier part, run on the tiers' admin worker (one thread, jobs in order; None without tiers):
the answer is the future's result when there is one, else what came back now::

    now, future = core.admin.begin_usage(tenant)        # on the engine thread, between steps
    answer = now if future is None else future.result()  # (or await asyncio.wrap_future)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.engine.stats import LoRACounters, PromptCacheStats

if TYPE_CHECKING:
    from kvtier.engine.core import EngineCore
    from kvtier.outputs import RequestOutput

logger = logging.getLogger("kvtier.engine")


@dataclass
class TierCounters:
    """One tier's counters (a copy of its TierStats' numbers)."""

    lookups: int = 0
    lookup_hits: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    corrupt: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class DriftCounters:
    """The KV drift monitor's aggregates (kvtier.engine.drift.DriftStats), as numbers."""

    mean_kl: float
    kl_max: float
    top1_agreement: float
    num_samples: int
    num_tokens: int
    shadow_s: float
    kl_buckets: list[float]
    kl_bucket_counts: list[int]
    request_kl_sum: float


@dataclass
class EngineStats:
    """What the metrics scrape reads of an engine, copied at one moment (plain numbers, so it
    crosses the process boundary as msgpack): kvtier.server.metrics renders it."""

    block_size: int
    num_blocks: int
    kv_usage: float
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    iteration_token_buckets: list[int]
    iteration_token_counts: list[int]
    num_batched_tokens: int
    cache_info: dict[str, str]
    """The cache configuration's labels (cache_config_info)."""
    tier_usage: dict[str, tuple[int, int | None]]
    """Per tier: (bytes used, capacity or None)."""
    tiers: dict[str, TierCounters]
    num_preemptions: int
    restore_decisions: dict[str, int]
    restore_failures: int
    num_running: int
    num_waiting: int
    num_loading: int
    drift: DriftCounters | None = None
    prompt_cache: PromptCacheStats = field(default_factory=PromptCacheStats)
    """Where the prompt tokens of num_prompt_tokens came from (kvtier.engine.stats)."""
    lora: LoRACounters | None = None
    """With LoRA on: the adapters in use."""


class EngineAdmin:
    """The administration of one EngineCore (`core.admin`).

    Threads: methods marked "engine thread" run on the thread that steps the core, between
    steps (the front-ends queue them there); the others run on any thread and touch no
    engine state (only the tiers, which lock themselves)."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    @property
    def _tiers(self) -> Any:
        return getattr(self._core, "tiers", None)

    @property
    def has_tiers(self) -> bool:
        """Whether the engine has tiers below the device (any thread)."""
        return self._tiers is not None

    def apply_settings(
        self,
        tenant_ttls: Iterable[tuple[str, float]] = (),
        tenant_quotas: Iterable[tuple[str, int | None, int | None]] = (),
        fleet_keys: tuple[str, float] | None = None,
    ) -> None:
        """The serving settings, before any request: fleet keys (master key file, check
        interval), the tenants' TTLs and host/disk quotas (engine thread, or before it runs)."""
        if fleet_keys:
            self.use_fleet_keys(fleet_keys[0], fleet_keys[1])
        for tenant, ttl in tenant_ttls:
            self._core.tenants.set_ttl(tenant, ttl)
        for tenant, host_bytes, disk_bytes in tenant_quotas:
            self._core.tenants.set_quota(tenant, host_bytes, disk_bytes)

    # ------------------------------------------------------------------ purges, sweeps, usage
    def retry_pending_purges(self) -> Future | None:
        """Purges left pending (a tier was unreachable) retried on the admin worker, ahead of
        what is submitted after; None when none is pending (any thread)."""
        tiers = self._tiers
        if tiers is None or not tiers.tenants.pending_purges():
            return None
        return tiers.tenants.submit_admin(tiers.tenants.retry_pending_purges)

    def begin_purge(
        self, tenant: str | None, every_tenant: bool = False
    ) -> tuple[list[RequestOutput], dict[str, Any], Future | None]:
        """Abort the tenant's (every tenant's) requests and run the engine part of its purge
        (engine thread): the aborted requests' final outputs, the counts so far and the future
        of the whole counts once the tier part is done."""
        core = self._core
        outs = [o for o in (core.abort_all() if every_tenant else core.abort_tenant(tenant)) if o is not None]
        counts, future = core.tenants.begin_purge_all() if every_tenant else core.tenants.begin_purge(tenant)
        counts["aborted_requests"] = len(outs)
        return outs, counts, None if future is None else _then(future, lambda tier_counts: {**counts, **tier_counts})

    def begin_sweep(self) -> Future | None:
        """The TTL sweep (engine thread: the device part now, the tiers' on the admin worker)
        and a retry of pending purges; the future is done when both are (its result is None)."""
        _, sweep = self._core.tenants.begin_sweep_expired()
        retry = self.retry_pending_purges()  # after the sweep's tier part (one admin worker)
        futures = [f for f in (sweep, retry) if f is not None]
        if not futures:
            return None
        return _then(futures[0] if len(futures) == 1 else _after(*futures), lambda _: None)

    def begin_usage(self, tenant: str | None) -> tuple[dict[str, Any], Future | None]:
        """The tenant's cached KV per tier (engine thread): {"device": ...} now; the future of
        every tier's, once the stores of the requests answered so far are counted."""
        now: dict[str, Any] = {"device": self._core.tenants.device_usage(tenant)}
        tiers = self._tiers
        if tiers is None:
            return now, None

        def tier_usage() -> dict[str, Any]:
            tiers.flush(5.0)  # count what the requests answered so far have stored
            return {**now, **tiers.tenants.owner_usage(tenant)}

        return now, tiers.tenants.submit_admin(tier_usage)

    def integrity_report(self) -> dict[str, Any]:
        """The engine's invariant checks (AssertionError when one fails) and its pool's state
        (engine thread, with no request in flight)."""
        core = self._core
        core.check_integrity()
        return {
            "ok": True,
            "kv_cache_usage_perc": core.kv.usage,
            "num_free_blocks": core.kv.num_free_blocks,
            "num_blocks": core.kv.num_blocks,
            "num_unfinished": core.num_unfinished,
        }

    def stats(self) -> EngineStats:
        """The engine's counters now (any thread: plain reads of counters the engine thread
        updates; a dict it resizes meanwhile is copied again)."""
        core = self._core
        kv, sched, tiers = core.kv, core.scheduler, self._tiers
        st, cc, tc = core.step_stats, core.config.cache, core.config.tiers
        tier_stats = tiers.tier_stats() if tiers is not None else {}
        drift = getattr(core, "drift", None)
        return EngineStats(
            block_size=kv.block_size,
            num_blocks=kv.num_blocks,
            kv_usage=kv.usage,
            prefix_queries_tokens=kv.stats.queries_tokens,
            prefix_hits_tokens=kv.stats.hits_tokens,
            num_prompt_tokens=st.num_prompt_tokens,
            num_generation_tokens=st.num_generation_tokens,
            iteration_token_buckets=list(core.ITERATION_TOKEN_BUCKETS),
            iteration_token_counts=list(st.iteration_token_counts),
            num_batched_tokens=st.num_batched_tokens,
            cache_info={
                "block_size": str(kv.block_size),
                "cache_dtype": str(cc.kv_cache_dtype),
                "num_gpu_blocks": str(kv.num_blocks),
                "enable_prefix_caching": str(cc.enable_prefix_caching),
                "eviction_policy": str(cc.eviction_policy),
                "host_cache_bytes": str(tc.host_cache_bytes or 0),
                "disk_cache_bytes": str(tc.disk_cache_bytes or 0) if tc.disk_cache_dir else "0",
                "remote_cache": str(bool(tc.remote_cache_url)),
            },
            tier_usage=dict(tiers.usage()) if tiers is not None else {},
            tiers={
                name: TierCounters(t.lookups, t.lookup_hits, t.bytes_read, t.bytes_written, t.corrupt, _copy(t.errors))
                for name, t in tier_stats.items()
            },
            num_preemptions=sched.num_preemptions,
            restore_decisions=_copy(sched.restore_decisions),
            restore_failures=getattr(sched, "num_failed_loads", 0),
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_loading=len(sched.loading),
            drift=None if drift is None else _drift_counters(drift),
            prompt_cache=st.prompt_cache.copy(),
            lora=_lora_counters(sched) if sched.max_loras else None,
        )

    # ------------------------------------------------------------------ fleet keys
    def use_fleet_keys(self, master_key_file: str, check_interval_s: float = 1.0) -> None:
        """Switch the tiers to fleet keys (kvtier.tiers.keyring) before any request runs."""
        self._tiers.use_fleet_keys(master_key_file, check_interval_s)

    @property
    def checks_keys(self) -> bool:
        """Whether data keys are re-read before requests (fleet keys): `refresh_keys`."""
        tiers = self._tiers
        return tiers is not None and getattr(tiers.sealing.keys, "refresh", None) is not None

    def refresh_keys(self, tenants: Iterable[str | None]) -> None:
        """Fleet keys: re-read these tenants' data keys if stale, so that a purge made by
        another instance is seen before their requests run (blocking I/O; any thread; a
        revocation is applied by `drop_revoked`)."""
        tiers = self._tiers
        if tiers is None:
            return
        for tenant in tenants:
            tiers.sealing.refresh_key(tenant)

    @property
    def key_check_interval_s(self) -> float | None:
        """With fleet keys: how often the periodic key check (`begin_check_keys`) is due."""
        tiers = self._tiers
        fleet = None if tiers is None else tiers.sealing.fleet_keys
        return None if fleet is None else fleet.check_interval_s

    def begin_check_keys(self) -> Future | None:
        """The periodic fleet key check: every cached data key re-read on the admin worker
        (any thread); then `drop_revoked` on the engine thread. None without fleet keys."""
        tiers = self._tiers
        fleet = None if tiers is None else tiers.sealing.fleet_keys
        return None if fleet is None else tiers.tenants.submit_admin(fleet.refresh_all)

    def drop_revoked(self) -> list[RequestOutput]:
        """Fleet keys another instance destroyed: drop this instance's copies of those tenants
        (their requests are aborted, as in a purge; the remote tier was purged by the other
        instance). Engine thread; returns the aborted requests' final outputs."""
        tiers = self._tiers
        if tiers is None or not tiers.sealing.revoked_owners:
            return []
        core = self._core
        outs: list[RequestOutput] = []
        for tenant in tiers.sealing.take_revoked():
            outs += [o for o in core.abort_tenant(tenant) if o is not None]
            core.tenants.begin_purge(tenant, everywhere=False)
            logger.info("a purge elsewhere destroyed a tenant's data key; its local KV was dropped")
        return outs


def _then(future: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of `fn(future.result())` (or of its error)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            out.set_exception(e)

    future.add_done_callback(done)
    return out


def _after(first: Future, last: Future) -> Future:
    """A future of `last`'s result once both are done; `first`'s error wins."""
    out: Future = Future()

    def finish(f: Future) -> None:
        error = first.exception() or f.exception()
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(f.result())

    first.add_done_callback(lambda _: last.add_done_callback(finish))
    return out


def _copy(d: dict) -> dict:
    """A copy of a dict the engine thread may be changing (a resize mid-copy raises; retry)."""
    for _ in range(10):
        try:
            return dict(d)
        except RuntimeError:
            continue
    return {}


def _lora_counters(sched: Any) -> LoRACounters:
    """The adapters of the scheduler's running and waiting requests (its queues copied again
    when the engine thread changes one meanwhile)."""
    for _ in range(10):
        try:
            running = {r.lora.name for r in list(sched.running) if r.lora is not None}
            waiting = {r.lora.name for r in [*sched.waiting, *sched.loading] if r.lora is not None}
            break
        except RuntimeError:
            continue
    else:
        running, waiting = set(), set()
    return LoRACounters(sched.max_loras, sorted(running), sorted(waiting), time.time())


def _drift_counters(drift: Any) -> DriftCounters:
    st = drift.stats
    return DriftCounters(
        mean_kl=st.mean_kl,
        kl_max=st.kl_max,
        top1_agreement=st.top1_agreement,
        num_samples=st.num_samples,
        num_tokens=st.num_tokens,
        shadow_s=st.shadow_s,
        kl_buckets=list(drift.KL_BUCKETS),
        kl_bucket_counts=list(st.kl_bucket_counts),
        request_kl_sum=st.request_kl_sum,
    )
