"""What the two sides of the connector send each other every step: the scheduler's
KVTierMetadata (loads to start, blocks to save, this step's prefill work) to the workers, and
each worker's KVTierWorkerMeta (host keys added and removed, measured speeds, what each finished
load brought, tenants purged) back, combined over ranks by vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.integrations.vllm.compat import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class LoadSpec:
    """One request's load: the keys of its blocks to restore and the vLLM blocks they go to."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    owner: str | None
    remote_prefix: int
    """Leading blocks of `keys` the scheduler found in Redis (the worker re-plans host/disk)."""


@dataclass
class StoreSpec:
    """Newly full blocks of one request to copy out of vLLM's pool and store below."""

    keys: list[bytes]
    block_ids: list[int]
    owner: str | None


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    step_features: tuple[float, float] = (0.0, 0.0)
    """Summed PrefillEstimator features of this step's scheduled tokens (the worker times it)."""
    reset: list[str] | None = None
    """Tiers to clear before this step's loads (vLLM's reset_cache); None: no reset."""


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """One worker -> the scheduler, once per step (`aggregate` sums the ranks' reports)."""

    rank_reports: int = 1
    host_added: list[bytes] = field(default_factory=list)
    host_removed: list[bytes] = field(default_factory=list)
    prefill: list[tuple[float, float, float]] = field(default_factory=list)
    """(x0, x1, seconds) of this rank's timed steps."""
    speeds: dict[str, tuple[float, float]] = field(default_factory=dict)
    """tier -> (read bytes/s, job seconds) as this rank measures them now; 'h2d' -> (bytes/s, 0)."""
    loaded: dict[str, int] = field(default_factory=dict)
    """req_id -> blocks that arrived (the rest of its load failed), for the loads this rank
    reports finished in the same step (`get_finished`)."""
    purged: list[str] = field(default_factory=list)
    """Owner ids this rank purged (a `kvtier cache purge` request): the scheduler drops them
    from its host mirror too, in case it has not seen the request itself yet."""
    resets: int = 0
    """Resets this rank carried out (summed over ranks: the scheduler waits for every rank's)."""
    tier_changes: list[tuple[str, bytes, bool]] = field(default_factory=list)
    """(tier, key, stored or removed) of rank 0's tiers since its last report, in order: the KV
    events the scheduler hands vLLM's publisher (empty unless KV events are on)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Both ranks' reports: host keys once per rank, the slower rank's speeds, the fewer
        arrived blocks of a load, the tenants either purged."""
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
            sorted(set(self.purged) | set(other.purged)),
            self.resets + other.resets,
            self.tier_changes + other.tier_changes,
        )
