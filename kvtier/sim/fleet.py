"""A fleet of kvtier instances behind a router, replayed from a trace: which router, how many
instances, and how far each router falls short of one pool as large as the whole fleet.

    trace ──> router ──┬──> instance 0: TraceSimulator (device pool, host, disk)  ─┐
      (timestamp        ├──> instance 1: TraceSimulator (device pool, host, disk)  ─┼─> shared remote
       order)           └──> instance N-1 ...                                      ─┘   tier (Redis)

Each instance is a `TraceSimulator` (kvtier/sim/simulator.py): its own KVCacheManager, its own
host and disk tiers as the config gives them, restores decided by `plan_restore`; a request runs
on one instance through `TraceSimulator.handle`, the same code a single-instance replay runs.
With a remote capacity in the config (`remote_blocks`/`remote_bytes`, the CLI's
`--shared-remote-blocks`/`--shared-remote-bytes`), one `SharedMemoryTier` object is every
instance's remote tier, as one Redis is in a real fleet: a block instance A stores (write
policy permitting) is a remote hit for instance B, at the remote tier's speeds, counted as a
cross-instance hit (`cross_instance_hit_*`: remote hits on blocks the restoring instance never
stored itself).

Routing policies (`ROUTINGS`), each choosing one instance per request at its arrival:

    round_robin  instance i mod N for the i-th request; sees nothing.
    prefix       what an approximate, text-only router does (vllm-router's `cache_aware`,
                 SGLang's router): per instance, a prefix tree of the requests it SENT there
                 (here the set of chained block keys, which is that tree), not of what the
                 instance still holds: its evictions are invisible. The instance with the
                 longest match wins if matched tokens / input tokens > `cache_threshold`
                 (0.3), else the instance with the smallest tree (fewest blocks sent: the most
                 room, as those routers pick; ties: least loaded); and if the load is
                 imbalanced (max - min > `balance_abs_threshold` (64) and max >
                 `balance_rel_threshold` (1.5) x min) the least loaded, whatever the match.
                 Defaults are vllm-router 0.1.17's; other versions and SGLang's router differ
                 (threshold 0.3-0.5, absolute 32-64): set them to the router you run. The tree
                 grows without bound (the real ones trim it to a size limit now and then).
    kv_aware     what a router fed by KV events does (vllm-router 0.1.17's `kv_aware`, Dynamo's
                 KV router): the lowest cost, where an instance's cost is `overlap_weight` x
                 the prefill blocks the request would compute there (its input minus the
                 device prefix the instance holds right now, and minus `host_weight` (0.8) of
                 each host-tier block after it) plus the decode blocks (prompt + output) of
                 the requests in flight there and of this one. Ties go to the least loaded.
                 Hits are traded for load: a longer prefix on a busy instance can lose to a
                 shorter one on an idle instance. No imbalance guard (the cost is the guard).
                 The cost's form is Dynamo's documented one; vllm-router 0.1.17 documents the
                 same knobs (lowest cost at temperature 0, tier credits) but not its formula,
                 so this is a model of it, checked against it in docs/benchmarks.md.
    oracle       `kv_aware`'s cost with everything known: the hit tokens are the device prefix
                 plus what `plan_restore` would restore there from host, disk and the shared
                 tier (the cost model's choice), not a router's view; ties go to the one that
                 restores fastest (more on device), then the least loaded. Load counts as in
                 `kv_aware` (without it, greedy affinity piles every request that shares a
                 first block onto one instance and thrashes its pool). A router that knows
                 everything but sends each request to one instance, deciding one request at a
                 time: a greedy bound for the routers above, not a proven optimum.

"Least loaded": fewest requests in flight, then fewest requests routed so far, then the lowest
instance number (so a fleet with nothing in flight still spreads new prefixes).

Load model: an instance runs any number of requests at once (continuous batching) and each
request occupies it from its arrival (trace `timestamp`) for its service time: the prefill the
simulator estimates for it on that instance (restore time + prefill of the tokens not cached,
CostModel's prefill model) plus `output_length` x `decode_s_per_token`. Requests do not queue
or slow each other down. An instance's load at an arrival is its requests still in flight.
Reported: `load_imbalance`, max / mean over the instances of their mean load at arrivals (1.0:
even); `load_imbalance_at_arrivals`, the mean over arrivals of max load / mean load then
(arrivals with nothing in flight left out; it counts short-lived spikes too);
`request_share_imbalance`, max / mean requests routed per instance; `peak_in_flight`.

The fleet ceiling: the same trace through ONE instance with N times the device pool and N
times the host and disk tiers (the same shared remote tier): every prefix in one pool, no
routing loss. Each routing policy is reported beside it.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvtier.sim.config import SimConfig
from kvtier.sim.simulator import SimPoint, SimRequest, TraceSimulator, new_remote_tier, trace_summary

ROUTINGS = ("round_robin", "prefix", "kv_aware", "oracle")


@dataclass(frozen=True)
class RouterConfig:
    """The routers' knobs and the load model's decode speed. Defaults: vllm-router 0.1.17's."""

    cache_threshold: float = 0.3
    """prefix: route by match when matched / input tokens > this (vllm-router --cache-threshold)."""
    balance_abs_threshold: int = 64
    """prefix: imbalanced when max load - min load > this ..."""
    balance_rel_threshold: float = 1.5
    """... and max load > this x min load; then the least loaded instance gets the request."""
    host_weight: float = 0.8
    """kv_aware: a host-tier block saves this much of a device block's prefill (vllm-router
    --kv-penalty-host, its "host-tier KV transfer credit")."""
    overlap_weight: float = 1.0
    """kv_aware, oracle: weight of the prefill blocks against the decode blocks in the cost."""
    decode_s_per_token: float = 0.02
    """Load model: seconds per output token of one request (decode)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1")
        if not 0.0 <= self.host_weight <= 1.0:
            raise ValueError(f"host_weight must be in [0, 1], got {self.host_weight}")
        if self.overlap_weight < 0 or self.decode_s_per_token < 0:
            raise ValueError("overlap_weight and decode_s_per_token must be >= 0")


_ADDITIVE = (
    "num_requests",
    "total_blocks",
    "total_tokens",
    "device_hit_blocks",
    "device_hit_tokens",
    "host_hit_blocks",
    "host_hit_tokens",
    "disk_hit_blocks",
    "disk_hit_tokens",
    "remote_hit_blocks",
    "remote_hit_tokens",
    "cross_instance_hit_blocks",
    "cross_instance_hit_tokens",
    "stored_blocks",
    "restored_blocks",
    "recomputed_stored_blocks",
    "device_evictions",
    "host_evictions",
    "disk_evictions",
    "promotions",
    "demotions",
    "load_failures",
    "oversized_requests",
    "host_bytes_read",
    "host_bytes_written",
    "disk_bytes_read",
    "disk_bytes_written",
    "prefill_total_s",
    "restore_s",
    "prefill_saved_s",
    "sim_seconds",
)
"""SimPoint counts that add up over instances (the shared remote tier's are counted once)."""


def sum_points(points: Sequence[SimPoint]) -> SimPoint:
    """The fleet's counts: the instances' summed; capacities and policies are the first's
    (per instance), the remote tier's evictions and bytes the shared tier's (counted once)."""
    first = points[0]
    out = replace(first, restore_decisions={})
    for name in _ADDITIVE:
        setattr(out, name, sum(getattr(p, name) for p in points))
    for p in points:
        for kind, n in p.restore_decisions.items():
            out.restore_decisions[kind] = out.restore_decisions.get(kind, 0) + n
    return out.finish()


class FleetSimulator:
    """N instances behind one routing policy, replaying requests in the order given (timestamp
    order, as `load_trace` gives them). Each instance is a TraceSimulator of `device_blocks`
    with the config's host and disk tiers; the config's remote tier, if any, is one object
    they share. `replay` may be called repeatedly; `result()` is the fleet's dict so far.
    Deterministic: no randomness, and no clock except `sim_seconds`."""

    def __init__(
        self,
        instances: int,
        device_blocks: int,
        config: SimConfig | None = None,
        routing: str = "round_robin",
        router: RouterConfig | None = None,
    ) -> None:
        if instances < 1:
            raise ValueError(f"instances must be >= 1, got {instances}")
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        self.config = config = config or SimConfig()
        self.router = router or RouterConfig()
        self.routing = routing
        self.block_tokens = config.block_tokens
        self.remote = new_remote_tier(config)
        self.sims = [
            TraceSimulator(device_blocks, config, shared_remote=self.remote, instance=i) for i in range(instances)
        ]
        self._route = {
            "round_robin": self._round_robin,
            "prefix": self._prefix,
            "kv_aware": self._kv_aware,
            "oracle": self._oracle,
        }[routing]
        n = instances
        self._in_flight: list[list[tuple[float, int]]] = [[] for _ in range(n)]  # (finish, blocks) heaps
        self._active_blocks = [0] * n  # blocks (prompt + output) of the requests in flight
        self._routed = [0] * n
        self._load_sum = [0] * n
        self._peak = [0] * n
        self._hit_tokens = [0] * n
        self._arrivals = 0
        self._imbalance_sum = 0.0
        self._imbalance_n = 0
        self._sent: list[set[bytes]] = [set() for _ in range(n)]  # prefix router's trees
        self.routed_to: list[int] = []
        """The instance each request went to, in replay order."""
        self._elapsed = 0.0

    # ------------------------------------------------------------------ replay
    def replay(self, requests: Sequence[SimRequest]) -> None:
        t0 = time.perf_counter()
        decode = self.router.decode_s_per_token
        n = len(self.sims)
        for req in requests:
            now = req.timestamp / 1000.0
            loads = []
            for i, heap in enumerate(self._in_flight):
                while heap and heap[0][0] <= now:
                    self._active_blocks[i] -= heapq.heappop(heap)[1]
                load = len(heap)
                loads.append(load)
                self._load_sum[i] += load
                self._peak[i] = max(self._peak[i], load)
            self._arrivals += 1
            total = sum(loads)
            if total:
                ratio = max(loads) * n / total
                self._imbalance_sum += ratio
                self._imbalance_n += 1
            i = self._route(req, loads)
            outcome = self.sims[i].handle(req)
            self._routed[i] += 1
            self.routed_to.append(i)
            self._hit_tokens[i] += outcome.hit_tokens
            blocks = len(req.keys) + -(-req.output_length // self.block_tokens)
            heapq.heappush(self._in_flight[i], (now + outcome.prefill_s + req.output_length * decode, blocks))
            self._active_blocks[i] += blocks
            if self.routing == "prefix":
                self._sent[i].update(req.keys)
        self._elapsed += time.perf_counter() - t0

    # ------------------------------------------------------------------ routers
    def _least_loaded(self, loads: list[int], candidates: Sequence[int] | None = None) -> int:
        cands = range(len(loads)) if candidates is None else candidates
        return min(cands, key=lambda i: (loads[i], self._routed[i], i))

    def _imbalanced(self, loads: list[int]) -> bool:
        r = self.router
        hi, lo = max(loads), min(loads)
        return hi - lo > r.balance_abs_threshold and hi > r.balance_rel_threshold * lo

    def _round_robin(self, req: SimRequest, loads: list[int]) -> int:
        return (self._arrivals - 1) % len(loads)

    def _prefix(self, req: SimRequest, loads: list[int]) -> int:
        if self._imbalanced(loads) or not req.input_length:
            return self._least_loaded(loads)
        matched: list[int] = []
        for sent in self._sent:
            m = 0
            for key in req.keys:
                if key not in sent:
                    break
                m += 1
            matched.append(sum(req.block_tokens[:m]))
        best = max(matched)
        if best and best / req.input_length > self.router.cache_threshold:
            return self._least_loaded(loads, [i for i, m in enumerate(matched) if m == best])
        smallest = min(len(sent) for sent in self._sent)
        return self._least_loaded(loads, [i for i, sent in enumerate(self._sent) if len(sent) == smallest])

    def _kv_aware(self, req: SimRequest, loads: list[int]) -> int:
        keys, toks, w = req.keys, req.block_tokens, self.router.host_weight
        bt = self.block_tokens
        costs = []
        for i, sim in enumerate(self.sims):
            d = len(sim.index.match_keys(keys))
            saved = float(sum(toks[:d]))
            host = sim.host
            if host is not None and w:
                h = host.contains_prefix(keys[d:], count=False)
                saved += w * sum(toks[d : d + h])
            prefill_blocks = (req.input_length - saved) / bt
            decode_blocks = self._active_blocks[i] + len(keys)
            costs.append(self.router.overlap_weight * prefill_blocks + decode_blocks)
        best = min(costs)
        return self._least_loaded(loads, [i for i, c in enumerate(costs) if c == best])

    def _oracle(self, req: SimRequest, loads: list[int]) -> int:
        keys, toks = req.keys, req.block_tokens
        remote = self.remote.contains_prefix(keys, count=False) if self.remote is not None else 0
        always = self.config.restore_policy == "always"
        costs: list[tuple[float, float]] = []  # (cost, restore seconds)
        for i, sim in enumerate(self.sims):
            hit, t_restore = 0, 0.0
            if keys and len(keys) <= sim.kv.num_blocks:  # else all-miss wherever it goes
                d = len(sim.index.match_keys(keys))
                hit = sum(toks[:d])
                if sim.tiers is not None:
                    runs = sim.tiers.runs(keys, d, remote, count=False)
                    decision = sim.cost.decide(hit, runs, req.input_length, restore_all=always)
                    hit += sum(toks[d : d + decision.num_blocks])
                    t_restore = decision.t_restore_s
            prefill_blocks = (req.input_length - hit) / self.block_tokens
            decode_blocks = self._active_blocks[i] + len(keys)
            costs.append((self.router.overlap_weight * prefill_blocks + decode_blocks, t_restore))
        best = min(costs)
        return self._least_loaded(loads, [i for i, c in enumerate(costs) if c == best])

    # ------------------------------------------------------------------ results
    def check_integrity(self) -> None:
        for sim in self.sims:
            sim.check_integrity()

    def result(self) -> dict[str, Any]:
        """The fleet's SimPoint fields (summed over instances, rates over the fleet), with
        `routing`, `instances`, the load figures and `per_instance`."""
        points = [sim.result() for sim in self.sims]
        total = sum_points(points)
        total.sim_seconds = self._elapsed
        out = total.to_dict(tiers=self.config.has_tiers)
        n = len(self.sims)
        arrivals = self._arrivals or 1
        load = sum(self._load_sum)
        out.update(
            routing=self.routing,
            instances=n,
            request_share_imbalance=max(self._routed) * n / arrivals,
            load_imbalance=max(self._load_sum) * n / load if load else 0.0,
            load_imbalance_at_arrivals=self._imbalance_sum / self._imbalance_n if self._imbalance_n else 0.0,
            mean_in_flight=load / arrivals / n,
            peak_in_flight=max(self._peak),
        )
        out["per_instance"] = [
            {
                "instance": i,
                "requests": self._routed[i],
                "request_share": self._routed[i] / arrivals,
                "block_hit_rate": p.block_hit_rate,
                "token_hit_rate": p.token_hit_rate,
                "hit_tokens": self._hit_tokens[i],
                "cross_instance_hit_tokens": p.cross_instance_hit_tokens,
                "mean_in_flight": self._load_sum[i] / arrivals,
                "peak_in_flight": self._peak[i],
            }
            for i, p in enumerate(points)
        ]
        return out


def ceiling_config(config: SimConfig, instances: int) -> SimConfig:
    """One instance holding what `instances` hold: host and disk tiers times `instances` (the
    shared remote tier stays one)."""

    def times(value: int | None) -> int | None:
        return None if value is None else value * instances

    return replace(
        config,
        host_blocks=times(config.host_blocks),
        host_bytes=times(config.host_bytes),
        disk_blocks=times(config.disk_blocks),
        disk_bytes=times(config.disk_bytes),
    )


def fleet_ceiling(requests: Sequence[SimRequest], instances: int, device_blocks: int, config: SimConfig) -> dict:
    """The trace through one instance with `instances` x the device pool and local tiers."""
    sim = TraceSimulator(device_blocks * instances, ceiling_config(config, instances))
    sim.replay(requests)
    sim.check_integrity()
    out = sim.result().to_dict(tiers=config.has_tiers)
    out.update(routing="ceiling", instances=1)
    return out


def simulate_fleet(
    requests: Sequence[SimRequest],
    device_blocks: Sequence[int],
    instances: int,
    routing: Sequence[str] = ROUTINGS,
    config: SimConfig | None = None,
    router: RouterConfig | None = None,
    **overrides: Any,
) -> dict:
    """Per device capacity (per instance): the fleet ceiling and each routing policy over
    `instances` instances; the dict the CLI prints with --json. `overrides`: SimConfig fields."""
    config = replace(config or SimConfig(), **overrides)
    router = router or RouterConfig()
    unknown = [r for r in routing if r not in ROUTINGS]
    if unknown or not routing:
        raise ValueError(f"routing must be some of {ROUTINGS}, got {list(routing)}")
    points = []
    for cap in device_blocks:
        policies = {}
        for name in routing:
            fleet = FleetSimulator(instances, cap, config, name, router)
            fleet.replay(requests)
            fleet.check_integrity()
            policies[name] = fleet.result()
        points.append(
            {
                "device_blocks": cap,
                "ceiling": fleet_ceiling(requests, instances, cap, config),
                "policies": policies,
            }
        )
    out = trace_summary(requests, config)
    out.update(instances=instances, routing=list(routing), router=asdict(router), points=points)
    return out


__all__ = [
    "ROUTINGS",
    "FleetSimulator",
    "RouterConfig",
    "ceiling_config",
    "fleet_ceiling",
    "simulate_fleet",
    "sum_points",
]
