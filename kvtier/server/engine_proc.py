"""`kvtier serve`'s engine core in its own process: `python -m kvtier.server.engine_proc` runs
kvtier.engine.process.engine_main. The names the server and its tests have used are
kvtier.engine.process's and kvtier.engine.client's."""

from __future__ import annotations

import sys

from kvtier.engine.client import EngineDeadError, EngineStepError, RequestSpec, RequestStream
from kvtier.engine.process import READY_TIMEOUT_S, engine_main
from kvtier.engine.process import ProcessEngineClient as EngineClient

__all__ = [
    "READY_TIMEOUT_S",
    "EngineClient",
    "EngineDeadError",
    "EngineStepError",
    "RequestSpec",
    "RequestStream",
    "engine_main",
]

if __name__ == "__main__":
    sys.exit(engine_main())
