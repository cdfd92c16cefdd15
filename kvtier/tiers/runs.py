"""The one lookup of stored blocks: which tier holds each block after a device prefix.

    keys   [ .. start-1 ][ start ..: runs, each in the fastest tier holding it ][ not stored ]
                          host 5    disk 3    remote 4

Every caller gets its runs here: the engine and the simulator through `TierHierarchy.runs`
(called by `plan_restore`, kvtier/sched/admission.py), and vLLM's scheduler process through
the connector's view of its workers' tiers (kvtier/integrations/vllm/lookup.py), which asks
the same question of indexes it keeps itself. The local tiers answer `contains_prefix`
synchronously (in-memory indexes); the remote tier's answer is a count found beforehand in
the background (`remote_prefix`), so no lookup here waits on the network.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvtier.cost.model import TierRun

MAX_RUNS = 16
"""Runs looked up per request at most: a chain alternating between tiers more often than
this is read in its first runs and recomputed after them."""


class PrefixIndex(Protocol):
    """A local tier as the lookup sees it (host and disk tiers, or a view of them)."""

    def contains_prefix(self, keys: list[bytes], count: bool = True) -> int:
        """How many leading `keys` are stored (`count=False`: a repeated lookup, not a query)."""
        ...


def stored_runs(
    local: Sequence[tuple[str, PrefixIndex]],
    keys: list[bytes],
    start: int,
    remote_prefix: int = 0,
    count: bool = True,
) -> list[TierRun]:
    """Stored blocks from keys[start]: consecutive runs, each in the fastest tier holding it.

    `local`: the local tiers by name, fastest first; each run is the longest prefix the first
    tier holding keys[p] has. `remote_prefix`: leading keys of `keys` (absolute, from 0) the
    remote tier holds; it serves what no local tier has. Stops at the first block no tier
    holds, or after MAX_RUNS runs."""
    runs: list[TierRun] = []
    p = start
    for _ in range(MAX_RUNS):
        if p >= len(keys):
            break
        n, found = 0, ""
        for name, tier in local:
            n = tier.contains_prefix(keys[p:], count=count)
            if n:
                found = name
                break
        if not n and remote_prefix > p:
            n, found = remote_prefix - p, "remote"
        if not n:
            break
        runs.append(TierRun(found, n))
        p += n
    return runs
