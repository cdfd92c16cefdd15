"""The workers' tiers as vLLM's scheduler process sees them: a `StoredBlocks` for
`plan_restore`, so a vLLM restore decision is made by the engine's own code.

The tiers live in the worker processes; the scheduler answers lookups from what it can see:

    host     a mirror of the keys in every rank's host tier (the workers report adds/removes;
             a purge drops its tenant's keys at once)
    disk     each rank's entry files (the same paths the disk tiers write)
    Redis    every rank's RemoteTier, asked in the background (`remote_prefix`)

`runs` is `stored_runs` (kvtier/tiers/runs.py) over these, the lookup `TierHierarchy.runs`
makes over the tiers themselves; a block counts as stored only when every rank holds its shard.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from kvtier.cost.model import CostModel, TierRun
from kvtier.tiers.disk import entry_path
from kvtier.tiers.fence import ALL
from kvtier.tiers.hierarchy import TierConfig
from kvtier.tiers.runs import PrefixIndex, stored_runs


def _leading(present: Callable[[bytes], bool], keys: list[bytes]) -> int:
    n = 0
    for key in keys:
        if not present(key):
            break
        n += 1
    return n


class HostMirror:
    """Keys in the workers' host tiers: key -> ranks holding it (each rank reports its own), and
    key -> owner id for the keys the scheduler planned a store or load of (their tenant), so a
    purge drops the tenant's keys here at once, before any worker reports it."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.ranks: dict[bytes, int] = {}
        self.owners: dict[bytes, str] = {}

    def update(self, added: list[bytes], removed: list[bytes]) -> None:
        for key in added:
            self.ranks[key] = self.ranks.get(key, 0) + 1
        for key in removed:
            n = self.ranks.get(key, 0) - 1
            if n > 0:
                self.ranks[key] = n
            else:
                self.ranks.pop(key, None)
                self.owners.pop(key, None)
        if len(self.owners) > 2 * len(self.ranks) + 4096:  # planned, never reported (a dropped store)
            self.owners = {k: o for k, o in self.owners.items() if k in self.ranks}

    def clear(self) -> None:
        """Forget every key (a reset cleared the host tiers)."""
        self.ranks.clear()
        self.owners.clear()

    def note_owner(self, keys: list[bytes], oid: str) -> None:
        """Keys of tenant `oid` are (about to be) in the workers' host tiers."""
        for key in keys:
            self.owners[key] = oid

    def drop_owner(self, oid: str) -> int:
        """Forget every key of tenant `oid` (ALL: every key): it was purged. Returns how many.
        A worker's later report of a key's removal finds it gone, which is a no-op."""
        if oid == ALL:
            n = len(self.ranks)
            self.ranks.clear()
            self.owners.clear()
            return n
        gone = [k for k, o in self.owners.items() if o == oid]
        for key in gone:
            self.owners.pop(key, None)
            self.ranks.pop(key, None)
        return len(gone)

    def __contains__(self, key: bytes) -> bool:
        return self.ranks.get(key, 0) >= self.world

    def contains_prefix(self, keys: list[bytes], count: bool = True) -> int:
        return _leading(self.__contains__, keys)


class DiskFiles:
    """The disk tiers' entries, one directory per rank: a key is stored when every rank's is."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs

    def __contains__(self, key: bytes) -> bool:
        return all(os.path.exists(entry_path(d, key)) for d in self.dirs)

    def contains_prefix(self, keys: list[bytes], count: bool = True) -> int:
        return _leading(self.__contains__, keys)


class WorkerTiers:
    """What the workers' tiers hold, for `plan_restore` (the StoredBlocks protocol: `config`,
    `cost`, `touch`, `runs`) and for the save side (`stored_locally`)."""

    def __init__(
        self, config: TierConfig, cost: CostModel, rank_fingerprints: list[bytes], remote_wait_s: float
    ) -> None:
        self.config = config
        self.cost = cost
        self.host = HostMirror(len(rank_fingerprints))
        self.disk = (
            DiskFiles([Path(config.disk_cache_dir) / fp.hex() for fp in rank_fingerprints])
            if config.disk_cache_dir
            else None
        )
        self.local: list[tuple[str, PrefixIndex]] = []
        if config.host_cache_bytes:
            self.local.append(("host", self.host))
        if self.disk is not None:
            self.local.append(("disk", self.disk))
        self.remotes: list[Any] = []
        if config.remote_cache_url:
            from kvtier.tiers.remote import RemoteTier

            self.remotes = [
                RemoteTier(config.remote_cache_url, fingerprint=fp, timeout_s=config.remote_timeout_s)
                for fp in rank_fingerprints
            ]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-lookup") if self.remotes else None
        self.remote_wait_s = remote_wait_s
        self._remote_lookups: dict[str, tuple[int, Future]] = {}
        self.hidden: set[str] = set()
        """Tiers a reset is clearing: not seen until every rank reports them cleared."""

    # -- StoredBlocks ------------------------------------------------------------------------------
    def touch(self, keys: list[bytes]) -> None:
        """Nothing: the host tiers whose entries a device hit would refresh are the workers'."""

    def runs(self, keys: list[bytes], start: int, remote_prefix: int = 0, count: bool = True) -> list[TierRun]:
        """Stored blocks from keys[start], as `TierHierarchy.runs` finds them (`stored_runs`)."""
        local = [(n, index) for n, index in self.local if n not in self.hidden] if self.hidden else self.local
        remote_prefix = 0 if "remote" in self.hidden else remote_prefix
        return stored_runs(local, keys, start, remote_prefix, count)

    # -- the rest ----------------------------------------------------------------------------------
    def stored_locally(self, key: bytes) -> bool:
        """In every rank's host tier or on every rank's disk: no need to store it again."""
        if self.hidden:
            return ("host" not in self.hidden and key in self.host) or (
                "disk" not in self.hidden and self.disk is not None and key in self.disk
            )
        return key in self.host or (self.disk is not None and key in self.disk)

    def remote_prefix(self, req_id: str, keys: list[bytes], start: int) -> int | None:
        """Absolute count of leading keys in Redis on every rank, from keys[start] on (None: not
        known yet; the lookup runs in the background and is asked again next step)."""
        if not self.remotes or start >= len(keys) or "remote" in self.hidden:
            return 0
        pending = self._remote_lookups.get(req_id)
        if pending is None or pending[0] != len(keys):
            todo = keys[start:]
            assert self._pool is not None  # there is one whenever there are remotes
            future = self._pool.submit(lambda: start + min(r.contains_prefix(todo) for r in self.remotes))
            pending = self._remote_lookups[req_id] = (len(keys), future)
        try:
            return pending[1].result(timeout=self.remote_wait_s)
        except FutureTimeout:
            return None
        except Exception:  # noqa: BLE001 - a lookup that failed finds nothing (the tier logs it)
            return start

    def forget(self, req_id: str) -> None:
        """Drop the request's remote lookup (its decision is made, or it finished)."""
        self._remote_lookups.pop(req_id, None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for r in self.remotes:
            r.close()
