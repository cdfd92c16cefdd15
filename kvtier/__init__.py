"""kvtier: a KV-cache-centric LLM inference engine.

The public names load lazily, so that `import kvtier.kvcache` (the simulator, property tests)
does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# libgomp reads its barrier wait policy when torch loads it: set kvtier's before anything imports
# torch (kvtier.threads; a policy the user set wins)
from kvtier.threads import set_wait_policy as _set_wait_policy

try:
    _set_wait_policy()
except ValueError as _e:  # a bad KVTIER_OMP_WAIT: say so, keep libgomp's default
    import warnings

    warnings.warn(f"kvtier: {_e}; using libgomp's default wait policy", stacklevel=1)

_EXPORTS = {
    "LLM": "kvtier.llm",
    "SamplingParams": "kvtier.sampling_params",
    "StructuredOutputsParams": "kvtier.structured",
    "RequestOutput": "kvtier.outputs",
    "CompletionOutput": "kvtier.outputs",
    "RequestMetrics": "kvtier.outputs",
    "Logprob": "kvtier.outputs",
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
