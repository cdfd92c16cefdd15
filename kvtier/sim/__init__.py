"""Trace-driven KV-cache simulator: kvtier's own BlockPool + PrefixIndex, no tensors, no torch."""

from kvtier.sim.simulator import (DEFAULT_BYTES_PER_TOKEN, DEFAULT_PREFILL_S_PER_TOKEN, SimPoint, SimRequest,
                                  TraceSimulator, ideal_block_hit_rate, load_trace, simulate)

__all__ = ["DEFAULT_BYTES_PER_TOKEN", "DEFAULT_PREFILL_S_PER_TOKEN", "SimPoint", "SimRequest", "TraceSimulator",
           "ideal_block_hit_rate", "load_trace", "simulate"]
