"""Emptying the prefix cache in the tiers a caller names: the server's POST /reset_prefix_cache
(vLLM's dev-mode endpoint), run by the engine loop between steps.

    engine thread                                 tiers' admin worker (only with lower tiers)
    -------------                                 -------------------------------------------
    fence.begin(ALL): queued tier I/O goes stale
    device: every cached block no request holds
    host: clear                           ---->   fence.wait_quiet(ALL)
                                                  host again (promotions of loads in flight)
                                                  disk: clear
                                                  remote: this configuration's entries
                                                  fence.end(ALL)

Unlike a purge it aborts nothing, destroys no data key and leaves nothing pending: blocks that
running requests hold stay on the device (`blocks_in_use`), a load in flight loads nothing (its
request recomputes), and a remote tier that cannot be reached is reported as an error. Unlike
vLLM's reset, which refuses while any block is in use and leaves the blocks its CPU offloading
holds warm, the host and disk tiers are cleared too. The remote tier is cleared only when named:
other instances share it; only the entries of this model and cache configuration (the names
under its fingerprint) go, never the wrapped data keys or anything else in the server.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from kvtier.tiers.errors import TierError
from kvtier.tiers.fence import ALL

logger = logging.getLogger("kvtier.engine")

TIERS = ("device", "host", "disk", "remote")
"""What a reset can name, fastest first."""

DEFAULT_TIERS = ("device", "host", "disk")
"""What a reset clears unless told: this instance's own tiers (a remote tier is shared)."""


def check_tiers(tiers: Sequence[str]) -> list[str]:
    """`tiers` without repeats, in TIERS order; ValueError naming an unknown one."""
    unknown = [t for t in tiers if t not in TIERS]
    if unknown:
        raise ValueError(f"unknown tier {unknown[0]!r}: the tiers are {', '.join(TIERS)}")
    if not tiers:
        raise ValueError(f"name at least one tier of {', '.join(TIERS)}")
    return [t for t in TIERS if t in tiers]


def begin_reset(core: Any, tiers: Sequence[str] | None = None) -> tuple[dict[str, Any], Future | None]:
    """The engine-thread part of a reset of `tiers` (default DEFAULT_TIERS) of `core` (an
    EngineCore): (the answer so far, the future of the whole answer once the lower tiers are
    cleared on the admin worker, or None). The answer: {"tiers": {name: counts}, "not_configured":
    [named tiers this engine has not]}; counts are {"blocks", "bytes"} ("bytes" where known),
    the device's also "blocks_in_use" (kept: running requests hold them), a remote tier that
    could not be cleared {"error": ...}."""
    names = check_tiers(DEFAULT_TIERS if tiers is None else tiers)
    hierarchy = core.tiers
    present = set(hierarchy.tiers) if hierarchy is not None else set()
    lower = [t for t in names if t != "device" and t in present]
    answer: dict[str, Any] = {
        "tiers": {},
        "not_configured": [t for t in names if t != "device" and t not in present],
    }
    if lower:
        hierarchy.fence.begin(ALL)  # stores and loads queued before now touch no tier again
    if "device" in names:
        # with lower tiers cleared, write-back blocks the device drops are dropped too
        num_blocks = core.reset_prefix_cache(store_evicted=not lower)
        answer["tiers"]["device"] = {
            "blocks": num_blocks,
            "bytes": num_blocks * core.runner.kv_bytes_per_block,
            "blocks_in_use": sum(1 for _ in core.kv.index.nodes()),
        }
    if not lower:
        return answer, None
    host = hierarchy.tiers.get("host") if "host" in lower else None
    num_host = host.clear() if host is not None else 0
    block_bytes = hierarchy.block_bytes

    def clear_lower() -> dict[str, Any]:
        try:
            hierarchy.fence.wait_quiet(ALL)
            done: dict[str, Any] = {}
            if host is not None:
                n = num_host + host.clear()
                done["host"] = {"blocks": n, "bytes": n * block_bytes}
            if "disk" in lower:
                disk = hierarchy.tiers["disk"]
                before = disk.usage_bytes
                n = disk.clear()
                done["disk"] = {"blocks": n, "bytes": max(before - disk.usage_bytes, 0)}
            if "remote" in lower:
                done["remote"] = _clear_remote(hierarchy.tiers["remote"])
            logger.info("prefix cache reset: %s", ", ".join(f"{k} {v}" for k, v in done.items()))
            return {**answer, "tiers": {**answer["tiers"], **done}}
        finally:
            hierarchy.fence.end(ALL)

    return answer, hierarchy.tenants.submit_admin(clear_lower)


def _clear_remote(remote: Any) -> dict[str, Any]:
    """Delete the remote tier's entries of this configuration (its owner sets and wrapped data
    keys stay: a reset is no purge); {"blocks": n}, or {"error": why} when the server cannot be
    reached (or failed part-way: some entries may remain)."""
    try:
        remote.call("reset", lambda: remote.client().ping())
        keys = list(remote.keys())
        n = remote.unlink(keys)
    except TierError as e:
        logger.warning("prefix cache reset: the remote tier was not cleared: %s", e)
        return {"error": f"the remote tier could not be cleared: {e}"}
    if not remote.healthy:
        return {"blocks": n, "error": "the remote tier failed part-way: some entries may remain"}
    if remote.watch is not None:  # KV events: these blocks left the remote medium
        for key in keys:
            remote.watch(key, False)
    return {"blocks": n}


def publish_events(core: Any) -> None:
    """KV events after a reset (engine thread): one AllBlocksCleared when no medium holds a
    block any more, and the batch sent now rather than at the next step."""
    events = core.kv_events
    if events is not None:
        events.cleared_if_empty()
        events.flush()
