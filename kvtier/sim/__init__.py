"""Trace-driven KV-cache simulator: kvtier's own KVCacheManager (BlockPool + PrefixIndex),
TierHierarchy and restore decision (kvtier.sched.admission, CostModel) with no tensors, no
threads and no torch. Traces are read by kvtier.trace. kvtier.sim.fleet: several instances
behind a router, optionally sharing one remote tier, beside the fleet ceiling."""

from kvtier.sim.config import DEFAULT_BYTES_PER_TOKEN, DEFAULT_PREFILL_S_PER_TOKEN, SimConfig, TierSpeeds
from kvtier.sim.fleet import ROUTINGS, FleetSimulator, RouterConfig, simulate_fleet
from kvtier.sim.simulator import (
    RequestOutcome,
    SimPoint,
    SimRequest,
    TraceSimulator,
    ideal_block_hit_rate,
    ideal_token_hit_rate,
    load_trace,
    simulate,
)

__all__ = [
    "DEFAULT_BYTES_PER_TOKEN",
    "DEFAULT_PREFILL_S_PER_TOKEN",
    "ROUTINGS",
    "FleetSimulator",
    "RequestOutcome",
    "RouterConfig",
    "SimConfig",
    "SimPoint",
    "SimRequest",
    "TierSpeeds",
    "TraceSimulator",
    "ideal_block_hit_rate",
    "ideal_token_hit_rate",
    "load_trace",
    "simulate",
    "simulate_fleet",
]
