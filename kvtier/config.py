"""Engine configuration: frozen dataclasses, one per concern, composed.

Importing it imports no other kvtier module: the scheduler's and the tiers' own configs
(SchedulerConfig, TierConfig) are imported when an EngineConfig first needs their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.kv_events import KVEventsConfig
    from kvtier.sched.scheduler import SchedulerConfig
    from kvtier.tiers.hierarchy import TierConfig


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to serve and how."""

    model: str
    """Path to a Hugging Face model directory (config.json + *.safetensors)."""
    dtype: str = "auto"
    """'auto' (the checkpoint's), 'float32', 'bfloat16' or 'float16'."""
    quantization: str | None = None
    """How the projections hold their weights (vLLM's flag name): None (a GGUF file's own quantized
    blocks on CPU, else the model dtype), 'gguf', 'int8' (8-bit weight-only, quantized at load) or
    'none' (the model dtype; a GGUF file dequantized at load). See kvtier.model.quant_linear."""
    device: str | None = None
    """torch device; default: cuda if available, else cpu."""
    seed: int = 0
    """Seed for requests that do not set their own."""
    max_model_len: int | None = None
    """Longest prompt + output; default: the model's max_position_embeddings."""
    tokenizer: str | None = None
    """Tokenizer directory; default: the model directory."""
    cpu_threads_bind: str | None = None
    """CPU compute threads: 'auto', 'nobind' or a CPU list such as '0-3' (default: the
    KVTIER_CPU_THREADS_BIND environment variable, else auto; see kvtier.threads)."""
    num_threads: int | None = None
    """Compute threads (default: KVTIER_NUM_THREADS, else one per CPU of the compute set)."""


@dataclass(frozen=True)
class CacheConfig:
    """The device KV pool and its prefix cache."""

    block_size: int = 16
    """Tokens per KV block."""
    num_device_blocks: int | None = None
    """Blocks in the device pool (or give kv_cache_bytes)."""
    kv_cache_bytes: int | None = None
    """Bytes of the device pool (or give num_device_blocks)."""
    enable_prefix_caching: bool = True
    """Reuse KV of equal prefixes across requests."""
    eviction_policy: str = "lru"
    """'lru' or 'lfu'."""
    memory_fraction: float | None = None
    """Without num_device_blocks / kv_cache_bytes: the share of the device memory available after
    the weights that the pool takes (kvtier's kv_cache_memory_fraction; default 0.25, capped at
    4 GiB only when not given)."""
    memory_utilization: float | None = None
    """vLLM's gpu_memory_utilization: the share of the machine's (device's) total memory this
    instance may use, weights included; the pool takes what the weights and a working reserve
    leave of it, checked against the memory available at start."""
    kv_cache_dtype: str = "auto"
    """How cached tokens are stored, on the device and in every tier: 'auto' (the model dtype),
    'bfloat16', 'float16', 'float32', 'fp8_e4m3', 'fp8_e5m2' or 'int8' (1 byte, per-block scales)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_device_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_device_blocks or kv_cache_bytes, not both")
        if self.num_device_blocks is not None and self.num_device_blocks < 1:
            raise ValueError("num_device_blocks must be >= 1")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes must be >= 1")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.memory_utilization is not None and not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.memory_utilization}")
        given = [self.num_device_blocks, self.kv_cache_bytes, self.memory_fraction, self.memory_utilization]
        if sum(v is not None for v in given) > 1:
            raise ValueError(
                "size the KV pool one way: num_device_blocks, kv_cache_bytes, kv_cache_memory_fraction "
                "or gpu_memory_utilization"
            )


@dataclass(frozen=True)
class DriftConfig:
    """The online KV drift monitor (kvtier.engine.drift)."""

    sample_rate: float = 0.0
    """Fraction of requests shadow-computed with full-precision KV (0: off, no cost)."""
    seed: int = 0
    """Mixed into the per-request sampling hash."""
    max_positions: int = 256
    """Generated positions compared per sampled request (the first ones)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"kv_drift_sample_rate must be in [0, 1], got {self.sample_rate}")
        if self.max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {self.max_positions}")

    @property
    def enabled(self) -> bool:
        return self.sample_rate > 0.0


def _scheduler_config() -> SchedulerConfig:
    from kvtier.sched.scheduler import SchedulerConfig

    return SchedulerConfig()


def _tier_config() -> TierConfig:
    from kvtier.tiers.hierarchy import TierConfig

    return TierConfig()


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from; only `model` has no default."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=_scheduler_config)
    tiers: TierConfig = field(default_factory=_tier_config)
    drift: DriftConfig = field(default_factory=DriftConfig)
    kv_events: KVEventsConfig | None = None
    """Publish the cache's contents as vLLM-format KV events (kvtier.kv_events); None: off."""
