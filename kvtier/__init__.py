"""kvtier: a KV-cache-centric LLM inference engine.

The public names load lazily, so that `import kvtier.kvcache` (the simulator, property tests)
does not pull in torch. Importing kvtier changes no environment variable; the first access of
`kvtier.LLM` (which loads torch) first sets libgomp's barrier wait policy for this process
(kvtier.threads.wait.apply_wait_policy; a no-op once torch is loaded).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "kvtier.llm",
    "SamplingParams": "kvtier.sampling_params",
    "StructuredOutputsParams": "kvtier.structured",
    "RequestOutput": "kvtier.outputs",
    "CompletionOutput": "kvtier.outputs",
    "RequestMetrics": "kvtier.outputs",
    "Logprob": "kvtier.outputs",
    "LoRARequest": "kvtier.lora",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        if name == "LLM" and "torch" not in sys.modules:
            # an engine is about to be built: libgomp reads its wait policy when torch loads it
            from kvtier.threads.wait import apply_wait_policy

            apply_wait_policy()
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
