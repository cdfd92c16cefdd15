"""Tenant purges in a vLLM worker: the tenants whose blocks this worker stored or loaded, and
the thread that acts on `kvtier cache purge` requests (kvtier.tiers.purge.PurgeRequests) for
them."""

from __future__ import annotations

import logging
import threading

from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.owners import owner_id
from kvtier.tiers.purge import PurgeRequests

logger = logging.getLogger(__name__)


class PurgeWatcher:
    """Drops this worker's copies of a purged tenant (host tier), fences its queued stores,
    deletes what they wrote since and forgets its data key (`tenants.begin_purge`). Polls on
    its own thread, so an idle vLLM acts too. Only tenants `remember`ed here are purged: a
    worker that never held a tenant's blocks has nothing of it."""

    def __init__(self, tiers: TierHierarchy, interval_s: float, rank: int) -> None:
        self.tiers = tiers
        self.interval_s = interval_s
        self.rank = rank
        self.purges_done = 0
        self._lock = threading.Lock()
        self._owners: dict[str, str | None] = {}
        """Owner id -> tenant (cache_salt) of every block this worker stored or loaded."""
        self._requests: PurgeRequests | None = None
        self._stop = threading.Event()
        config = tiers.config
        where = config.disk_cache_dir or config.key_dir
        if where or config.remote_cache_url:
            self._requests = PurgeRequests(where, config.remote_cache_url)
            threading.Thread(target=self._watch, name="kvtier-vllm-purges", daemon=True).start()

    def remember(self, owner: str | None) -> None:
        """This worker now holds blocks of tenant `owner`."""
        oid = owner_id(owner)
        if oid not in self._owners:
            with self._lock:
                self._owners[oid] = owner

    def _watch(self) -> None:
        assert self._requests is not None
        seen = self._requests.poll()  # requests from before this process: nothing of them here
        while not self._stop.wait(self.interval_s):
            for oid, when in self._requests.poll().items():
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

    def stop(self) -> None:
        self._stop.set()
