"""Trace-driven KV-cache simulator: kvtier's own KVCacheManager (BlockPool + PrefixIndex),
TierHierarchy and restore decision (kvtier.sched.admission, CostModel) with no tensors, no
threads and no torch. Traces are read by kvtier.trace."""

from kvtier.sim.config import DEFAULT_BYTES_PER_TOKEN, DEFAULT_PREFILL_S_PER_TOKEN, SimConfig, TierSpeeds
from kvtier.sim.simulator import (
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
    "SimConfig",
    "SimPoint",
    "SimRequest",
    "TierSpeeds",
    "TraceSimulator",
    "ideal_block_hit_rate",
    "ideal_token_hit_rate",
    "load_trace",
    "simulate",
]
