"""Fault injection: slow, narrow or flaky storage on demand (`--tier-faults`, TierConfig.faults).

    --tier-faults disk=latency_ms=5,error_rate=0.1 ──> TierConfig.fault_for("disk")
                                                         │ FaultConfig.parse
                                                         v
                                                       FaultConfig ──> the tier's FaultInjector
    Tier._run (base.py) ──> FaultInjector.before_op: latency, then maybe InjectedError ──> backend
    Tier.get / put      ──> FaultInjector.transfer: nbytes through the capped link

The one injected failure is InjectedError (a TierError of kind "injected"); a tier counts it
like any backend error, so the health gate (health.py) and the stats see it as real trouble.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvtier.tiers.errors import TierError


class InjectedError(TierError):
    """The failure a FaultInjector makes up (kind "injected"): the only exception a tier may
    count as injected; anything else from the fault machinery is a real bug."""

    def __init__(self, message: str = "fault injection (error_rate)") -> None:
        super().__init__("injected", message)


@dataclass
class FaultConfig:
    """Faults a tier adds to its own operations: slow, narrow or flaky storage on demand.

    Used by experiments (what does a slow remote tier cost?) and tests. Latency is added to every
    operation that reaches the backend; the bandwidth cap delays reads and writes by
    nbytes / bandwidth, shared by all threads of the tier (one link, not one per thread).
    """

    latency_s: float = 0.0
    bandwidth_bytes_per_s: float | None = None
    error_rate: float = 0.0
    """Probability that an operation fails with InjectedError (a TierError, kind "injected")."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        if self.bandwidth_bytes_per_s is not None and self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth must be positive, got {self.bandwidth_bytes_per_s}")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {self.error_rate}")

    @property
    def active(self) -> bool:
        return self.latency_s > 0 or self.bandwidth_bytes_per_s is not None or self.error_rate > 0

    @classmethod
    def parse(cls, spec: str | None) -> FaultConfig:
        """Parse a CLI flag: "latency_ms=5,bandwidth_mbps=200,error_rate=0.1,seed=3".

        Keys: latency_ms, latency_s, bandwidth_mbps (megabytes per second, 10^6 bytes/s),
        bandwidth_gbps (gigabytes per second), bandwidth_bytes_per_s, error_rate, seed.
        An empty string or "none" means no faults.
        """
        cfg = cls()
        if spec is None or spec.strip().lower() in ("", "none", "off"):
            return cfg
        scale = {
            "latency_ms": ("latency_s", 1e-3),
            "latency_s": ("latency_s", 1.0),
            "bandwidth_mbps": ("bandwidth_bytes_per_s", 1e6),
            "bandwidth_gbps": ("bandwidth_bytes_per_s", 1e9),
            "bandwidth_bytes_per_s": ("bandwidth_bytes_per_s", 1.0),
            "error_rate": ("error_rate", 1.0),
        }
        values: dict[str, Any] = {}
        for item in spec.split(","):
            name, sep, raw = item.partition("=")
            name = name.strip().lower()
            if not sep or (name not in scale and name != "seed"):
                raise ValueError(
                    f"bad fault spec item {item!r} in {spec!r}; expected key=value "
                    f"with key one of {sorted([*scale, 'seed'])}"
                )
            try:
                if name == "seed":
                    values["seed"] = int(raw)
                else:
                    attr, factor = scale[name]
                    values[attr] = float(raw) * factor
            except ValueError:
                raise ValueError(f"bad number {raw!r} for {name!r} in fault spec {spec!r}") from None
        return replace(cfg, **values)


class FaultInjector:
    """Applies one FaultConfig. Thread-safe; the random stream is seeded, so a single-threaded
    run fails the same operations every time. `before_op` raises only InjectedError; both
    methods may block (the configured latency, the bandwidth queue)."""

    def __init__(self, config: FaultConfig | None, sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config or FaultConfig()
        self._rng = random.Random(self.config.seed)
        self._lock = threading.Lock()
        self._link_free_at = 0.0  # monotonic time when the simulated link is next idle
        self._sleep = sleep

    def before_op(self) -> None:
        """Latency, then maybe an injected failure (InjectedError). Called before the backend
        is touched."""
        cfg = self.config
        if cfg.latency_s > 0:
            self._sleep(cfg.latency_s)
        if cfg.error_rate > 0:
            with self._lock:
                fail = self._rng.random() < cfg.error_rate
            if fail:
                raise InjectedError()

    def transfer(self, nbytes: int) -> None:
        """Hold the caller until `nbytes` have passed the capped link (queued behind others)."""
        bw = self.config.bandwidth_bytes_per_s
        if bw is None or nbytes <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._link_free_at)
            self._link_free_at = start + nbytes / bw
            wait_s = self._link_free_at - now
        self._sleep(wait_s)
