"""Storage tiers below the device KV pool: the protocol (base, with errors, faults: fault
injection, and health: the health gate), the frame codec, host, disk, remote, their shared LRU
bookkeeping (lru), and the hierarchy over them (hierarchy, with tenants: per-tenant
administration, and sealing: frames encrypted with per-tenant data keys).

Names load lazily: `kvtier.tiers.base` needs neither torch nor redis, so bookkeeping layers and
the simulator can import the protocol alone.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Tier": "kvtier.tiers.base",
    "TierError": "kvtier.tiers.errors",
    "TierStats": "kvtier.tiers.base",
    "FaultConfig": "kvtier.tiers.faults",
    "HealthGate": "kvtier.tiers.health",
    "encode": "kvtier.tiers.codec",
    "decode": "kvtier.tiers.codec",
    "load_tensor": "kvtier.tiers.codec",
    "store_tensor": "kvtier.tiers.codec",
    "payload_nbytes_estimate": "kvtier.tiers.codec",
    "CodecError": "kvtier.tiers.codec",
    "CorruptEntryError": "kvtier.tiers.codec",
    "WrongEntryError": "kvtier.tiers.codec",
    "DiskTier": "kvtier.tiers.disk",
    "RemoteTier": "kvtier.tiers.remote",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvtier.tiers' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
