"""Reading an OpenAI-style SSE stream (clients: the load test, the tests)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any


async def aiter_events(response: Any) -> AsyncIterator[dict[str, Any] | None]:
    """The parsed `data:` payloads of a streaming response; a final None stands for [DONE]."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            yield None
            return
        yield json.loads(data)
