"""Checks of kvtier.integrations.vllm that need vLLM importable but no engine (run by
test_connector.py under the vLLM environment's Python). Prints one JSON object."""

from __future__ import annotations

import json
import os


def _error(fn, *args) -> str | None:
    try:
        fn(*args)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return None


def main() -> None:
    import torch

    from kvtier.integrations import vllm as kv

    out: dict = {}
    out["unknown_key"] = _error(kv.tier_config_from_extra, {"host_cache_bytes": "1GiB", "hots_cache": 1})
    out["selective"] = _error(
        kv.tier_config_from_extra, {"host_cache_bytes": "1GiB", "cache_write_policy": "selective"}
    )
    out["no_tier"] = _error(kv.tier_config_from_extra, {})
    out["bad_size"] = _error(kv.tier_config_from_extra, {"host_cache_bytes": "lots"})
    config, options = kv.tier_config_from_extra(
        {"host_cache_bytes": "8GiB", "disk_cache_dir": "/tmp/x", "remote_lookup_wait_ms": 2}
    )
    out["parsed"] = [config.host_cache_bytes, config.disk_cache_dir, options["remote_lookup_wait_s"]]
    os.environ.pop("KVTIER_VLLM_ALLOW_UNTESTED", None)
    out["untested_version"] = _error(kv.check_vllm_version, "0.99.1")
    out["tested_version"] = _error(kv.check_vllm_version, "0.32.0+cpu")
    os.environ["KVTIER_VLLM_ALLOW_UNTESTED"] = "1"
    out["untested_allowed"] = _error(kv.check_vllm_version, "0.99.1")
    # the CPU layout [num_blocks, kv_heads, block_size, 2 * head_size], and a [2, num_blocks, ...] one
    out["axis_cpu"] = kv._block_axis(torch.zeros(7, 2, 16, 8), 7)
    out["axis_kv_first"] = kv._block_axis(torch.zeros(2, 7, 16, 8), 7)
    # stats aggregate across ranks and reduce to a summary
    a, b = kv.KVTierStats(), kv.KVTierStats()
    a.add("hit_tokens", 128)
    b.add("hit_tokens", 256)
    b.data["restore_s"].append(0.004)
    out["stats"] = a.aggregate(b).reduce()
    # worker metadata of two ranks: a host key counts once per rank; speeds take the slower rank
    m1 = kv.KVTierWorkerMeta(1, [b"k" * 16], [], [], {"host": (2e9, 0.01)}, {"r": 4})
    m2 = kv.KVTierWorkerMeta(1, [b"k" * 16], [], [], {"host": (1e9, 0.02)}, {"r": 3})
    m = m1.aggregate(m2)
    out["meta"] = [m.rank_reports, len(m.host_added), m.speeds["host"], m.loaded["r"]]
    out["meta_purged"] = kv.KVTierWorkerMeta(purged=["t1"]).aggregate(kv.KVTierWorkerMeta(purged=["t2", "t1"])).purged
    out["gauges"] = _gauges()
    out["mirror"] = _host_mirror_purge()
    out["lookup"] = _lookup_as_hierarchy()
    print(json.dumps(out))


def _gauges() -> dict:
    """A gauge is each rank's latest value summed over ranks: in the stats vLLM aggregates over
    ranks and steps, and on /metrics across steps where only some ranks report."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    import kvtier.integrations.vllm as kv

    r0, r1, r0_later = kv.KVTierStats(), kv.KVTierStats(), kv.KVTierStats()
    r0.set_gauge("disk_usage_bytes", 0, 100)
    r1.set_gauge("disk_usage_bytes", 1, 50)
    r0_later.set_gauge("disk_usage_bytes", 0, 120)
    r0_later.add("hit_tokens", 128)
    logged = kv.KVTierStats().aggregate(r0).aggregate(r1).aggregate(r0_later).reduce()
    prom = kv.KVTierPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["engine"],
        {0: ["0"]},
    )
    seen = []
    for step in (r0.aggregate(r1), r0_later):
        prom.observe(step.data, 0)
        seen.append(REGISTRY.get_sample_value("vllm:kvtier_disk_usage_bytes", {"engine": "0"}))
    empty = kv.KVTierStats()
    return {
        "logged": logged,
        "prom": seen,
        "hits": REGISTRY.get_sample_value("vllm:kvtier_hit_tokens_total", {"engine": "0"}),
        "empty": empty.is_empty(),
    }


def _host_mirror_purge() -> list:
    """The scheduler's host mirror drops a purged tenant's keys at once (it noted each key's
    tenant when it planned the key's store), and a worker's later report of their removal is
    a no-op."""
    from kvtier.integrations.vllm.lookup import HostMirror

    mirror = HostMirror(2)
    a, b = [bytes([i]) * 16 for i in range(2)], [bytes([9 + i]) * 16 for i in range(2)]
    mirror.note_owner(a, "tenant-a")
    mirror.note_owner(b, "tenant-b")
    mirror.update(a + b + a + b, [])  # two ranks report adds
    before = [mirror.contains_prefix(a), mirror.contains_prefix(b)]
    dropped = mirror.drop_owner("tenant-a")
    after = [mirror.contains_prefix(a), mirror.contains_prefix(b)]
    mirror.update([], a)  # a rank's report of the purge, after the scheduler's own poll
    late = [mirror.contains_prefix(a), mirror.contains_prefix(b), len(mirror.ranks)]
    return [before, dropped, after, late]


def _lookup_as_hierarchy() -> list:
    """The scheduler process's view of a worker's tiers (a host mirror fed by the host tier's
    watch, the disk tier's files) finds the runs TierHierarchy.runs finds in the tiers."""
    import tempfile

    import torch

    from kvtier.cost.model import CostModel
    from kvtier.integrations.vllm.keys import KeyChains, rank_fingerprint
    from kvtier.integrations.vllm.lookup import WorkerTiers
    from kvtier.tiers.hierarchy import TierConfig, TierHierarchy

    bs, fp = 4, b"f" * 16
    keys = KeyChains(fp, bs).extend([], list(range(100, 132)), None, 8)
    blocks = [torch.full((2, 4, 8), float(i)) for i in range(6)]
    block_bytes = blocks[0].numel() * blocks[0].element_size()
    with tempfile.TemporaryDirectory() as d:
        config = TierConfig(host_cache_bytes=2 * block_bytes, disk_cache_dir=d)
        view = WorkerTiers(config, CostModel(["host", "disk"], block_bytes, bs), [rank_fingerprint(fp, 0)], 0.005)
        tiers = TierHierarchy(config, fingerprint=rank_fingerprint(fp, 0), block_bytes=block_bytes, block_size=bs)
        tiers.tiers["host"].watch = lambda key, present: view.host.update([key] * present, [key] * (not present))
        tiers.store(keys[:6], blocks)  # the host tier has room for two, the disk tier holds all six
        tiers.flush()
        out = []
        for start, remote_prefix in ((0, 0), (0, 8), (4, 0), (4, 7), (6, 8)):
            mine = view.runs(keys, start, remote_prefix)
            theirs = tiers.runs(keys, start, remote_prefix, count=False)
            out.append([[r.tier, r.num_blocks] for r in mine] == [[r.tier, r.num_blocks] for r in theirs])
            out.append([[r.tier, r.num_blocks] for r in mine])
        out.append([view.stored_locally(k) for k in keys])
        tiers.close()
        view.close()
    return out


if __name__ == "__main__":
    main()
