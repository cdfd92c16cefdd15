"""The vLLM interface the connector is built on: vLLM's connector base classes (with a clear
error when vLLM is not installed), the check that the installed vLLM is a tested release, and
kvtier's log output routed through vLLM's handlers."""

from __future__ import annotations

import logging
import os
from typing import Any

try:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError as e:  # pragma: no cover - only without vLLM
    raise ImportError(
        "kvtier.integrations.vllm needs vLLM (pip install 'kvtier[vllm]', or scripts/vllm-venv.sh for vLLM-CPU)"
    ) from e

TESTED_VLLM_VERSIONS = ("0.32",)
"""vLLM releases (major.minor) whose connector interface this package was tested against."""
_UNTESTED_ENV = "KVTIER_VLLM_ALLOW_UNTESTED"

_CONNECTOR_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "update_connector_output",
)
"""The methods of vLLM's KVConnectorBase_V1 the connector implements and vLLM must call."""


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM version; raises RuntimeError on one this package was not tested with
    (set KVTIER_VLLM_ALLOW_UNTESTED=1 to try anyway)."""
    version = version or str(getattr(vllm, "__version__", "unknown"))
    major_minor = ".".join(version.split("+")[0].split(".")[:2])
    if major_minor not in TESTED_VLLM_VERSIONS and os.environ.get(_UNTESTED_ENV) != "1":
        raise RuntimeError(
            f"kvtier's vLLM connector is tested with vLLM {', '.join(TESTED_VLLM_VERSIONS)}.x; this is "
            f"vLLM {version}, whose connector interface may differ. Install a tested version "
            f"(pip install 'kvtier[vllm]') or set {_UNTESTED_ENV}=1 to try it."
        )
    missing = [m for m in _CONNECTOR_METHODS if not hasattr(KVConnectorBase_V1, m)]
    if missing:
        raise RuntimeError(
            f"vLLM {version}'s KVConnectorBase_V1 lacks {missing}: not an interface kvtier's connector supports"
        )
    return version


def log_through_vllm() -> None:
    """kvtier's loggers (tier down / back, load failures) write where vLLM's do, at its level."""
    root = logging.getLogger("kvtier")
    if root.handlers:
        return
    source = logging.getLogger("vllm")
    for handler in source.handlers:
        root.addHandler(handler)
    root.setLevel(source.level or logging.INFO)
    root.propagate = False


__all__ = [
    "TESTED_VLLM_VERSIONS",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "check_vllm_version",
    "log_through_vllm",
]


def to_vllm_events(events: list[Any]) -> list[Any]:
    """kvtier's KV event structs (kvtier.kv_events, the same fields and encoding) as vLLM's own
    classes, so vLLM's publisher and aggregators handle them as they handle theirs."""
    if not events:
        return []
    from vllm.distributed import kv_events as vk

    out = []
    for ev in events:
        cls = getattr(vk, type(ev).__name__)
        out.append(cls(**{f: getattr(ev, f) for f in ev.__struct_fields__}))
    return out
