"""POST /v1/responses over HTTP with the openai SDK (`responses.create`, `responses.stream`,
`responses.parse`): text and streamed text, instructions and multi-turn items rendered as
the chat endpoint renders the same messages, max_output_tokens -> incomplete, text.format,
function tools (named, required, a follow-up turn with function_call_output, streamed
argument events), refusals, auth and per-key limits, cached tokens, disconnects."""

from __future__ import annotations

import json

import httpx
import pytest
from serverutil import BLOCK_SIZE, ENGINE_MODES, MAX_MODEL_LEN, MODEL_NAME, scrape

pytest.importorskip("llguidance")
pytest.importorskip("pydantic")

from toolutil import COMPACT, RESPONSES_TOOLS, SCHEMA, USER, Paint

openai = pytest.importorskip("openai")

# The Responses API is a translation in the HTTP layer, onto the chat route: above the engine
# client, so its tests run in the default process mode only (conftest.py); the plain and streamed
# request of test_text_and_stream_agree, through the engine, runs in both modes.
pytestmark = pytest.mark.engine_modes("process")
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(serve):
    s = serve(*COMPACT)
    yield s
    assert "Traceback" not in s.log(), s.log()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def _post(server, body, headers=None):
    return httpx.post(f"{server.url}/v1/responses", json={"model": MODEL_NAME, **body}, headers=headers, timeout=120)


def _events(server, body) -> list[dict]:
    """The raw SSE events of a streamed response (each `data:` after its `event:` line)."""
    events = []
    with httpx.stream(
        "POST", f"{server.url}/v1/responses", json={"model": MODEL_NAME, "stream": True, **body}, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        kind = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                event = json.loads(line[5:])
                assert event["type"] == kind
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _prompt_tokens(server, messages) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


@pytest.mark.engine_modes(*ENGINE_MODES)
def test_text_and_stream_agree(client, server):
    done = client.responses.create(model=MODEL_NAME, input="Tell me a story.", max_output_tokens=12, **GREEDY)
    assert done.object == "response" and done.id.startswith("resp_") and done.model == MODEL_NAME
    assert [item.type for item in done.output] == ["message"]
    assert done.output[0].content[0].type == "output_text" and done.output_text
    usage = done.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens == _prompt_tokens(server, [{"role": "user", "content": "Tell me a story."}])

    streamed = list(
        client.responses.create(model=MODEL_NAME, input="Tell me a story.", max_output_tokens=12, stream=True, **GREEDY)
    )
    kinds = [e.type for e in streamed]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in streamed if e.type == "response.output_text.delta"]
    # greedy: the same text (how many deltas carry it depends on how the steps and the event
    # loop interleave on a busy machine, so only their concatenation is checked)
    assert deltas and "".join(deltas) == done.output_text
    final = streamed[-1].response
    assert final.output_text == done.output_text and final.status == done.status
    assert final.usage.output_tokens == usage.output_tokens
    assert {e.response.id for e in streamed if hasattr(e, "response")} == {final.id}

    # the SDK's accumulating helper reads the same stream
    with client.responses.stream(model=MODEL_NAME, input="Tell me a story.", max_output_tokens=12, **GREEDY) as s:
        helper = s.get_final_response()
    assert helper.output_text == done.output_text
    server.check_idle_clean()


def test_instructions_and_multi_turn_items_render_as_chat(client, server):
    """instructions + message items (string and part contents, developer as system) render
    to the same prompt as the chat endpoint's messages, and greedy decoding answers the same."""
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "Name a color."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Red."}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Another "}, {"type": "input_text", "text": "one."}],
        },
    ]
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another one."},
    ]
    done = client.responses.create(
        model=MODEL_NAME, instructions="You are terse.", input=items, max_output_tokens=8, **GREEDY
    )
    assert done.instructions == "You are terse."
    assert done.usage.input_tokens == _prompt_tokens(server, messages)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, **GREEDY)
    assert done.output_text == chat.choices[0].message.content


def test_max_output_tokens_is_incomplete(client):
    done = client.responses.create(
        model=MODEL_NAME, input="Go on.", max_output_tokens=5, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.usage.output_tokens == 5 and done.max_output_tokens == 5
    assert done.output[0].status == "incomplete"


def test_json_schema_text_format(client):
    done = client.responses.create(
        model=MODEL_NAME,
        input="Paint the fence.",
        text={"format": {"type": "json_schema", "name": "paint", "schema": SCHEMA, "strict": True}},
        max_output_tokens=60,
        temperature=1.0,
        extra_body={"seed": 3},
    )
    assert done.status == "completed"  # the grammar ended the output
    assert json.loads(done.output_text)["color"] in ("red", "green", "blue")
    assert done.text.format.type == "json_schema"
    parsed = client.responses.parse(model=MODEL_NAME, input="Paint it.", text_format=Paint, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Paint)
    done = client.responses.create(
        model=MODEL_NAME, input="JSON please.", text={"format": {"type": "json_object"}}, max_output_tokens=60
    )
    if done.status == "completed":  # a random model may write a long object: cut short, not JSON
        assert isinstance(json.loads(done.output_text), dict)


def test_function_tool_call_and_follow_up_turn(client, server):
    first = client.responses.create(
        model=MODEL_NAME,
        input=USER,
        tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "paint"},
        max_output_tokens=60,
        **GREEDY,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and first.output_text == ""
    call = calls[0]
    assert call.name == "paint" and call.call_id and call.id.startswith("fc_") and call.status == "completed"
    assert json.loads(call.arguments)["color"] in ("red", "green", "blue")

    required = client.responses.create(
        model=MODEL_NAME,
        input=USER,
        tools=RESPONSES_TOOLS,
        tool_choice="required",
        max_output_tokens=120,
        temperature=1.0,
        extra_body={"seed": 11},
    )
    names = [item.name for item in required.output if item.type == "function_call"]
    assert names and set(names) <= {"paint", "stop_now"}

    # the tool loop: the previous output and the tool's result go back as input items
    follow_up = [*USER, *first.output, {"type": "function_call_output", "call_id": call.call_id, "output": "painted"}]
    second = client.responses.create(
        model=MODEL_NAME, input=follow_up, tools=RESPONSES_TOOLS, tool_choice="none", **GREEDY
    )
    assert second.status in ("completed", "incomplete")
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "paint", "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "painted"},
    ]
    assert second.usage.input_tokens == _prompt_tokens(server, messages)


def test_streamed_function_call_events(server):
    events = _events(
        server,
        {
            "input": "Paint the fence.",
            "tools": RESPONSES_TOOLS,
            "tool_choice": {"type": "function", "name": "paint"},
            "max_output_tokens": 60,
        },
    )
    kinds = [e["type"] for e in events]
    num_deltas = kinds.count("response.function_call_arguments.delta")
    assert num_deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * num_deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, deltas, (args_done, item_done, completed) = events[2], events[3:-3], events[-3:]
    assert added["item"]["type"] == "function_call" and added["item"]["name"] == "paint"
    item_id = added["item"]["id"]
    assert {d["item_id"] for d in deltas} == {item_id} and args_done["item_id"] == item_done["item"]["id"] == item_id
    assert "".join(d["delta"] for d in deltas) == args_done["arguments"] == item_done["item"]["arguments"]
    assert json.loads(args_done["arguments"])["color"] in ("red", "green", "blue")
    assert completed["response"]["output"] == [item_done["item"]]
    assert completed["response"]["usage"]["output_tokens"] > 0


def _translated(chunks: list[dict | str]) -> list[dict]:
    """The Responses events the route makes of a chat stream of `chunks` (as serving sends them)."""
    import asyncio

    from kvtier.server import responses as R
    from kvtier.server.responses_api import _echo, _events, _validate

    async def source():
        for chunk in chunks:
            yield R.sse(chunk)

    async def run() -> list[str]:
        echo = _echo(_validate({"input": "hi"}), MODEL_NAME)
        return [text async for text in _events(source(), echo)]

    return [json.loads(text.split("data: ", 1)[1]) for text in asyncio.run(run())]


def _chat_chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "chatcmpl-abc", "created": 5, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_chat_stream_translation_text_then_calls_and_errors():
    """Text, then tool calls whose arguments arrive in pieces (chat's stream protocol): one
    item open at a time, in order; a decoding error after the 200 ends with response.failed."""
    usage = {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16, "prompt_tokens_details": {}}
    events = _translated(
        [
            _chat_chunk({"role": "assistant", "content": ""}),
            _chat_chunk({"content": "Let me "}),
            _chat_chunk({"content": "call."}),
            _chat_chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "paint"}}]}),
            _chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"ok"'}}]}),
            _chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": ":true}"}}]}),
            _chat_chunk(
                {
                    "tool_calls": [
                        {
                            "index": 1,
                            "id": "c2",
                            "type": "function",
                            "function": {"name": "stop_now", "arguments": "{}"},
                        }
                    ]
                },
                "tool_calls",
            ),
            {"id": "chatcmpl-abc", "created": 5, "choices": [], "usage": usage},
            "[DONE]",
        ]
    )
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.output_text.delta", 0),
        ("response.output_text.delta", 0),
        ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.completed", None),
    ]
    final = events[-1]["response"]
    assert final["id"] == "resp_abc" and final["status"] == "completed" and final["created_at"] == 5
    message, first, second = final["output"]
    assert message["content"][0]["text"] == "Let me call." and message["status"] == "completed"
    assert (first["call_id"], first["name"], first["arguments"]) == ("c1", "paint", '{"ok":true}')
    assert (second["call_id"], second["name"], second["arguments"]) == ("c2", "stop_now", "{}")
    assert final["usage"]["input_tokens"] == 7 and final["usage"]["output_tokens"] == 9

    error = {"message": "the grammar failed", "type": "server_error", "param": None, "code": "structured_output_failed"}
    events = _translated(
        [_chat_chunk({"role": "assistant", "content": ""}), _chat_chunk({"content": "x"}), {"error": error}, "[DONE]"]
    )
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "the grammar failed" and events[-2]["code"] == "structured_output_failed"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"] == "the grammar failed"


def test_logprobs_include(client):
    body = dict(model=MODEL_NAME, input="Count.", max_output_tokens=6, top_logprobs=2, **GREEDY)
    done = client.responses.create(include=["message.output_text.logprobs"], **body)
    lps = done.output[0].content[0].logprobs
    assert len(lps) == done.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in lps)
    streamed = list(client.responses.create(include=["message.output_text.logprobs"], stream=True, **body))
    sent = [lp for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in sent] == [lp.token for lp in lps]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search_preview"}]}, "tools"),
        ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": RESPONSES_TOOLS}, "tool_choice"),  # auto needs --enable-auto-tool-choice, as chat
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
        ({"input": []}, "input"),
        ({"max_output_tokens": "5"}, "max_output_tokens"),
        ({"model": "other"}, "model"),
    ],
)
def test_refusals_name_the_field(server, body, param):
    r = _post(server, {"input": "hi", "max_output_tokens": 4, **body})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.json()
    if param in ("previous_response_id", "conversation"):
        assert "does not keep responses" in r.json()["error"]["message"]


def test_unknown_fields_are_logged_and_neutral_ones_pass(server):
    r = _post(server, {"input": "hi", "max_output_tokens": 2, "store": True, "metadata": {"k": "v"}, "frobnicate": 1})
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"}
    warnings = [line for line in server.log().splitlines() if "present in the request but ignored" in line]
    assert "'frobnicate'" in warnings[-1] and "'store'" not in warnings[-1] and "'metadata'" not in warnings[-1]


def test_reasoning_is_logged_as_unparsed(server):
    r = _post(server, {"input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "low"}})
    assert r.status_code == 200, r.text
    assert (
        r.json()["reasoning"] == {"effort": "low"}
        and r.json()["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    )
    assert "kvtier has no reasoning parser" in server.log()


def test_truncation_auto_cuts_the_oldest_tokens(server):
    overhead = _prompt_tokens(server, [{"role": "user", "content": ""}])
    text = "x" * (MAX_MODEL_LEN - overhead)  # a prompt of the whole context: no room for output
    r = _post(server, {"input": text})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    r = _post(server, {"input": text, "truncation": "auto"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == MAX_MODEL_LEN - 1 and r.json()["truncation"] == "auto"


def test_repeated_long_input_reports_cached_tokens(client):
    text = "A long shared preamble that a client sends on every turn of its session. " * 2
    client.responses.create(model=MODEL_NAME, input=text, max_output_tokens=2, **GREEDY)
    again = client.responses.create(model=MODEL_NAME, input=text, max_output_tokens=2, **GREEDY)
    cached = again.usage.input_tokens_details.cached_tokens
    assert again.usage.input_tokens - BLOCK_SIZE <= cached < again.usage.input_tokens


def test_stream_closed_early_aborts(server):
    """A client that hangs up mid-stream aborts its request and its blocks are freed."""

    def aborted() -> float:
        return scrape(server.url).get(("kvtier:request_success_total", (("finished_reason", "abort"),)), 0.0)

    before = aborted()
    body = {"model": MODEL_NAME, "input": "Keep going.", "max_output_tokens": 200, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.url}/v1/responses", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and json.loads(line[5:])["type"] == "response.output_text.delta":
                break  # text arrived: the request is running; hang up
    server.check_idle_clean()
    assert aborted() == before + 1


@pytest.fixture(scope="module")
def keyed(serve):
    s = serve("--api-key", "k1", "k2", "--rate-limit-per-key", "0.001/s:burst=2", "--strict-request-fields")
    yield s
    assert "Traceback" not in s.log(), s.log()


def test_api_key_limits_and_strict_fields_apply(keyed):
    body = {"input": "hi", "max_output_tokens": 2}
    assert _post(keyed, body).status_code == 401
    assert _post(keyed, body, {"Authorization": "Bearer nope"}).status_code == 401
    for _ in range(2):
        assert _post(keyed, body, {"Authorization": "Bearer k1"}).status_code == 200
    r = _post(keyed, body, {"Authorization": "Bearer k1"})  # a token per 1000 s: the bucket is empty
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    r = _post(keyed, {**body, "temperatur": 0.0}, {"Authorization": "Bearer k2"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_field"
    assert "did you mean 'temperature'" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        keyed.openai().responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
    sdk = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="k2", max_retries=0)
    done = sdk.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
    assert done.usage.output_tokens <= 2
