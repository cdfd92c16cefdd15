"""The connector in vLLM's scheduler process: per request, how many tokens to load from the
tiers (kvtier's `plan_restore` over the workers' tiers), and per step, which newly full blocks
the workers save; it learns the workers' host keys and measured speeds from their reports.

What it plans from is kept true to what the workers hold, so that no restore is planned that
cannot happen:

    host     the workers' reports of keys added and removed (a failed load removes the blocks
             it did not bring, see worker.py), and purges: the scheduler polls the purge
             requests itself (purges.PurgePoller) and drops the purged tenant's keys before its
             next lookup (it knows each key's tenant: it planned its store or load); a worker's
             report of a purge does the same, whichever comes first
    disk     the files themselves (a purge deletes them; a failed load's later blocks are deleted)
    Redis    asked directly

Counted here: the planned tokens of a load (`planned_hit_tokens`, at the plan) and, once the
load is reported finished, the tokens that arrived (`hit_tokens`, the fewest any rank brought)
and those that did not (`failed_hit_tokens`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.cost.model import CostModel
from kvtier.identity import Tenancy
from kvtier.integrations.vllm.config import kv_events_on
from kvtier.integrations.vllm.keys import KeyChains, rank_fingerprint, request_salt, world_size
from kvtier.integrations.vllm.lookup import WorkerTiers
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMeta, LoadSpec, StoreSpec
from kvtier.integrations.vllm.purges import PurgePoller
from kvtier.integrations.vllm.stats import KVTierStats
from kvtier.kv_events import KVEventRecorder
from kvtier.sched.admission import RestorePlan, plan_restore
from kvtier.tiers.fence import ALL
from kvtier.tiers.hierarchy import TIER_ORDER, TierConfig
from kvtier.tiers.owners import owner_id

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class _ReqState:
    request: Request
    salt: str | None
    keys: list[bytes] = field(default_factory=list)
    saved: int = 0
    """Blocks [0, saved) are stored below (or queued): no need to save them again."""
    loading: int = 0
    """Blocks of the load in flight (the request waits for it)."""
    load_start: int = 0
    load_tiers: list[str] = field(default_factory=list)
    arrived: int = 0
    """Of the load in flight, the fewest blocks any rank reported arrived so far."""
    load_short: bool = False
    """A load of this request came back short: it is not loaded again (vLLM recomputes), so a
    view of the tiers the workers do not share cannot retry the same load forever."""

    @property
    def oid(self) -> str:
        return owner_id(self.salt)


@dataclass
class _Lookup:
    device_blocks: int
    remote_prefix: int
    plan: RestorePlan


def _cacheable(request: Request) -> bool:
    """KV that depends on more than the token ids (images, prompt embeddings) is never stored
    and never restored."""
    return not request.mm_features and getattr(request, "prompt_embeds", None) is None


def _scheduled(scheduler_output: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(req_id, computed tokens, tokens computed this step) of this step's requests; draft
    (speculative) tokens are not counted."""
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    cached = scheduler_output.scheduled_cached_reqs
    reqs = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
    reqs += list(zip(cached.req_ids, cached.num_computed_tokens))
    return [
        (req_id, computed, scheduler_output.num_scheduled_tokens.get(req_id, 0) - len(spec.get(req_id, ())))
        for req_id, computed in reqs
    ]


class SchedulerSide:
    """Restore decisions and save choices (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        tier_config: TierConfig,
        options: dict[str, Any],
        fingerprint: bytes,
    ) -> None:
        self.config = tier_config
        self.block_size = int(vllm_config.cache_config.block_size)
        group = kv_cache_config.kv_cache_groups[0]
        block_bytes = int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
        """Bytes of one block on one rank (all of its layers): what one rank reads per block."""
        self.names = [
            n
            for n in TIER_ORDER
            if (n == "host" and tier_config.host_cache_bytes)
            or (n == "disk" and tier_config.disk_cache_dir)
            or (n == "remote" and tier_config.remote_cache_url)
        ]
        self.cost = CostModel(self.names, block_bytes, self.block_size)
        rank_fps = [rank_fingerprint(fingerprint, r) for r in range(world_size(vllm_config))]
        self.tiers = WorkerTiers(tier_config, self.cost, rank_fps, options["remote_lookup_wait_s"])
        self.chains = KeyChains(fingerprint, self.block_size)
        self.reqs: dict[str, _ReqState] = {}
        self.lookups: dict[str, _Lookup] = {}
        self.pending_loads: list[LoadSpec] = []
        self.inflight: dict[str, int] = {n: 0 for n in self.names}
        self.stats = KVTierStats()
        self.events = KVEventRecorder(self.block_size, None) if kv_events_on(vllm_config) else None
        """kvtier's tiers as KV events (kvtier.kv_events), handed to vLLM's publisher by
        `take_events`; None unless vLLM publishes KV events."""
        role = options.get("role", "kv_both")
        self.loads = role != "kv_producer"
        """kv_producer (a prefill instance) plans no loads."""
        self.stores = role != "kv_consumer"
        """kv_consumer (a decode instance) saves nothing."""
        self.reset_tiers: tuple[str, ...] = tuple(options.get("reset_tiers", ("host", "disk")))
        self.world = len(rank_fps)
        self.pending_reset: list[str] | None = None
        self.resets_awaited = 0
        self.purges = PurgePoller(
            tier_config.disk_cache_dir or tier_config.key_dir,
            tier_config.remote_cache_url,
            options["purge_check_interval_s"],
            name="kvtier-vllm-purges-sched",
        )
        """`kvtier cache purge` requests, polled on their own thread (an idle vLLM learns too)."""

    def _take_purges(self, oids: list[str]) -> None:
        """Tenants purged: their keys leave the host mirror (the disk files and Redis entries
        are gone already; the purge deleted them), and the KV events say so."""
        for oid in oids:
            self.tiers.host.drop_owner(oid)
            if self.events is not None:
                if oid == ALL:
                    self.events.purge_all()
                else:
                    self.events.purge_owner(oid)

    def _describe(self, st: _ReqState, keys: list[bytes], first: int) -> None:
        """Tell the KV event recorder the parent and tokens of keys[first:] (chain positions
        first, first + 1, ...), so the workers' tier stores of them can be announced."""
        if self.events is None:
            return
        bs, tokens = self.block_size, st.request.all_token_ids
        chain = self._keys(st, first + len(keys))
        owner = Tenancy(None, st.salt, st.oid)
        lora = st.request.lora_request  # vLLM's own events of these blocks carry its id and name
        for i in range(first, first + len(keys)):
            parent = chain[i - 1] if i else self.chains.root(st.salt)
            self.events.describe(chain[i], parent, tokens[i * bs : (i + 1) * bs], i == 0, owner, lora)

    def take_events(self) -> list[Any]:
        """The KV events of kvtier's tiers since the last call (vLLM publishes them with its own)."""
        return self.events.take() if self.events is not None else []

    def _state(self, request: Request) -> _ReqState:
        st = self.reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _ReqState(request, request_salt(request))
            self.reqs[request.request_id] = st
        return st

    def _keys(self, st: _ReqState, num_blocks: int) -> list[bytes]:
        return self.chains.extend(st.keys, st.request.all_token_ids, st.salt, num_blocks)

    # -- loads -------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens to load after vLLM's own prefix hit, and whether the load is asynchronous;
        (None, False) while Redis has not answered (vLLM asks again next step)."""
        if not self.loads or not _cacheable(request):
            return 0, False
        bs = self.block_size
        num_tokens = request.num_tokens
        usable = (num_tokens - 1) // bs  # the last token is always computed
        device = num_computed_tokens // bs
        if usable <= device:
            self.lookups.pop(request.request_id, None)
            return 0, False
        self._take_purges(self.purges.take())
        st = self._state(request)
        if st.load_short:
            return 0, False
        keys = self._keys(st, usable)
        remote_prefix = 0
        if self.tiers.remotes and device + sum(r.num_blocks for r in self.tiers.runs(keys, device)) < usable:
            found = self.tiers.remote_prefix(request.request_id, keys, device)  # Redis may have more
            if found is None:
                return None, False
            remote_prefix = found
        self._update_queue_estimates()
        plan = plan_restore(self.tiers, keys, device, device * bs, num_tokens, remote_prefix=remote_prefix)
        self.lookups[request.request_id] = _Lookup(device, remote_prefix, plan)
        n = plan.num_blocks * bs
        return n, n > 0

    def _update_queue_estimates(self) -> None:
        workers = max(self.config.io_threads, 1)
        for name in self.names:
            self.cost.queue_s[name] = self.inflight[name] * self.cost.tiers[name].job_s.get(0.0) / workers

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: queue its load (sent with the next metadata)."""
        if not _cacheable(request):
            return
        st = self._state(request)
        lookup = self.lookups.pop(request.request_id, None)
        self.tiers.forget(request.request_id)
        if lookup is None:
            return  # the second call of an asynchronous load, or nothing was looked up
        self.stats.add("lookups")
        runs, decision = lookup.plan.runs, lookup.plan.decision
        st.saved = max(st.saved, lookup.device_blocks + lookup.plan.num_stored_blocks)
        if decision.kind in ("recompute", "partial"):
            self.stats.add("decisions_" + decision.kind)
        if num_external_tokens <= 0:
            return
        if decision.kind == "restore":
            self.stats.add("decisions_restore")  # a plan: what arrived is counted when it is done
        k = num_external_tokens // self.block_size
        start = lookup.device_blocks
        block_ids = list(blocks.get_block_ids()[0])
        keys = self._keys(st, start + k)[start:]
        remote = max(0, min(lookup.remote_prefix - start, k))
        self.pending_loads.append(LoadSpec(request.request_id, keys, block_ids[start : start + k], st.salt, remote))
        self._describe(st, keys, start)
        if "host" in self.names:
            self.tiers.host.note_owner(keys, st.oid)  # a load from below promotes to host
        st.loading, st.load_start, st.arrived = k, start, k
        st.load_tiers = sorted({run.tier for run in runs})
        self.stats.add("planned_hit_tokens", num_external_tokens)
        for name in st.load_tiers:
            self.inflight[name] += 1

    # -- the step's metadata -----------------------------------------------------------------------
    def build_meta(self, scheduler_output: SchedulerOutput, kv_cache_manager: Any) -> KVTierMetadata:
        """The loads queued since the last step, the newly full blocks to save, and the step's
        prefill features (timed by the workers)."""
        meta = KVTierMetadata(loads=self.pending_loads, reset=self.pending_reset)
        self.pending_loads, self.pending_reset = [], None
        self._take_purges(self.purges.take())  # a purged tenant's blocks are saved again
        x0 = x1 = 0.0
        prefill = False
        for req_id, computed, n in _scheduled(scheduler_output):
            if n <= 0:
                continue
            prefill = prefill or n > 1
            a, b = self.cost.prefill.features(n, computed)
            x0 += a
            x1 += b
            store = self._newly_full(req_id, computed + n, kv_cache_manager) if self.stores else None
            if store is not None:
                meta.stores.append(store)
        meta.step_features = (x0, x1) if prefill else (0.0, 0.0)  # time only steps that prefill
        return meta

    def _newly_full(self, req_id: str, computed: int, kv_cache_manager: Any) -> StoreSpec | None:
        """The blocks of the request that became full this step and no tier holds yet."""
        st = self.reqs.get(req_id)
        if st is None or st.loading or kv_cache_manager is None:
            return None
        full = min(computed, st.request.num_tokens) // self.block_size
        if full <= st.saved:
            return None
        block_ids = kv_cache_manager.get_blocks(req_id).get_block_ids()[0]
        keys = self._keys(st, full)
        # blocks a device hit brought are often stored already: copy out only the missing ones
        todo = [i for i in range(st.saved, full) if not self.tiers.stored_locally(keys[i])]
        st.saved = full
        if not todo:
            return None
        self.stats.add("stores")
        self.stats.add("store_blocks", len(todo))
        spec = StoreSpec([keys[i] for i in todo], [block_ids[i] for i in todo], st.salt)
        for i in todo:
            self._describe(st, [keys[i]], i)
        if "host" in self.names:
            self.tiers.host.note_owner(spec.keys, st.oid)
        return spec

    # -- the workers' reports ----------------------------------------------------------------------
    def update_output(self, output: KVConnectorOutput) -> None:
        """Take in the workers' reports and the loads vLLM saw finish."""
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMeta):
            self._take_report(meta)
        for req_id in output.finished_recving or ():
            st = self.reqs.get(req_id)
            if st is not None and st.loading:
                bs = self.block_size
                self.stats.add("hit_tokens", st.arrived * bs)
                if st.arrived < st.loading:
                    self.stats.add("failed_hit_tokens", (st.loading - st.arrived) * bs)
                st.loading = 0
        for name in self.inflight:  # loads finished: recount from the requests still loading
            self.inflight[name] = 0
        for st in self.reqs.values():
            if st.loading:
                for name in st.load_tiers:
                    self.inflight[name] += 1

    def _take_report(self, meta: KVTierWorkerMeta) -> None:
        if meta.resets:
            if "host" in self.tiers.hidden:
                self.tiers.host.clear()  # the report's host keys are those stored after the reset
            self._resets_done(meta.resets)
        self.tiers.host.update(meta.host_added, meta.host_removed)
        if self.events is not None:
            for name, key, present in meta.tier_changes:
                self.events.tier_watch(name)(key, present)
        self._take_purges(meta.purged)
        for x0, x1, seconds in meta.prefill:
            self.cost.prefill.observe((x0, x1), seconds)
        for name, (bw, job) in meta.speeds.items():
            if name == "h2d":
                self.cost.h2d.value = bw
            elif name in self.cost.tiers:
                speed = self.cost.tiers[name]
                speed.read_bytes_per_s.value = bw
                speed.job_s.value = job
        for req_id, arrived in meta.loaded.items():
            st = self.reqs.get(req_id)
            if st is not None and st.loading:
                st.arrived = min(st.arrived, arrived)
                if arrived < st.loading:
                    st.load_short = True
                    # vLLM recomputes the rest (the workers dropped it): save it again once computed
                    st.saved = min(st.saved, st.load_start + arrived)

    # -- vLLM's reset_prefix_cache(reset_external=True) --------------------------------------------
    def reset(self) -> bool:
        """Clear this instance's tiers of `reset_tiers` (default host and disk): the workers
        clear them at the start of the next step; until every rank reports it done, lookups and
        save choices do not see those tiers, so no restore is planned from a cleared tier. The
        tiers not in `reset_tiers` (Redis by default: other instances use it) are kept."""
        cleared = [n for n in self.names if n in self.reset_tiers]
        kept = [n for n in self.names if n not in self.reset_tiers]
        if self.pending_reset is None:  # a reset not sent yet takes this one in: one report per rank
            self.resets_awaited += self.world
        self.pending_reset = sorted(set(self.pending_reset or []) | set(cleared))
        self.tiers.hidden.update(cleared)
        if "host" in cleared:
            self.tiers.host.clear()
        logger.info(
            "kvtier connector: reset_cache: clearing %s of this instance on every rank; kept %s "
            "(reset_tiers in kv_connector_extra_config)",
            cleared or "no tier",
            kept or "no tier",
        )
        return True

    def _resets_done(self, n: int) -> None:
        self.resets_awaited = max(0, self.resets_awaited - n)
        if not self.resets_awaited and self.pending_reset is None:
            self.tiers.hidden.clear()

    def request_finished(self, request: Request) -> None:
        self.reqs.pop(request.request_id, None)
        self.lookups.pop(request.request_id, None)
        self.tiers.forget(request.request_id)

    def take_stats(self) -> KVTierStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVTierStats()
        return out

    def close(self) -> None:
        self.purges.stop()
        self.tiers.close()
