"""The tools and schema of the structured-output tests, shared by the chat tests
(test_structured_and_tools.py) and the Responses API tests (test_responses_api.py): one `paint`
call whose arguments a schema bounds, one `stop_now`, the pydantic model of the same schema, and
the server flags that keep a random model's JSON short. Import it after
`pytest.importorskip("pydantic")`."""

from __future__ import annotations

from typing import Any, Literal

import pydantic

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
# chat completions' shape: {"type": "function", "function": {...}}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "paint", "description": "Paint something.", "parameters": SCHEMA}},
    {
        "type": "function",
        "function": {
            "name": "stop_now",
            "parameters": {
                "type": "object",
                "properties": {"why": {"enum": ["done", "tired"]}},
                "required": ["why"],
                "additionalProperties": False,
            },
        },
    },
]
# the Responses API's shape of the same tools: the function's fields beside "type"
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
USER = [{"role": "user", "content": "Paint the fence."}]
# a random model picks whitespace as readily as anything: JSON without it ends in bounded tokens
COMPACT = ("--structured-outputs-config", '{"disable_any_whitespace": true}')


class Paint(pydantic.BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]
