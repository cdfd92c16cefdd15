"""The restore decision at admission: which stored blocks after a request's device prefix to
load from the tiers below instead of recomputing them.

    keys   [ 0 .. d-1: on device ][ d .. : stored below, runs by fastest tier ][ not stored ]
            touched (host entries      restore the first k (CostModel.decide),
            refreshed)                 recompute the rest

`Scheduler._try_restore`, the simulator (`TraceSimulator`) and the vLLM connector's scheduler
side (kvtier/integrations/vllm/scheduler.py) all call `plan_restore`, so a simulated or a vLLM
decision is the engine's; their `runs` all come from `stored_runs` (kvtier/tiers/runs.py). Pure bookkeeping: no torch, no I/O (the tiers' local
indexes answer `runs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvtier.cost.model import CostModel, RestoreDecision, TierRun, take_runs
from kvtier.kvcache.keys import BlockKey


class _RestorePolicy(Protocol):
    @property
    def restore_policy(self) -> str: ...


class StoredBlocks(Protocol):
    """What `plan_restore` asks of the tiers below the device (a TierHierarchy, or the vLLM
    connector's view of its workers' tiers, kvtier/integrations/vllm/lookup.py)."""

    cost: CostModel

    @property
    def config(self) -> _RestorePolicy: ...

    def touch(self, keys: list[BlockKey]) -> None: ...

    def runs(self, keys: list[BlockKey], start: int, remote_prefix: int = 0, count: bool = True) -> list[TierRun]: ...


@dataclass(slots=True)
class RestorePlan:
    """A restore decision and the stored blocks it chose from."""

    runs: list[TierRun]
    """The stored blocks after the device prefix, as `TierHierarchy.runs` gives them."""
    decision: RestoreDecision

    @property
    def num_blocks(self) -> int:
        """Stored blocks to restore: a prefix of `runs` (0: recompute everything)."""
        return self.decision.num_blocks

    @property
    def num_stored_blocks(self) -> int:
        return sum(r.num_blocks for r in self.runs)

    def load_runs(self) -> list[TierRun]:
        """The runs to load (`TierHierarchy.submit_load`): the first `num_blocks` blocks."""
        return take_runs(self.runs, self.decision.num_blocks)


def plan_restore(
    tiers: StoredBlocks,
    keys: list[BlockKey],
    num_device_blocks: int,
    num_device_tokens: int,
    num_prompt_tokens: int,
    *,
    remote_prefix: int = 0,
    count: bool = True,
) -> RestorePlan:
    """Decide the restore of a request whose first `num_device_blocks` blocks of `keys` are
    device hits holding `num_device_tokens` tokens (the chain of the blocks a tier may hold;
    `num_prompt_tokens` counts every token to compute before the first output).

    Touches the device hits (`tiers.touch`: their host entries become most recent), looks up
    the stored blocks after them (`remote_prefix`: leading keys the remote tier holds, from a
    background lookup; `count=False` for a lookup that repeats one already counted) and asks
    the cost model; the tiers' `restore_policy` 'always' restores every stored block."""
    if num_device_blocks:
        tiers.touch(keys[:num_device_blocks])
    runs = tiers.runs(keys, num_device_blocks, remote_prefix, count=count)
    decision = tiers.cost.decide(
        num_device_tokens, runs, num_prompt_tokens, restore_all=tiers.config.restore_policy == "always"
    )
    return RestorePlan(runs, decision)
