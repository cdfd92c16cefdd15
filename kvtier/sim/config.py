"""What one simulated machine looks like: block size, tier capacities, policies and speeds.

Default speeds are the ones measured on the project's benchmark machine (docs/benchmarks.md,
"TTFT by where the KV comes from", reference model, 2,048-token prefix; the figures live there):
restore throughput from host memory, from local disk and from Redis (reads pipelined 32 at a
time), read plus copy into the pool, and recompute time per prefill token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.tiers.hierarchy import WRITE_POLICIES

DEFAULT_BYTES_PER_TOKEN = 12 * 1024
"""KV bytes per token of the reference model (12 KiB)."""
DEFAULT_PREFILL_S_PER_TOKEN = 0.78e-3
"""Prefill seconds per token measured on the reference model."""
FRAME_OVERHEAD_BYTES = 100
"""Codec header of one KV block frame (a 5-dimensional tensor: 60 + 8 * 5 bytes)."""


@dataclass(frozen=True)
class TierSpeeds:
    """Fixed speeds for the restore-or-recompute decision and the time-saved estimate."""

    host_bytes_per_s: float = 7.2e9
    """Restore throughput from host memory (read + copy into the pool)."""
    host_latency_s: float = 1e-6
    """Per restore job touching the host tier."""
    disk_bytes_per_s: float = 1.85e9
    """Restore throughput from the disk tier (read + decode + copy into the pool)."""
    disk_latency_s: float = 1e-4
    """Per restore job touching the disk tier."""
    remote_bytes_per_s: float = 0.8e9
    """Restore throughput from the shared remote tier (Redis: pipelined reads + decode + copy)."""
    remote_latency_s: float = 5e-4
    """Per restore job touching the remote tier (a network round trip)."""
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    """Prefill cost per new token (a in t = a*n + b*n*(c + n/2))."""
    prefill_s_per_token_pair: float = 0.0
    """Attention cost per (new token, context token) pair (b in the same model)."""

    def __post_init__(self) -> None:
        for name in ("host_bytes_per_s", "disk_bytes_per_s", "remote_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in (
            "host_latency_s",
            "disk_latency_s",
            "remote_latency_s",
            "prefill_s_per_token",
            "prefill_s_per_token_pair",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


@dataclass(frozen=True)
class SimConfig:
    """Everything but the device capacity, which a sweep varies."""

    block_tokens: int = 512
    """Tokens per block (per trace hash id)."""
    block_bytes: int | None = None
    """KV bytes per block (default 12 KiB x block_tokens, the reference model)."""
    policy: str = "lru"
    """Device eviction policy: 'lru' or 'lfu'."""
    host_blocks: int | None = None
    """Host tier capacity in blocks (or give host_bytes)."""
    host_bytes: int | None = None
    """Host tier capacity in bytes (whole blocks count)."""
    disk_blocks: int | None = None
    """Disk tier capacity in blocks (or give disk_bytes)."""
    disk_bytes: int | None = None
    """Disk tier capacity in bytes; a disk entry is a frame of block_bytes + 100 bytes, charged
    as the file system allocates it (whole disk_alloc_bytes units), as the disk tier counts it."""
    disk_alloc_bytes: int = 4096
    """The disk file system's allocation unit (st_blksize: 4096 on ext4, xfs and tmpfs)."""
    remote_blocks: int | None = None
    """Remote tier (Redis) capacity in blocks (or give remote_bytes). In a simulated fleet
    (kvtier.sim.fleet) one remote tier is shared by every instance."""
    remote_bytes: int | None = None
    """Remote tier capacity in bytes; an entry is a frame of block_bytes + 100 bytes (Redis
    counts value lengths: no allocation unit)."""
    write_policy: str = "write_through"
    """'write_through', 'write_back' or 'selective', as the engine's cache_write_policy."""
    selective_min_hits: int = 2
    """With 'selective': device hits before a block is written down."""
    restore_policy: str = "cost"
    """'cost': restore what the cost model says beats recomputing; 'always': every stored block."""
    speeds: TierSpeeds = field(default_factory=TierSpeeds)

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")
        if self.block_bytes is not None and self.block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {self.block_bytes}")
        if self.policy not in ("lru", "lfu"):
            raise ValueError(f"policy must be 'lru' or 'lfu', got {self.policy!r}")
        for tier in ("host", "disk", "remote"):
            blocks, nbytes = getattr(self, f"{tier}_blocks"), getattr(self, f"{tier}_bytes")
            if blocks is not None and nbytes is not None:
                raise ValueError(f"give {tier}_blocks or {tier}_bytes, not both")
            if (blocks is not None and blocks <= 0) or (nbytes is not None and nbytes <= 0):
                raise ValueError(f"{tier} capacity must be positive")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.restore_policy not in ("cost", "always"):
            raise ValueError(f"restore_policy must be 'cost' or 'always', got {self.restore_policy!r}")
        if self.disk_alloc_bytes < 1:
            raise ValueError("disk_alloc_bytes must be >= 1")
        if self.selective_min_hits < 1:
            raise ValueError("selective_min_hits must be >= 1")

    @property
    def kv_block_bytes(self) -> int:
        return self.block_bytes or self.block_tokens * DEFAULT_BYTES_PER_TOKEN

    @property
    def frame_bytes(self) -> int:
        """Bytes of one block as the disk tier stores it (codec header + KV)."""
        return self.kv_block_bytes + FRAME_OVERHEAD_BYTES

    @property
    def host_cache_bytes(self) -> int | None:
        if self.host_blocks is not None:
            return self.host_blocks * self.kv_block_bytes
        return self.host_bytes

    @property
    def disk_cache_bytes(self) -> int | None:
        if self.disk_blocks is not None:
            return self.disk_blocks * self.disk_frame_charge_bytes
        return self.disk_bytes

    @property
    def disk_frame_charge_bytes(self) -> int:
        """What one disk frame costs the disk tier's cap: frame_bytes in whole allocation units."""
        unit = self.disk_alloc_bytes
        return -(-self.frame_bytes // unit) * unit

    @property
    def remote_cache_bytes(self) -> int | None:
        if self.remote_blocks is not None:
            return self.remote_blocks * self.frame_bytes
        return self.remote_bytes

    @property
    def has_remote(self) -> bool:
        return bool(self.remote_cache_bytes)

    @property
    def has_tiers(self) -> bool:
        return bool(self.host_cache_bytes or self.disk_cache_bytes or self.remote_cache_bytes)
