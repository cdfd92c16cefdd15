"""The tool-call parsers on the formats of the families kvtier serves, and the stream
splitter that holds back a call's text (a start marker cut between chunks included)."""

from __future__ import annotations

import json

from kvtier.server.tools import ToolStream, make_parser


def test_hermes():
    p = make_parser("hermes")
    content, calls = p.parse(
        'Sure.\n<tool_call>\n{"name": "get", "arguments": {"city": "Oslo"}}\n</tool_call>'
        '<tool_call>{"name": "put", "arguments": {}}</tool_call>'
    )
    assert content == "Sure." and [c.name for c in calls] == ["get", "put"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert p.parse("no call here") == ("no call here", [])


def test_llama3_json_and_mistral():
    content, calls = make_parser("llama3_json").parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}')
    assert content is None and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 1}
    assert make_parser("llama3_json").parse("plain words")[1] == []
    content, calls = make_parser("mistral").parse('[TOOL_CALLS] [{"name": "g", "arguments": {"y": 2}}]')
    assert content is None and calls[0].name == "g"


def test_stream_holds_back_a_split_marker():
    ts = ToolStream("auto", None, make_parser("hermes"))
    sent = ts.feed("Hello <tool") + ts.feed('_call>{"name": "f", ') + ts.feed('"arguments": {}}</tool_call>')
    assert sent == "Hello "
    rest, calls = ts.finish()
    assert calls[0].name == "f" and rest == ""
    plain = ToolStream("auto", None, make_parser("hermes"))
    assert plain.feed("just <tool") == "just "
    assert plain.feed("box") == "<toolbox"
    assert plain.finish() == ("", [])
