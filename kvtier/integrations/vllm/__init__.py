"""kvtier's tiers inside vLLM: a V1 KV connector.

    vllm serve MODEL --enable-prefix-caching --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_cache_bytes": "8GiB", "disk_cache_dir": "/var/cache/kvtier"}}'

vLLM keeps its own device pool and prefix cache; the connector adds kvtier's host, disk and
Redis tiers below it, with kvtier's cost model deciding per request whether a stored prefix is
worth reading back. vLLM runs the connector twice, often in two processes:

    scheduler process (EngineCore)                    worker process (one per rank)
    ------------------------------                    -----------------------------
    SchedulerSide (scheduler.py)                      WorkerSide (worker.py)
      chained kvtier keys per request (keys.py)         TierHierarchy: host, disk, remote,
      WorkerTiers (lookup.py): host (a mirror of          codec, encryption, purge fences
        the workers' host keys), disk (the files),        (purges.py), I/O threads
        Redis; plan_restore -> n tokens to load         loads: read blocks on the I/O threads
      which newly full blocks to save                     and copy them into vLLM's blocks
           |  KVTierMetadata (loads, stores,              saves: copy newly full blocks out of
           v  this step's prefill work) -------------->     vLLM's blocks after the forward
           ^  (metadata.py)                                 and hand them to the hierarchy
           '------ KVTierWorkerMeta (host keys in/out, measured speeds, what each load
                   brought, tenants purged)

- Keys: kvtier's chain (kvcache/keys.py) over vLLM's blocks, rooted in a fingerprint of the
  model, dtypes, block size, KV layout and parallel layout, and in the request's `cache_salt`
  (the tenant: it also picks the data key that encrypts the blocks at rest). Each rank stores
  its own shard under its own tier fingerprint.
- Lookups and the restore decision are the engine's: `plan_restore` (kvtier/sched/admission.py)
  over the scheduler's view of the workers' tiers, whose runs are `stored_runs`
  (kvtier/tiers/runs.py), the lookup of `TierHierarchy.runs`; the cost model runs on speeds
  the workers measured (tier reads, the copy into vLLM's pool, prefill seconds per step): 0
  tokens when recomputing is faster, partial when only the first blocks are worth reading.
- Loads are asynchronous: `get_num_new_matched_tokens` answers `(n, True)`, the request waits in
  WAITING_FOR_REMOTE_KVS while others run, and `get_finished` reports it done. A block that
  does not arrive (a miss, a corrupt frame, a tier down) is reported by
  `get_block_ids_with_load_errors`, and vLLM recomputes from there: never wrong KV.
- What the scheduler plans from is what the workers hold: a load that comes up short drops the
  blocks after its first missing one from the worker's tiers (recomputed and stored again: a
  corrupt chain is repaired in one visit), and both sides poll `kvtier cache purge` requests
  (purges.py): the scheduler drops the purged tenant's keys from its host mirror before its next
  lookup, the workers purge their host tier and drop the deleted files from their disk index.
- Counters and gauges (stats.py) on vLLM's /metrics: `hit_tokens` counts tokens that arrived,
  `planned_hit_tokens` the plans; the tiers' usage, bytes written, evictions and purges as
  kvtier's own server shows them.
- Saves copy each newly full block out of vLLM's pool in `wait_for_save` (after the step's
  forward), so vLLM may free a finished request's blocks at once; the disk and Redis writes
  run in the background.

- Roles: `kv_role` kv_both stores and loads, kv_producer (a prefill instance) only stores and
  ends a step that stored once its blocks are written, kv_consumer (a decode instance) only
  loads; a pair that shares a tier and kvtier.integrations.vllm_pd_proxy in front is prefill/
  decode disaggregation. `reset_cache` (reset_prefix_cache(reset_external=True)) clears the tiers
  of `reset_tiers` (default host and disk) on every rank and keeps the others (Redis), logged.
  Inside vLLM's MultiConnector: importing this package registers the class by name with vLLM's
  connector factory (MultiConnector rebuilds its children's stats by name).
- KV events: with vLLM's `--kv-events-config`, rank 0's worker reports its tiers' stores and
  removals (`KVTierWorkerMeta.tier_changes`), the scheduler side turns them into vLLM-format
  events with the tokens it planned (kvtier.kv_events.KVEventRecorder) and `take_events` hands
  them to vLLM's publisher, beside vLLM's own device events: one stream for KV-aware routers.

This module is the class vLLM instantiates, delegating to the side its role runs; the other
modules: compat (vLLM's base classes, version check), config (extra-config parsing), keys,
lookup, scheduler, metadata, worker, purges, stats (vLLM's connector stats and /metrics).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvtier.integrations.vllm.compat import (
    TESTED_VLLM_VERSIONS,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorPromMetrics,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    check_vllm_version,
    log_through_vllm,
    to_vllm_events,
)
from kvtier.integrations.vllm.config import (
    EXTRA_CONFIG_KEYS,
    check_supported,
    connector_role,
    require_recompute_on_load_failure,
    tier_config_from_extra,
)
from kvtier.integrations.vllm.keys import config_fingerprint, rank_fingerprint
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMeta, LoadSpec, StoreSpec
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.integrations.vllm.worker import _block_axis as _block_axis  # connector_checks.py
from kvtier.tiers.owners import DEFAULT_OWNER, owner_id

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVTierConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector backed by kvtier's TierHierarchy (see the module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        check_vllm_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_through_vllm()
        require_recompute_on_load_failure(self._kv_transfer_config, log=role == KVConnectorRole.SCHEDULER)
        tier_config, options = tier_config_from_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        options["role"] = connector_role(self._kv_transfer_config)
        check_supported(vllm_config, kv_cache_config)
        assert kv_cache_config is not None  # check_supported refuses None
        fingerprint = config_fingerprint(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, tier_config, options, fingerprint)
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, tier_config, options, fingerprint)

    # -- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output, self._kv_cache_manager)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.request_finished(request)
        return False, None  # saves copied their blocks out during the step: nothing to hold

    def take_events(self) -> Iterable[Any]:
        """kvtier's host, disk and Redis stores and removals as vLLM KV events, published by
        vLLM with its own device events (`--kv-events-config`): one stream for routers."""
        if self._scheduler is None:
            return ()
        return to_vllm_events(self._scheduler.take_events())

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler or self._worker
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVTierStats(data=dict(data)) if data is not None else KVTierStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool | None:
        """vLLM's reset_prefix_cache(reset_external=True), in the scheduler process: clear the
        tiers of `reset_tiers` (host and disk by default; Redis is kept, other instances use it)
        on every rank at the next step, and plan no restore from them meanwhile."""
        return self._scheduler.reset() if self._scheduler is not None else None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    # -- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.step_started = time.perf_counter()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert self._worker is not None and isinstance(meta, KVTierMetadata)
        if meta.reset is not None:
            self._worker.reset(meta.reset)
        self._worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once all its blocks are in place

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved whole blocks, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert self._worker is not None and isinstance(meta, KVTierMetadata)
        self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return None, self._worker.take_finished_loads()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.take_worker_meta()

    def shutdown(self) -> None:
        side = self._scheduler or self._worker
        if side is not None:
            side.close()


def register_with_vllm() -> None:
    """Register KVTierConnector by name with vLLM's connector factory. vLLM's MultiConnector
    rebuilds its children's stats by class name in the API server process
    (`KVConnectorFactory.get_connector_class_by_name`): without this, its first stats report
    raises "Connector 'KVTierConnector' is not registered" and the server dies. Importing this
    package registers it (vLLM imports it through kv_connector_module_path in every process that
    builds the connector or its metrics); idempotent."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if KVTierConnector.__name__ not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(KVTierConnector.__name__, __name__, KVTierConnector.__name__)


register_with_vllm()

__all__ = [
    "DEFAULT_OWNER",
    "EXTRA_CONFIG_KEYS",
    "TESTED_VLLM_VERSIONS",
    "KVTierConnector",
    "KVTierMetadata",
    "KVTierPromMetrics",
    "KVTierStats",
    "KVTierWorkerMeta",
    "LoadSpec",
    "StoreSpec",
    "check_vllm_version",
    "config_fingerprint",
    "owner_id",
    "rank_fingerprint",
    "register_with_vllm",
    "tier_config_from_extra",
]
