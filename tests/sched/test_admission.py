"""plan_restore: the restore decision the scheduler and the simulator share."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.cost.model import CostModel, TierRun
from kvtier.sched.admission import plan_restore

BS = 4


@dataclass
class Policy:
    restore_policy: str = "cost"


@dataclass
class FakeTiers:
    """Stored blocks: `held[i]` names the tier holding keys[i] (None: none)."""

    held: list[str | None]
    cost: CostModel
    config: Policy = field(default_factory=Policy)
    touched: list[list[bytes]] = field(default_factory=list)
    lookups: list[tuple[int, int, bool]] = field(default_factory=list)

    def touch(self, keys: list[bytes]) -> None:
        self.touched.append(list(keys))

    def runs(self, keys: list[bytes], start: int, remote_prefix: int = 0, count: bool = True) -> list[TierRun]:
        self.lookups.append((start, remote_prefix, count))
        out: list[TierRun] = []
        for tier in self.held[start : len(keys)]:
            if tier is None:
                break
            if out and out[-1].tier == tier:
                out[-1] = TierRun(tier, out[-1].num_blocks + 1)
            else:
                out.append(TierRun(tier, 1))
        return out


def cost(host_bytes_per_s: float) -> CostModel:
    return CostModel.fixed(
        1000,
        BS,
        read_bytes_per_s={"host": host_bytes_per_s, "disk": 1e3},
        latency_s={"host": 0.0, "disk": 0.0},
        prefill_s_per_token=1e-3,
    )


KEYS = [bytes([i]) * 16 for i in range(6)]


def test_touches_the_device_hits_and_restores_what_is_cheaper():
    tiers = FakeTiers(["host", "host", "host", "disk", "disk", None], cost(1e12))
    plan = plan_restore(tiers, KEYS, 2, 2 * BS, 6 * BS + 1, remote_prefix=3, count=False)
    assert tiers.touched == [KEYS[:2]]
    assert tiers.lookups == [(2, 3, False)]
    assert plan.runs == [TierRun("host", 1), TierRun("disk", 2)]
    assert plan.num_stored_blocks == 3
    # host is fast, disk slow (1 kB/s): restore the host block, recompute the disk ones
    assert plan.num_blocks == 1 and plan.decision.kind == "partial"
    assert plan.load_runs() == [TierRun("host", 1)]


def test_always_restores_everything_and_no_hit_touches_nothing():
    tiers = FakeTiers(["disk", "disk", None, None, None, None], cost(1e12), Policy("always"))
    plan = plan_restore(tiers, KEYS, 0, 0, 6 * BS + 1)
    assert tiers.touched == [] and tiers.lookups == [(0, 0, True)]
    assert plan.num_blocks == 2 and plan.decision.kind == "restore"
    assert plan.load_runs() == [TierRun("disk", 2)]


def test_nothing_stored():
    plan = plan_restore(FakeTiers([None] * 6, cost(1e12)), KEYS, 1, BS, 6 * BS + 1)
    assert plan.runs == [] and plan.num_blocks == 0 and plan.decision.kind == "none"
    assert plan.load_runs() == []
