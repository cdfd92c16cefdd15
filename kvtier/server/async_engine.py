"""The engine on a thread of the server process (`kvtier serve --engine-in-process`): the
names the server and its tests have used, now kvtier.engine.client's (one client interface,
kvtier.engine.loop's one engine loop)."""

from __future__ import annotations

from kvtier.engine.client import (
    EngineDeadError,
    EngineStepError,
    FinishedHook,
    RequestSpec,
    RequestStream,
)
from kvtier.engine.client import InProcessEngineClient as AsyncEngine

__all__ = ["AsyncEngine", "EngineDeadError", "EngineStepError", "FinishedHook", "RequestSpec", "RequestStream"]
