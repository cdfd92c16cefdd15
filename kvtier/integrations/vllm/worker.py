"""The connector in each vLLM worker process: a TierHierarchy per rank, loads of stored blocks
into vLLM's KV pool, saves of newly full blocks out of it, and the reports the scheduler
process learns from (host keys, measured speeds, what each load brought, purges, counters).

A load that brings fewer blocks than planned (a miss, a corrupt frame, a tier down) drops the
blocks after the first one missing from this rank's host and disk tiers before it is reported:
vLLM recomputes them, and the recomputed blocks are stored again in their place (a chain that
went bad is repaired in one visit, not one block per visit). What a load brought is reported
in the step its request is reported finished (`take_finished_loads`), with its failed blocks
(`take_load_errors`) and its count (`take_worker_meta`), so the three agree."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from kvtier.integrations.vllm.config import kv_events_on
from kvtier.integrations.vllm.keys import rank_fingerprint
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMeta, LoadSpec
from kvtier.integrations.vllm.purges import PurgeWatcher
from kvtier.integrations.vllm.stats import COUNTERS, KVTierStats
from kvtier.threads.binding import on_helper_thread
from kvtier.tiers.hierarchy import TierConfig, TierHierarchy

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

_STATS_SCAN_S = 0.5
"""The tiers' counters and sizes are read after a step that loaded or stored, else at most this
often (not on every decode step)."""


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


def _rank(vllm_config: VllmConfig) -> int:
    """This worker's rank among the pipeline x tensor parallel ranks (0 in a single process)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    try:
        return int(get_pp_group().rank_in_group * tp + get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no parallel groups set up (single process)
        return 0


class WorkerSide:
    """One rank's tiers, loads and saves (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        tier_config: TierConfig,
        options: dict[str, Any],
        fingerprint: bytes,
    ) -> None:
        self.config = tier_config
        self.kv_cache_config = kv_cache_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.rank = _rank(vllm_config)
        self.fingerprint = rank_fingerprint(fingerprint, self.rank)
        self.purge_interval_s = options["purge_check_interval_s"]
        self.publish = options.get("role") == "kv_producer"
        """A prefill instance waits for its stores to reach the tiers before the step ends, so
        its KV is in the shared tiers when its response leaves (the decode instance's lookup
        must find it)."""
        self._resets = 0
        self.kv_events = kv_events_on(vllm_config)
        """vLLM publishes KV events (--kv-events-config): report tier stores and removals."""
        self._tier_changes: list[tuple[str, bytes, bool]] = []
        self.tiers: TierHierarchy | None = None
        self.purges: PurgeWatcher | None = None
        self.layers: list[torch.Tensor] = []
        self.axis = 0
        self.block_shape: tuple[int, ...] = ()
        self.dtype: torch.dtype | None = None
        self.step_started: float | None = None
        self._lock = threading.Lock()
        """Guards what the load threads and the host tier's watch hand to vLLM's thread."""
        self._done: dict[str, tuple[int, list[int]]] = {}
        """Loads finished and not reported yet: req_id -> (blocks arrived, vLLM blocks failed)."""
        self._errors: set[int] = set()
        """Failed vLLM blocks of the loads `take_finished_loads` reported (take_load_errors)."""
        self._loaded: dict[str, int] = {}
        """Blocks arrived of the loads `take_finished_loads` reported (take_worker_meta)."""
        self._host_added: list[bytes] = []
        self._host_removed: list[bytes] = []
        self._prefill: list[tuple[float, float, float]] = []
        self._speeds_dirty = False
        self._h2d: tuple[float, float] = (0.0, 0.0)
        self.stats = KVTierStats()
        self._counted: dict[str, int] = {}
        self._stats_scanned = 0.0
        self._io_since_scan = True
        self._load_pool: ThreadPoolExecutor | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's KV tensors, one per layer: their block layout sizes the tiers' blocks."""
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
        if self.kv_events and self.rank == 0:  # one rank speaks for the instance, as in vLLM
            for name, tier in self.tiers.tiers.items():
                if name != "host":
                    tier.watch = self._tier_watch(name)
        # loads wait on the hierarchy's futures and copy into vLLM's pool on their own thread
        self._load_pool = ThreadPoolExecutor(
            max_workers=max(self.config.io_threads, 1),
            thread_name_prefix="kvtier-vllm-load",
            initializer=on_helper_thread,  # its copies must not make an OpenMP team beside vLLM's
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
        self.purges = PurgeWatcher(self.tiers, self.purge_interval_s, self.rank)

    def _on_host_change(self, key: bytes, present: bool) -> None:
        with self._lock:
            (self._host_added if present else self._host_removed).append(key)
            if self.kv_events and self.rank == 0:
                self._tier_changes.append(("host", key, present))

    def _tier_watch(self, name: str) -> Callable[[bytes, bool], None]:
        def watch(key: bytes, present: bool) -> None:
            with self._lock:
                self._tier_changes.append((name, key, present))

        return watch

    # -- blocks in and out of vLLM's pool ----------------------------------------------------------
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

    def _fitting(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The leading blocks of the layout vLLM's pool has (a stored block of another layout
        and everything after it are recomputed)."""
        for i, t in enumerate(tensors):
            if tuple(t.shape) != self.block_shape or t.dtype != self.dtype:
                logger.warning(
                    "kvtier connector: a stored block has shape %s %s, expected %s %s; recomputing",
                    tuple(t.shape),
                    t.dtype,
                    self.block_shape,
                    self.dtype,
                )
                return tensors[:i]
        return tensors

    # -- loads -------------------------------------------------------------------------------------
    def start_loads(self, meta: KVTierMetadata) -> None:
        """Start the step's loads: each request's runs as this rank's tiers hold them."""
        if not meta.loads:
            return
        assert self.tiers is not None and self._load_pool is not None and self.purges is not None
        self._io_since_scan = True
        for spec in meta.loads:
            self.purges.remember(spec.owner)
            disk = self.tiers.tiers.get("disk")
            if disk is not None:  # files another instance wrote to a shared directory
                disk.adopt(spec.keys)
            runs = self.tiers.runs(spec.keys, 0, remote_prefix=spec.remote_prefix)
            available = sum(r.num_blocks for r in runs)
            future = self.tiers.submit_load(spec.keys[:available], runs, spec.owner) if available else None
            self._load_pool.submit(self._finish_load, spec, future, time.perf_counter())

    def _finish_load(self, spec: LoadSpec, future: Future | None, started: float) -> None:
        """On a load thread: copy what arrived into vLLM's pool, and record the load done."""
        arrived = 0
        per_tier: dict[str, int] = {}
        try:
            if future is not None:
                result = future.result()
                per_tier = result.per_tier
                good = self._fitting(list(result.tensors))
                if good:
                    t0 = time.perf_counter()
                    self._write_blocks(spec.block_ids[: len(good)], good)
                    dt = time.perf_counter() - t0
                    nbytes = len(good) * good[0].numel() * good[0].element_size()
                    with self._lock:
                        self._h2d = (self._h2d[0] + nbytes, self._h2d[1] + dt)
                arrived = len(good)
        except Exception:
            logger.exception("kvtier connector: load of %s failed; recomputing", spec.req_id)
        failed = spec.block_ids[arrived:]
        if failed:
            self._drop_after_failure(spec.keys[arrived:])
        with self._lock:
            self._done[spec.req_id] = (arrived, failed)
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

    def _drop_after_failure(self, keys: list[bytes]) -> None:
        """The blocks from the first one a load missed on: out of this rank's host and disk
        tiers (a corrupt chain's later frames, entries the scheduler counted on), so that the
        recomputed blocks are stored in their place and no later lookup plans them."""
        assert self.tiers is not None
        for name in ("host", "disk"):
            tier = self.tiers.tiers.get(name)
            if tier is None:
                continue
            for key in keys:
                try:
                    tier.delete(key)  # a host removal reaches the scheduler through the watch
                except Exception:  # best effort: the tier counts its errors
                    logger.debug("kvtier connector: could not drop %s from %s", key.hex(), name, exc_info=True)

    def take_finished_loads(self) -> set[str] | None:
        """The loads finished since the last call (vLLM's get_finished); their failed blocks and
        counts are handed out by the next take_load_errors / take_worker_meta."""
        with self._lock:
            done, self._done = self._done, {}
            for req_id, (arrived, failed) in done.items():
                self._loaded[req_id] = arrived
                self._errors.update(failed)
        return set(done) or None

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------------------
    def save(self, meta: KVTierMetadata) -> None:
        """After the step's forward: time it (a prefill step) and store its newly full blocks."""
        now = time.perf_counter()
        if self.step_started is not None and meta.step_features[0] > 0:
            with self._lock:
                self._prefill.append((meta.step_features[0], meta.step_features[1], now - self.step_started))
        self.step_started = None
        if not meta.stores or self.tiers is None:
            return
        assert self.purges is not None
        self._io_since_scan = True
        for spec in meta.stores:
            self.purges.remember(spec.owner)
            tensors = self._read_blocks(spec.block_ids)
            self.tiers.store(spec.keys, tensors, [spec.owner] * len(spec.keys))
        if self.publish and not self.tiers.flush():
            logger.warning("kvtier connector rank %d: stores still queued after 30 s; publishing late", self.rank)

    # -- reset -------------------------------------------------------------------------------------
    def reset(self, names: list[str]) -> None:
        """vLLM's reset_cache: clear this rank's tiers `names` (the stores queued before the reset
        land first, then go with the rest); log what was cleared and what was kept."""
        if self.tiers is not None:
            self.tiers.flush()
            cleared = {}
            for name in self.tiers.names:
                if name not in names:
                    continue
                tier = self.tiers.tiers[name]
                if name == "host":
                    # the scheduler drops its host mirror on this report: send only what comes after
                    watch, tier.watch = tier.watch, None
                    with self._lock:
                        self._host_added, self._host_removed = [], []
                    cleared[name] = tier.clear()
                    tier.watch = watch
                else:
                    cleared[name] = tier.clear()
            kept = [n for n in self.tiers.names if n not in names]
            logger.info(
                "kvtier connector rank %d: reset_cache: cleared %s; kept %s (not in reset_tiers)",
                self.rank,
                ", ".join(f"{n} ({k} blocks)" for n, k in cleared.items()) or "no tier",
                ", ".join(kept) or "no tier",
            )
        with self._lock:
            self._resets += 1

    # -- reports -----------------------------------------------------------------------------------
    def take_worker_meta(self) -> KVTierWorkerMeta | None:
        """This step's report to the scheduler process (None: nothing new)."""
        purged = self.purges.take() if self.purges is not None else []
        with self._lock:
            meta = KVTierWorkerMeta(1, self._host_added, self._host_removed, self._prefill, {}, self._loaded, purged)
            self._host_added, self._host_removed, self._prefill, self._loaded = [], [], [], {}
            meta.resets, self._resets = self._resets, 0
            meta.tier_changes, self._tier_changes = self._tier_changes, []
            dirty, self._speeds_dirty = self._speeds_dirty, False
            h2d, self._h2d = self._h2d, (0.0, 0.0)
        if dirty and self.tiers is not None:
            for name, speed in self.tiers.cost.tiers.items():
                if speed.read_bytes_per_s.value is not None:
                    meta.speeds[name] = (speed.read_bytes_per_s.value, speed.job_s.get(0.0))
            if h2d[1] > 0:
                meta.speeds["h2d"] = (h2d[0] / h2d[1], 0.0)
        if not (
            meta.host_added
            or meta.host_removed
            or meta.prefill
            or meta.speeds
            or meta.loaded
            or meta.purged
            or meta.resets
        ):
            return None
        return meta

    def _scan_tiers(self) -> None:
        """The tiers' counters (their growth) and sizes (gauges: this rank's latest value), the
        ones kvtier's own server shows."""
        assert self.tiers is not None
        for name, tier in self.tiers.tiers.items():
            s = tier.stats
            self._count(f"{name}_bytes_read", s.bytes_read, name)
            self._count(f"{name}_bytes_written", s.bytes_written, name)
            self._count(f"{name}_evictions", s.evictions, name)
            self._count("corrupt_blocks", s.corrupt, name)
            self._count(f"{name}_errors", sum(s.errors.values()) + s.skipped, name)
            self.stats.set_gauge(f"{name}_usage_bytes", self.rank, tier.usage_bytes)
            if name in ("host", "disk"):
                self.stats.set_gauge(f"{name}_entries", self.rank, len(tier))
        hs = self.tiers.stats
        self._count("stores_dropped", hs.stores_dropped, "hierarchy")
        self._count("stores_fenced", hs.stores_fenced, "hierarchy")
        if self.purges is not None:
            self._count("purges", self.purges.purges_done, "purges")

    def _count(self, counter: str, total: int, source: str) -> None:
        """Count the growth of a running total of the tiers' since it was last read."""
        key = f"{source}:{counter}"
        delta = total - self._counted.get(key, 0)
        self._counted[key] = total
        if delta and counter in COUNTERS:
            self.stats.add(counter, delta)

    def take_stats(self) -> KVTierStats | None:
        """The counters since the last call (None: nothing happened), the tiers' read bytes,
        errors and dropped stores included."""
        now = time.monotonic()
        if self.tiers is not None and (self._io_since_scan or now - self._stats_scanned >= _STATS_SCAN_S):
            self._stats_scanned, self._io_since_scan = now, False
            with self._lock:  # the load threads add to self.stats too
                self._scan_tiers()
        with self._lock:
            if self.stats.is_empty():
                return None
            out, self.stats = self.stats, KVTierStats()
        return out

    def close(self) -> None:
        if self.purges is not None:
            self.purges.stop()
        if self._load_pool is not None:
            self._load_pool.shutdown(wait=True)
        if self.tiers is not None:
            self.tiers.close()
