"""Tenant purges under vLLM: `kvtier cache purge` deletes a tenant's files and Redis entries
itself and posts a purge request (kvtier.tiers.purge.PurgeRequests); both sides of the connector
poll the requests on a thread of their own, so an idle vLLM learns of a purge before its next
request:

    workers    PurgeWatcher: drop the tenant's host entries, fence its queued stores, delete
               what they wrote since, forget its data key (`tenants.begin_purge`), and drop from
               the disk tier's index the files the purge deleted (`DiskTier.forget_missing`), so
               the tenant's next blocks are written again and the space is counted right
    scheduler  PurgePoller: the owner ids purged since it last asked (`take`), which it drops
               from its mirror of the workers' host keys before its next lookup
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.owners import owner_id
from kvtier.tiers.purge import ALL, PurgeRequests

logger = logging.getLogger(__name__)


class PurgePoller:
    """Polls the purge requests of `where` (a directory) and/or Redis every `interval_s` on its
    own thread and calls `on_purge(owner id)` once per new request (requests older than this
    process are not acted on). With neither place configured it does nothing."""

    def __init__(
        self,
        where: str | None,
        remote_url: str | None,
        interval_s: float,
        on_purge: Callable[[str], bool] | None = None,
        name: str = "kvtier-vllm-purges",
    ) -> None:
        self.interval_s = interval_s
        self._on_purge = on_purge
        self._lock = threading.Lock()
        self._taken: list[str] = []
        self._stop = threading.Event()
        self._requests: PurgeRequests | None = None
        if where or remote_url:
            self._requests = PurgeRequests(where, remote_url)
            self._seen = self._requests.poll()  # requests from before this process: nothing of them here
            threading.Thread(target=self._watch, name=name, daemon=True).start()

    def _watch(self) -> None:
        assert self._requests is not None
        while not self._stop.wait(self.interval_s):
            self.poll_once()

    def poll_once(self) -> None:
        """Act on the requests posted since the last poll (the thread calls it)."""
        if self._requests is None:
            return
        for oid, when in self._requests.poll().items():
            if when <= self._seen.get(oid, 0.0):
                continue
            self._seen[oid] = when
            done = self._on_purge(oid) if self._on_purge is not None else True
            if done:
                with self._lock:
                    self._taken.append(oid)
            else:
                self._seen.pop(oid, None)  # failed: again at the next poll

    def take(self) -> list[str]:
        """Owner ids purged since the last call."""
        with self._lock:
            out, self._taken = self._taken, []
        return out

    def stop(self) -> None:
        self._stop.set()


class PurgeWatcher(PurgePoller):
    """A worker's purges (see the module docstring). Only tenants `remember`ed here have
    anything in memory to purge; the disk index is checked on every request."""

    def __init__(self, tiers: TierHierarchy, interval_s: float, rank: int) -> None:
        self.tiers = tiers
        self.rank = rank
        self.purges_done = 0
        self._owners_lock = threading.Lock()
        self._owners: dict[str, str | None] = {}
        """Owner id -> tenant (cache_salt) of every block this worker stored or loaded."""
        config = tiers.config
        super().__init__(config.disk_cache_dir or config.key_dir, config.remote_cache_url, interval_s, self._purge)

    def remember(self, owner: str | None) -> None:
        """This worker now holds blocks of tenant `owner`."""
        oid = owner_id(owner)
        if oid not in self._owners:
            with self._owners_lock:
                self._owners[oid] = owner

    def _purge(self, oid: str) -> bool:
        with self._owners_lock:
            known = oid in self._owners or oid == ALL
            owner = self._owners.pop(oid, None)
            if oid == ALL:
                self._owners.clear()
        try:
            counts = {}
            if known:  # in memory only if this worker held the tenant's blocks
                future = self.tiers.tenants.begin_purge_all() if oid == ALL else self.tiers.tenants.begin_purge(owner)
                counts = future.result()
                self.purges_done += 1
            disk = self.tiers.tiers.get("disk")
            if disk is not None:
                counts["disk_index_dropped"] = disk.forget_missing()
            if known or counts.get("disk_index_dropped"):
                logger.info("kvtier connector rank %d: purged tenant %s on request: %s", self.rank, oid, counts)
            return True
        except Exception:
            logger.exception("kvtier connector: purge of tenant %s failed", oid)
            if known and oid != ALL:
                self.remember(owner)  # tried again at the next poll
            return False
