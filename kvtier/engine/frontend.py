"""make_engine_client: the one factory of the server's EngineClient, the engine on a thread of
the server process (InProcessEngineClient) or in its own process (ProcessEngineClient), given
the same settings either way; and `reset_prefix_cache`, an admin call that works with either."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.engine.client import EngineClient, InProcessEngineClient
from kvtier.engine.process import ProcessEngineClient
from kvtier.engine.protocol import AdminCall, AdminOp


def make_engine_client(
    *,
    core: Any = None,
    model: str | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    tenant_ttls: list[tuple[str, float]] | None = None,
    tenant_quotas: list[tuple[str, Any, Any]] | None = None,
    fleet_keys: tuple[str, float] | None = None,
    log_level: str = "info",
) -> EngineClient:
    """An EngineClient, not yet started. With `core` (an EngineCore, which the client owns from
    `start()` until `shutdown()`; the caller closes it after): the engine on a thread of this
    process. Else the engine process for `model` with `engine_kwargs`, started here (this
    blocks until its model is loaded). The tenants' TTLs and host/disk quotas and the fleet
    keys (master key file, check interval) apply to the engine before any request."""
    if core is not None:
        core.admin.apply_settings(tenant_ttls or [], tenant_quotas or [], fleet_keys)
        return InProcessEngineClient(core)
    if model is None:
        raise ValueError("make_engine_client needs a core or a model")
    client = ProcessEngineClient(
        model,
        engine_kwargs or {},
        tenant_ttls=tenant_ttls,
        tenant_quotas=tenant_quotas,
        fleet_keys=fleet_keys,
        log_level=log_level,
    )
    client.start_process()
    return client


async def reset_prefix_cache(client: EngineClient, tiers: Sequence[str]) -> dict[str, Any]:
    """Empty the prefix cache in `tiers` (of kvtier.engine.reset.TIERS) through `client`'s admin
    path, between two steps (running requests keep their blocks); kvtier.engine.reset.begin_reset
    describes the answer. ValueError for an unknown tier."""
    return await client._call(lambda call_id: AdminCall(call_id, AdminOp.RESET_PREFIX_CACHE, tiers=list(tiers)))
