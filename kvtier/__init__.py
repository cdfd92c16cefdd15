"""kvtier: a KV-cache-centric LLM inference engine.

The public names load lazily, so that `import kvtier.kvcache` (the simulator, property tests)
does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "kvtier.llm",
    "SamplingParams": "kvtier.sampling_params",
    "RequestOutput": "kvtier.outputs",
    "CompletionOutput": "kvtier.outputs",
    "RequestMetrics": "kvtier.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
