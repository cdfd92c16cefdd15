"""Structured outputs and tool calls over HTTP, with the clients vLLM users run: the openai
SDK's `chat.completions.parse()` with a pydantic model, response_format, vLLM's guided_* and
structured_outputs fields, tool_choice named / required / auto (with and without
--enable-auto-tool-choice), tool-call deltas in a raw SSE stream (what curl shows)."""

from __future__ import annotations

import json

import httpx
import pytest
from serverutil import MODEL_NAME

pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytest.importorskip("pydantic")

from toolutil import COMPACT, SCHEMA, TOOLS, USER, Paint


@pytest.fixture(scope="module")
def server(serve):
    s = serve(*COMPACT)
    yield s
    assert "Traceback" not in s.log(), s.log()


@pytest.fixture(scope="module")
def tserver(serve):
    s = serve(*COMPACT, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    assert "Traceback" not in s.log(), s.log()


def _chat(server, **body):
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=120,
        json={"model": MODEL_NAME, "messages": USER, "max_tokens": 60, **body},
    )


def test_openai_parse_with_pydantic(server):
    client = server.openai()
    done = client.chat.completions.parse(
        model=MODEL_NAME, messages=USER, response_format=Paint, max_tokens=60, temperature=0.0
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Paint)


@pytest.mark.parametrize(
    "body",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
        {"guided_json": SCHEMA},
        {"structured_outputs": {"json": SCHEMA}},
    ],
)
def test_json_constraints_over_http(server, body):
    r = _chat(server, n=2, temperature=1.0, seed=5, **body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        value = json.loads(choice["message"]["content"])
        assert value["color"] in ("red", "green", "blue")


def test_completions_regex_choice_and_stream(server):
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={"prompt": "code:", "max_tokens": 10, "guided_regex": "[a-c]{4}", "temperature": 1.0, "seed": 1},
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["text"]) == 4
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        timeout=60,
        json={"prompt": "pick:", "max_tokens": 10, "guided_choice": ["alpha", "beta"], "stream": True},
    ) as s:
        text = "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in s.iter_lines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"]
        )
    assert text in ("alpha", "beta")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ],
)
def test_bad_constraints_are_400(server, body, param):
    r = _chat(server, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_named_and_required_tool_choice(server):
    r = _chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "paint"}}, temperature=0.0)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "paint" and call["id"]
    assert json.loads(call["function"]["arguments"])["color"] in ("red", "green", "blue")
    assert r.json()["choices"][0]["finish_reason"] == "stop"  # a named call: "stop", as vLLM and OpenAI
    r = _chat(server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=11, max_tokens=120)
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] in ("paint", "stop_now") for c in calls)
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    # the openai client reads them
    client = server.openai()
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        tools=TOOLS,
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "stop_now"}},
    )
    assert resp.choices[0].message.tool_calls[0].function.name == "stop_now"


def test_auto_needs_the_flag(server, tserver):
    r = _chat(server, tools=TOOLS)  # tool_choice defaults to auto with tools
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = _chat(tserver, tools=TOOLS, tool_choice="auto", max_tokens=8)
    assert r.status_code == 200, r.text  # this random model writes no <tool_call>: content only
    assert "tool_calls" not in r.json()["choices"][0]["message"]
    assert _chat(server, tools=TOOLS, tool_choice="none", max_tokens=4).status_code == 200


def test_streamed_tool_call_deltas(server):
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        timeout=60,
        json={
            "model": MODEL_NAME,
            "messages": USER,
            "max_tokens": 60,
            "stream": True,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "paint"}},
        },
    ) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    # as vLLM streams them: the first delta names the call, the others carry argument fragments
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["id"] and calls[0]["function"]["name"] == "paint"
    assert all(set(c) == {"index", "function"} for c in calls[1:])
    assert json.loads("".join(c["function"]["arguments"] for c in calls))["color"] in ("red", "green", "blue")
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_structured_outputs_config_is_checked(serve):
    with pytest.raises(RuntimeError, match="backend"):
        serve("--structured-outputs-config", '{"backend": "xgrammar"}')
