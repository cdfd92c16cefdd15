"""The connector's counters and gauges as vLLM's connector stats: gathered per step on each side,
combined over ranks, logged by vLLM and shown on its /metrics (vllm:kvtier_<name>_total for a
counter, vllm:kvtier_<name> for a gauge).

The counters a restore leaves, and who counts them:

    planned_hit_tokens    scheduler  tokens of the loads it planned (vLLM waits for them)
    hit_tokens            scheduler  tokens that ARRIVED in vLLM's pool (the fewest of any rank)
    failed_hit_tokens     scheduler  planned tokens that did not arrive (vLLM recomputed them)
    decisions_*           scheduler  the restore decisions (plans, not outcomes)
    loads, load_failures, load_blocks, <tier>_hit_blocks   each worker, per rank, summed

and the tiers' own counters and sizes (TierStats, each worker's TierHierarchy, read at most every
0.5 s), the ones kvtier's own server shows: <tier>_bytes_read, <tier>_bytes_written,
<tier>_evictions, <tier>_errors, corrupt_blocks, stores_dropped, stores_fenced, purges; the
gauges <tier>_usage_bytes and <tier>_entries are each rank's latest value, summed over ranks
(a gauge is never summed over steps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.integrations.vllm.compat import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

TIERS = ("host", "disk", "remote")

COUNTERS = (
    "lookups",
    "planned_hit_tokens",
    "hit_tokens",
    "failed_hit_tokens",
    "decisions_restore",
    "decisions_partial",
    "decisions_recompute",
    "loads",
    "load_failures",
    "load_blocks",
    "stores",
    "store_blocks",
    *(f"{t}_hit_blocks" for t in TIERS),
    *(f"{t}_bytes_read" for t in TIERS),
    *(f"{t}_bytes_written" for t in TIERS),
    *(f"{t}_evictions" for t in TIERS),
    "disk_errors",
    "remote_errors",
    "corrupt_blocks",
    "stores_dropped",
    "stores_fenced",
    "purges",
)

GAUGES = (
    *(f"{t}_usage_bytes" for t in TIERS),
    *(f"{t}_entries" for t in ("host", "disk")),
)

_GAUGES = "gauges"
"""data[_GAUGES]: {gauge: {rank (str): latest value}}."""


@dataclass
class KVTierStats(KVConnectorStats):
    """Counters since the last report (summed over ranks), restore seconds observed, and the
    gauges' latest value per rank."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        data: dict[str, Any] = {name: 0 for name in COUNTERS}
        data["restore_s"] = []  # seconds per load
        data[_GAUGES] = {}
        self.data = data

    def add(self, name: str, n: float = 1) -> None:
        self.data[name] = self.data.get(name, 0) + n

    def set_gauge(self, name: str, rank: int, value: float) -> None:
        self.data.setdefault(_GAUGES, {}).setdefault(name, {})[str(rank)] = value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add `other` in: counters add up; a gauge keeps each rank's value, `other`'s where
        both have one (vLLM aggregates a later step into an earlier one)."""
        for name, value in other.data.items():
            if name == "restore_s":
                self.data.setdefault("restore_s", []).extend(value)
            elif name == _GAUGES:
                mine = self.data.setdefault(_GAUGES, {})
                for gauge, ranks in value.items():
                    mine.setdefault(gauge, {}).update(ranks)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def gauges(self) -> dict[str, float]:
        """Each gauge summed over the ranks that reported it."""
        return {name: sum(ranks.values()) for name, ranks in (self.data.get(_GAUGES) or {}).items()}

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k not in ("restore_s", _GAUGES) and v}
        out.update(self.gauges())
        restores = sorted(self.data.get("restore_s", []))
        if restores:
            out["restore_p50_ms"] = round(restores[len(restores) // 2] * 1000, 2)
            out["restore_max_ms"] = round(restores[-1] * 1000, 2)
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k != _GAUGES) and not self.data.get(_GAUGES)


class KVTierPromMetrics(KVConnectorPromMetrics):
    """kvtier's counters and gauges on vLLM's /metrics (per engine)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in COUNTERS:
            counter = self._counter_cls(
                name=f"vllm:kvtier_{name}", documentation=f"kvtier connector: {name}", labelnames=labelnames
            )
            self._counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}
        self._gauges: dict[str, dict[int, Any]] = {}
        for name in GAUGES:
            gauge = self._gauge_cls(
                name=f"vllm:kvtier_{name}",
                documentation=f"kvtier connector: {name} (summed over ranks)",
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            )
            self._gauges[name] = {idx: gauge.labels(*values) for idx, values in per_engine_labelvalues.items()}
        self._latest: dict[tuple[int, str], dict[str, float]] = {}
        """(engine, gauge) -> {rank: latest value}: a step where one rank reports leaves the others'."""
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
            elif name == _GAUGES:
                for gauge, ranks in value.items():
                    if gauge not in self._gauges:
                        continue
                    latest = self._latest.setdefault((engine_idx, gauge), {})
                    latest.update(ranks)
                    self._gauges[gauge][engine_idx].set(sum(latest.values()))
            elif name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
