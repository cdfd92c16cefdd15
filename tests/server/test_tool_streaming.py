"""Streamed tool calls through a real server and the openai SDK: the random test model is held
to a model's tool-call text by `guided_choice` (one choice: the exact text a Qwen3-Coder model
writes), so tool_choice 'auto' with --tool-call-parser qwen3_coder reads real calls out of a
real stream. The SDK's accumulated stream must equal the non-streamed message, and the
arguments stream in fragments after the call's first delta."""

from __future__ import annotations

import pytest
from serverutil import MODEL_NAME

pytest.importorskip("openai")
pytest.importorskip("llguidance")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "paint",
            "parameters": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
            },
        },
    }
]
USER = [{"role": "user", "content": "Paint the fence."}]
OUTPUT = (
    "Sure.\n<tool_call>\n<function=paint>\n<parameter=ok>\ntrue\n</parameter>\n"
    "<parameter=color>\nred\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def server(serve):
    s = serve("--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder")
    yield s
    assert "Traceback" not in s.log(), s.log()


def _request(**extra):
    return {
        "model": MODEL_NAME,
        "messages": USER,
        "tools": TOOLS,
        "max_tokens": 160,
        "extra_body": {"guided_choice": [OUTPUT]},
        **extra,
    }


def test_streamed_calls_add_up_to_the_message(server):
    client = server.openai()
    whole = client.chat.completions.create(**_request())
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert message.content == "Sure."
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert calls == [("paint", '{"ok": true, "color": "red"}')]  # values read by the tool's schema

    chunks = list(client.chat.completions.create(**_request(), stream=True))
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or [] if ch.choices]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id and first.type == "function" and first.function.name == "paint"
    # later deltas only carry fragments (how many: as many as the stream's chunks, which a busy
    # machine may coalesce; tests/server/test_tool_parsers.py counts them for a given chunking)
    assert all(d.id is None and d.function.name is None and d.function.arguments for d in rest)
    assert "".join(d.function.arguments or "" for d in deltas) == calls[0][1]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Sure."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    with client.chat.completions.stream(**_request()) as stream:  # the SDK's own accumulation
        final = stream.get_final_completion().choices[0]
    assert final.message.content == "Sure." and final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == calls


def test_named_call_streams_its_arguments(server):
    """Under a named tool choice the whole output is the call's arguments: streamed as they are
    generated, the same text as the non-streamed call (greedy, so both runs write the same)."""
    client = server.openai()
    request = {
        "model": MODEL_NAME,
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "paint"}},
        "max_tokens": 40,
        "temperature": 0.0,
    }
    whole = client.chat.completions.create(**request).choices[0]
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or [] if ch.choices]
    assert deltas[0].function.name == "paint" and all(d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == whole.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
