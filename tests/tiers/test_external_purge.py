"""A purge from another process (`kvtier cache purge`, `purge_stored`) deletes a tenant's files
behind a running process's disk tier: the running process's purge must leave its disk index
true (`DiskTier.forget_missing`), so that the tenant's next blocks are written again and the
space is counted right (issue 36, item 4: the vLLM connector's workers do this on a purge
request)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvtier.tiers.codec import encode
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.hierarchy import TierConfig, TierHierarchy
from kvtier.tiers.purge import purge_stored

from .conftest import FINGERPRINT, make_keys

SHAPE = (2, 4, 2, 64)


def _block(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i), dtype=torch.bfloat16)


def _files(tier: DiskTier) -> int:
    return sum(1 for _ in tier.dir.rglob("*.kv"))


def test_forget_missing_drops_only_entries_whose_files_are_gone(tmp_path: Path) -> None:
    keys = make_keys(4)
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    for i, key in enumerate(keys):
        assert tier.put(key, encode(_block(i), fingerprint=FINGERPRINT, key=key))
    one = tier.usage_bytes // 4
    for key in keys[1:3]:  # another process deletes two files
        (tier.dir / key.hex()[:2] / f"{key.hex()}.kv").unlink()
    assert len(tier) == 4 and tier.contains_prefix(keys) == 4  # the index does not know yet
    assert tier.forget_missing() == 2
    assert len(tier) == 2 and tier.usage_bytes == 2 * one
    assert tier.contains_prefix(keys) == 1 and tier.contains_count(keys) == 2
    assert tier.forget_missing() == 0
    assert tier.put(keys[1], encode(_block(1), fingerprint=FINGERPRINT, key=keys[1]))
    assert tier.contains_prefix(keys) == 2 and _files(tier) == 3


def test_running_hierarchy_writes_a_tenants_blocks_again_after_an_external_purge(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    config = TierConfig(disk_cache_dir=str(disk), disk_cache_bytes=1 << 24)
    tiers = TierHierarchy(config, fingerprint=FINGERPRINT, block_bytes=4096, block_size=16)
    try:
        keys, other = make_keys(4), make_keys(2, salt=1)
        tiers.store(keys, [_block(i) for i in range(4)], ["tenant-p"] * 4)
        tiers.store(other, [_block(i) for i in range(2)], ["tenant-q"] * 2)
        assert tiers.flush()
        tier = tiers.tiers["disk"]
        assert _files(tier) == 6

        out = purge_stored("tenant-p", disk_cache_dir=str(disk))  # as `kvtier cache purge` does
        assert out["fingerprints"][FINGERPRINT.hex()]["disk"] == 4
        assert _files(tier) == 2 and len(tier) == 6  # the running process's index is stale

        # what the connector's worker does on the purge request: purge in memory (its manifest
        # is gone: nothing more to delete), then drop the index entries of the deleted files
        tiers.tenants.begin_purge("tenant-p").result()
        assert tier.forget_missing() == 4
        assert len(tier) == 2 and tier.contains_prefix(other) == 2 and tier.contains_prefix(keys) == 0

        tiers.store(keys, [_block(i) for i in range(4)], ["tenant-p"] * 4)  # recomputed, stored again
        assert tiers.flush()
        assert _files(tier) == 6 and len(tier) == 6 and tier.contains_prefix(keys) == 4
        assert tier.usage_bytes == sum(f.stat().st_blocks * 512 for f in tier.dir.rglob("*.kv"))
    finally:
        tiers.close()
