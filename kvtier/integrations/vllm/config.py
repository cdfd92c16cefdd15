"""The connector's configuration: vLLM's `kv_connector_extra_config` parsed into kvtier's
TierConfig and the connector's own options, and the vLLM settings the connector requires."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvtier.cli.args import parse_size
from kvtier.tiers.hierarchy import TIER_ORDER, TierConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

EXTRA_CONFIG_KEYS = {
    "host_cache_bytes": "bytes of host memory for KV blocks (int or '8GiB')",
    "disk_cache_dir": "directory of the disk tier",
    "disk_cache_bytes": "capacity of the disk tier (default 16GiB)",
    "remote_cache_url": "redis://, rediss://, valkey:// or redis+cluster://host:port,...",
    "remote_ttl_s": "time to live of Redis entries (seconds)",
    "remote_timeout_s": "socket timeout of Redis operations (default 1.0)",
    "restore_policy": "'cost' (default) or 'always'",
    "cache_write_policy": "'write_through' (default) or 'write_back' (host first, demoted on eviction)",
    "compression": "None, 'lz4' or 'zstd' for disk and Redis frames",
    "kv_key_dir": "per-tenant (cache_salt) AES-256-GCM data keys kept here: encryption at rest",
    "kv_master_key_file": "fleet keys wrapped by this master key, kept in Redis",
    "kv_key_check_interval_s": "with fleet keys: how often a cached data key is re-checked (default 1.0)",
    "faults": "fault injection per tier, e.g. {'disk': 'error_rate=0.5'}",
    "io_threads": "background I/O workers per rank (default 2)",
    "max_pending_stores": "queued disk/Redis writes beyond this are dropped (default 4096)",
    "remote_lookup_wait_ms": "how long one scheduling pass waits for a Redis lookup (default 5)",
    "purge_check_interval_s": "how often the workers and the scheduler look for purge requests (default 1.0)",
    "reset_tiers": (
        "tiers that vLLM's reset_prefix_cache(reset_external=true) clears (default ['host', 'disk']; "
        "the others, e.g. a Redis other instances share, are kept and logged as kept)"
    ),
}

DEFAULT_RESET_TIERS = ("host", "disk")
"""What a reset clears unless `reset_tiers` says otherwise: this instance's own tiers. Redis is
kept: other instances (a fleet, a prefill/decode pair) read it too."""

ROLES = ("kv_both", "kv_producer", "kv_consumer")
"""vLLM's kv_role: kv_both stores and loads, kv_producer (a prefill instance) only stores,
kv_consumer (a decode instance) only loads."""


def _size(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config.{name}: a byte count, got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"kv_connector_extra_config.{name} must be positive, got {value!r}")
        return int(value)
    try:
        return parse_size(str(value))
    except ValueError as e:
        raise ValueError(f"kv_connector_extra_config.{name}: {e}") from None


def tier_config_from_extra(extra: dict[str, Any]) -> tuple[TierConfig, dict[str, Any]]:
    """kvtier's TierConfig from vLLM's `kv_connector_extra_config`, and the connector's own
    options (`remote_lookup_wait_s`, `purge_check_interval_s`, `reset_tiers`). An unknown key is an error
    (nothing is silently ignored)."""
    unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
    if unknown:
        known = "\n".join(f"  {k}: {v}" for k, v in EXTRA_CONFIG_KEYS.items())
        raise ValueError(f"kvtier connector: unknown kv_connector_extra_config keys {unknown}; known:\n{known}")
    policy = extra.get("cache_write_policy", "write_through")
    if policy == "selective":
        raise ValueError(
            "cache_write_policy 'selective' counts device hits, which vLLM keeps to itself: "
            "use 'write_through' or 'write_back' under vLLM"
        )
    faults = extra.get("faults") or {}
    if not isinstance(faults, dict):
        raise ValueError("kv_connector_extra_config.faults: a mapping of tier name to fault spec")
    config = TierConfig(
        host_cache_bytes=_size(extra.get("host_cache_bytes"), "host_cache_bytes"),
        disk_cache_dir=extra.get("disk_cache_dir"),
        disk_cache_bytes=_size(extra.get("disk_cache_bytes"), "disk_cache_bytes"),
        remote_cache_url=extra.get("remote_cache_url"),
        remote_ttl_s=extra.get("remote_ttl_s"),
        remote_timeout_s=float(extra.get("remote_timeout_s", 1.0)),
        cache_write_policy=policy,
        compression=extra.get("compression"),
        key_dir=extra.get("kv_key_dir"),
        master_key_file=extra.get("kv_master_key_file"),
        key_check_interval_s=float(extra.get("kv_key_check_interval_s", 1.0)),
        restore_policy=extra.get("restore_policy", "cost"),
        faults=tuple((str(k), str(v)) for k, v in faults.items()),
        io_threads=int(extra.get("io_threads", 2)),
        max_pending_stores=int(extra.get("max_pending_stores", 4096)),
    )
    if not config.enabled:
        raise ValueError(
            "kvtier connector: configure at least one tier (host_cache_bytes, disk_cache_dir "
            "or remote_cache_url) in kv_connector_extra_config"
        )
    options = {
        "remote_lookup_wait_s": float(extra.get("remote_lookup_wait_ms", 5.0)) / 1000.0,
        "purge_check_interval_s": float(extra.get("purge_check_interval_s", 1.0)),
        "reset_tiers": _reset_tiers(extra.get("reset_tiers", DEFAULT_RESET_TIERS)),
    }
    return config, options


def _reset_tiers(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"kv_connector_extra_config.reset_tiers: a list of tier names, got {value!r}")
    unknown = sorted(set(value) - set(TIER_ORDER))
    if unknown:
        raise ValueError(f"kv_connector_extra_config.reset_tiers: unknown tiers {unknown}; tiers: {list(TIER_ORDER)}")
    return tuple(n for n in TIER_ORDER if n in value)


def connector_role(kv_transfer_config: Any) -> str:
    """vLLM's kv_role for this connector (kv_both when unset)."""
    role = getattr(kv_transfer_config, "kv_role", None) or "kv_both"
    if role not in ROLES:
        raise ValueError(f"kvtier connector: kv_role {role!r} is not one of {list(ROLES)}")
    return str(role)


def require_recompute_on_load_failure(kv_transfer_config: Any, log: bool) -> None:
    """Set vLLM's `kv_load_failure_policy` to 'recompute'. vLLM's default fails a request whose
    external KV did not load; for a cache a failed read is a miss, and vLLM must recompute it
    (vLLM's scheduler reads the policy after the connector is built)."""
    if getattr(kv_transfer_config, "kv_load_failure_policy", "recompute") == "recompute":
        return
    kv_transfer_config.kv_load_failure_policy = "recompute"
    if log:
        logger.info(
            "kvtier connector: kv_load_failure_policy set to 'recompute' (a block that "
            "fails to load is recomputed, never an error); inside MultiConnector set "
            '"kv_load_failure_policy": "recompute" on the MultiConnector\'s own config'
        )


def check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Raise ValueError for a vLLM configuration the connector cannot serve correctly."""
    if not vllm_config.cache_config.enable_prefix_caching:
        raise ValueError(
            "kvtier connector needs vLLM's prefix caching (--enable-prefix-caching): "
            "restored blocks become vLLM prefix-cache blocks"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError(
            "kvtier connector: speculative decoding is not supported (draft tokens would be saved as computed KV)"
        )
    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
        raise ValueError(
            "kvtier connector supports models with one KV cache group (no hybrid attention / sliding-window mixes)"
        )


def kv_events_on(vllm_config: Any) -> bool:
    """vLLM publishes KV events (`--kv-events-config` with enable_kv_cache_events): the
    connector then reports its tiers' stores and removals through `take_events`."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)
