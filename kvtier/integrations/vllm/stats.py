"""The connector's counters as vLLM's connector stats: gathered per step on each side, summed
over ranks, logged by vLLM and shown on its /metrics as vllm:kvtier_<name>_total."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.integrations.vllm.compat import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

COUNTERS = (
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
        data: dict[str, Any] = {name: 0 for name in COUNTERS}
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
        for name in COUNTERS:
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
