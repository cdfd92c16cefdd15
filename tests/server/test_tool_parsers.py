"""The --tool-call-parser formats (vLLM's names) and the stream of tool-call deltas: each
parser on typical outputs (several calls, text before, malformed output left as content), and
the same outputs streamed in every chunking, accumulated as the openai SDK does: the stream
adds up to the non-streamed message, and a call's arguments arrive in pieces."""

from __future__ import annotations

import itertools
import json
import keyword
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.server.tool_json import JsonReader
from kvtier.server.tools import PARSERS, ToolStream, for_request, make_parser, tool_message

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "celsius": {"type": "boolean"},
                    "scale": {"type": "number"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    }
]
W = {"city": "Oslo", "days": 3}
DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
DS = "<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>"
HARMONY_CALL = "<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}<|call|>"

# (parser, model output, content, [(name, arguments as a value)])
TYPICAL: list[tuple[str, str, str | None, list[tuple[str, Any]]]] = [
    (
        "hermes",
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "put", "arguments": {}}\n</tool_call>',
        "Sure.",
        [("get_weather", W), ("put", {})],
    ),
    ("hermes", '<tool_call>{"name":"f","arguments":{"a":[1,2.50,"\\u00e9"]}}', None, [("f", {"a": [1, 2.5, "é"]})]),
    ("qwen3_json", '<tool_call>{"arguments": {"x": null}, "name": "f"}</tool_call>', None, [("f", {"x": None})]),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}; {"name": "g", "parameters": {}}',
        None,
        [("get_weather", W), ("g", {})],
    ),
    (
        "llama3_json",
        'Let me look.<|python_tag|>{"name": "f", "arguments": {"x": 1}}',
        "Let me look.",
        [("f", {"x": 1})],
    ),
    (
        "mistral",
        'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}, '
        '{"name": "g", "arguments": "{\\"y\\": 2}"}]',
        "Checking.",
        [("get_weather", W), ("g", {"y": 2})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 3}[TOOL_CALLS]g[ARGS]{}',
        None,
        [("get_weather", W), ("g", {})],
    ),
    (
        "pythonic",
        "[get_weather(city='Oslo', days=3), put(xs=[1, -2.5, None, True], d={'k': (1, 2)}, s=f'plain'), ns.tool()]",
        None,
        [("get_weather", W), ("put", {"xs": [1, -2.5, None, True], "d": {"k": [1, 2]}, "s": "plain"}), ("ns.tool", {})],
    ),
    (
        "qwen3_coder",
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=celsius>\ntrue\n</parameter>\n<parameter=scale>\n2.0\n"
        '</parameter>\n<parameter=opts>\n{"a": [1]}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n'
        "<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=put>\n"
        "<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>",
        "I'll check.",
        [
            ("get_weather", {**W, "celsius": True, "scale": 2, "opts": {"a": [1]}, "note": None, "extra": "42"}),
            ("put", {"n": "7"}),
        ],
    ),
    (
        "qwen3_xml",
        "<function=put>\n<parameter=code>\nx = '<b>'\n\n</parameter>\n</function>",
        None,
        [("put", {"code": "x = '<b>'\n"})],
    ),
    (
        "granite",
        'OK <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}, {"name": "g", "arguments": {}}]',
        "OK",
        [("get_weather", W), ("g", {})],
    ),
    ("granite", '<tool_call>{"name": "g", "arguments": {"z": false}}', None, [("g", {"z": False})]),
    (
        "granite-20b-fc",
        '<function_call> {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n'
        '<function_call> {"name": "g", "arguments": {}}',
        None,
        [("get_weather", W), ("g", {})],
    ),
    (
        "deepseek_v3",
        "Let me see."
        + DS.format(
            calls=DS_CALL.format(name="get_weather", args='{"city": "Oslo",\n "days": 3}')
            + "\n"
            + DS_CALL.format(name="g", args="{}")
        ),
        "Let me see.",
        [("get_weather", W), ("g", {})],
    ),
    (
        "openai",
        "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
        + HARMONY_CALL.format(name="get_weather", args='{"city":"Oslo","days":3}'),
        None,
        [("get_weather", W)],
    ),
    (
        "openai",
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.g<|message|>{"a": 1}<|call|>',
        "Checking.",
        [("g", {"a": 1})],
    ),
]

# (parser, model output): not calls, so all content
MALFORMED = [
    ("hermes", "<tool_call>{not json}</tool_call>"),
    ("hermes", 'Sure <tool_call>{"name": "f", "arguments": {}} trailing</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1'),
    ("hermes", "no call here, <tool_ call> nor <tool_call"),
    ("llama3_json", "plain words {with braces}"),
    ("llama3_json", "{not json"),
    ("mistral", "[TOOL_CALLS] oops"),
    ("mistral", "[TOOL_CALLS][]"),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[f(1, 2)]"),
    ("pythonic", "[f(a=__import__('os').getcwd())]"),
    ("pythonic", "[f(a=1)] and more"),
    ("pythonic", "[f(a=1, a=2)]"),
    ("pythonic", "[f(a=1)"),
    ("pythonic", "Here: [f(a=1)]"),
    ("qwen3_coder", '<tool_call>\n{"name": "f"}\n</tool_call>'),
    ("qwen3_coder", "<tool_call><function={{ tc.name }}></function></tool_call>"),
    ("granite", "<|tool_call|>[1]"),
    ("granite-20b-fc", "<function_call> nothing"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\nno fence"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>"),
    ("openai", "Just words."),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", TYPICAL, ids=[f"{t[0]}-{i}" for i, t in enumerate(TYPICAL)])
def test_typical_outputs(name, text, content, calls):
    got_content, got = make_parser(name).bind(TOOLS).parse(text)
    assert got_content == content
    assert _calls(got) == calls
    for call in got:  # vLLM's arguments text: json.dumps(value, ensure_ascii=False)
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
        assert call.id.startswith("chatcmpl-tool-")


@pytest.mark.parametrize("name,text", MALFORMED, ids=[f"{t[0]}-{i}" for i, t in enumerate(MALFORMED)])
def test_malformed_output_is_content(name, text):
    assert make_parser(name).bind(TOOLS).parse(text) == (text, [])


def test_harmony_content_without_calls():
    """Harmony output is messages: content is the final channel's, never the markup."""
    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
    assert make_parser("openai").parse(text) == ("Hello!", [])
    bad = "<|channel|>commentary to=functions.f<|message|>{bad<|call|>"  # a malformed call is left out
    assert make_parser("openai").parse(bad) == ("", [])
    _check_stream("openai", bad, list(range(len(bad))))


def test_unknown_parser_lists_the_choices():
    with pytest.raises(ValueError, match="choose from") as e:
        make_parser("nope")
    assert all(name in str(e.value) for name in ("hermes", "pythonic", "qwen3_coder", "deepseek_v3", "openai"))


# ---------------------------------------------------------------------- streaming
def _stream(ts: ToolStream, text: str, cuts: list[int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Feed `text` cut at `cuts`; (the delta messages, the message the openai SDK accumulates)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    state = ChatCompletionStreamState()
    messages = []

    def chunk(delta: dict[str, Any], reason: str | None) -> None:
        body = {"index": 0, "delta": delta, "finish_reason": reason}
        data = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [body]}
        state.handle_chunk(ChatCompletionChunk.model_validate(data))

    chunk({"role": "assistant", "content": ""}, None)
    for a, b in itertools.pairwise(bounds):
        message = ts.step(text[a:b], b == len(text))
        messages.append(message)
        chunk(message, None)
    chunk({}, "tool_calls" if ts.called else "stop")
    final = state.get_final_completion().choices[0].message
    return messages, {
        "content": final.content or None,
        "calls": [(c.function.name, c.function.arguments) for c in final.tool_calls or []],
    }


def _check_deltas(messages: list[dict[str, Any]]) -> None:
    """A call's first delta has index, id, type, name; later ones only argument fragments."""
    seen: set[int] = set()
    for message in messages:
        for delta in message.get("tool_calls", []):
            if delta["index"] in seen:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                assert delta["function"]["arguments"]
            else:
                assert delta["index"] == len(seen)
                assert delta["id"] and delta["type"] == "function" and delta["function"]["name"]
                seen.add(delta["index"])


def _expected(parser, text) -> dict[str, Any]:
    content, calls = parser.parse(text)
    return {"content": content or None, "calls": [(c.name, c.arguments) for c in calls]}


def _check_stream(name: str, text: str, cuts: list[int]) -> list[dict[str, Any]]:
    parser = for_request(make_parser(name), TOOLS)
    messages, got = _stream(ToolStream("auto", None, parser), text, cuts)
    want = _expected(parser, text)
    if want["calls"] or not any("tool_calls" in m for m in messages):
        assert got == want
    _check_deltas(messages)
    return messages


CASES = [(t[0], t[1]) for t in TYPICAL] + MALFORMED


@pytest.mark.parametrize("name,text", CASES, ids=[f"{t[0]}-{i}" for i, t in enumerate(CASES)])
def test_streamed_character_by_character(name, text):
    _check_stream(name, text, list(range(len(text))))
    _check_stream(name, text, [])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(1, 400), max_size=40))
def test_streamed_in_random_chunks(case, cuts):
    _check_stream(case[0], case[1], cuts)


def test_long_arguments_stream_in_pieces():
    """A call's arguments go out as they are written, not at the end of the call; what may
    still turn out to be markup (a partial close tag, the newline before it) waits."""
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n" + "Oslo " * 40 + "\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    messages = _check_stream("qwen3_coder", text, list(range(0, len(text), 5)))
    fragments = [d["function"]["arguments"] for m in messages for d in m.get("tool_calls", [])]
    assert len(fragments) > 20 and "".join(fragments).endswith('"days": 3}')
    for name, text in [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"text": "' + "word " * 50 + '"}}</tool_call>'),
        ("openai", HARMONY_CALL.format(name="f", args='{"text": "' + "word " * 50 + '"}')),
        ("pythonic", "[f(text='" + "word " * 50 + "', n=1), g(m=2)]"),
    ]:
        messages = _check_stream(name, text, list(range(0, len(text), 7)))
        assert sum(1 for m in messages for d in m.get("tool_calls", []) if d["index"] == 0) > (
            2 if name != "pythonic" else 1
        )


def test_stream_holds_back_a_split_marker():
    ts = ToolStream("auto", None, make_parser("hermes"))
    assert ts.step("Hello <tool", False) == {"content": "Hello"}
    header = ts.step('_call>{"name": "f", ', False)["tool_calls"][0]
    assert header["function"] == {"name": "f", "arguments": ""} and header["index"] == 0
    # a number may go on: "12" waits for what follows it
    assert ts.step('"arguments": {"a": 12', False)["tool_calls"] == [{"index": 0, "function": {"arguments": '{"a": '}}]
    last = ts.step("}}</tool_call>", True)["tool_calls"]
    assert last == [{"index": 0, "function": {"arguments": "12}"}}] and ts.called
    plain = ToolStream("auto", None, make_parser("hermes"))
    assert plain.step("just <tool", False) == {"content": "just"}
    assert plain.step("box", False) == {"content": " <toolbox"}
    assert plain.step("", True) == {} and not plain.called


def test_named_and_required_streams():
    named = '{"color": "red", "ok": true}'
    _, got = _stream(ToolStream("named", "paint", None), named, list(range(len(named))))
    assert got == {"content": None, "calls": [("paint", named)]}  # as generated, like vLLM
    assert [c.arguments for c in tool_message(named, "named", "paint", None)[1]] == [named]
    required = '[{"name": "paint", "parameters": {"ok": true}}, {"name": "stop_now", "parameters": {"why": "done"}}]'
    _, got = _stream(ToolStream("required", None, None), required, list(range(0, len(required), 3)))
    _, calls = tool_message(required, "required", None, None)
    assert got == {"content": None, "calls": [(c.name, c.arguments) for c in calls]}
    assert _calls(calls) == [("paint", {"ok": True}), ("stop_now", {"why": "done"})]
    cut = required[:30]  # cut short by max_tokens: the text is content
    _, got = _stream(ToolStream("required", None, None), cut, [])
    assert got == {"content": cut, "calls": []} and tool_message(cut, "required", None, None) == (cut, [])


# ---------------------------------------------------------------------- generated calls
_names = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True).filter(lambda s: not keyword.iskeyword(s))
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_calls_st = st.lists(st.tuples(_names, st.dictionaries(_names, _values, max_size=4)), min_size=1, max_size=3)
_json_styles = st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 1}, {"ensure_ascii": False}])


def _render(fmt: str, calls: list[tuple[str, dict[str, Any]]], style: dict[str, Any]) -> str:
    def js(value: Any) -> str:
        return json.dumps(value, **style)

    if fmt == "hermes":
        return "Sure.\n" + "\n".join(f"<tool_call>\n{js({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if fmt == "llama3_json":
        return "; ".join(js({"name": n, "parameters": a}) for n, a in calls)
    if fmt == "mistral":
        return "[TOOL_CALLS] " + js([{"name": n, "arguments": a} for n, a in calls])
    if fmt == "mistral_v11":
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{js(a)}" for n, a in calls)
    if fmt == "granite":
        return "<|tool_call|>" + js([{"name": n, "arguments": a} for n, a in calls])
    if fmt == "granite-20b-fc":
        return "\n".join(f"<function_call> {js({'name': n, 'arguments': a})}" for n, a in calls)
    if fmt == "deepseek_v3":
        return "Hm." + DS.format(calls="".join(DS_CALL.format(name=n, args=js(a)) for n, a in calls))
    if fmt == "openai":
        return "<|channel|>analysis<|message|>ok<|end|>" + "".join(
            HARMONY_CALL.format(name=n, args=js(a)) for n, a in calls
        )
    if fmt == "pythonic":
        return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"
    raise AssertionError(fmt)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(
        [
            "hermes",
            "llama3_json",
            "mistral",
            "mistral_v11",
            "granite",
            "granite-20b-fc",
            "deepseek_v3",
            "openai",
            "pythonic",
        ]
    ),
    calls=_calls_st,
    style=_json_styles,
    cuts=st.lists(st.integers(1, 600), max_size=30),
)
def test_generated_calls_round_trip(fmt, calls, style, cuts):
    text = _render(fmt, calls, style)
    name = "mistral" if fmt == "mistral_v11" else fmt
    _, got = make_parser(name).parse(text)
    assert [(c.name, c.arguments) for c in got] == [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    _check_stream(name, text, cuts)


_param_values = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30).filter(
    lambda s: all(m not in s for m in ("</parameter>", "<parameter=", "</function>"))
)


@settings(max_examples=150, deadline=None)
@given(
    city=_param_values,
    days=st.integers(-1000, 1000),
    opts=st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    extra=_param_values,
    cuts=st.lists(st.integers(1, 300), max_size=30),
)
def test_qwen3_coder_generated(city, days, opts, extra, cuts):
    text = (
        "<tool_call>\n<function=get_weather>\n"
        f"<parameter=city>\n{city}\n</parameter>\n<parameter=days>\n{days}\n</parameter>\n"
        f"<parameter=opts>\n{json.dumps(opts)}\n</parameter>\n<parameter=extra>\n{extra}\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    parser = for_request(make_parser("qwen3_coder"), TOOLS)
    _, got = parser.parse(text)
    want = {"city": city, "days": days, "opts": opts, "extra": extra}
    assert [(c.name, c.arguments) for c in got] == [("get_weather", json.dumps(want, ensure_ascii=False))]
    _check_stream("qwen3_coder", text, cuts)


def test_qwen3_coder_values_by_schema():
    parser = make_parser("qwen3_coder")
    body = "<function=get_weather><parameter=days>3</parameter><parameter=note>null</parameter></function>"
    assert _calls(parser.parse(body)[1]) == [("get_weather", {"days": "3", "note": "null"})]  # no schema: text
    bound = parser.bind(TOOLS)
    assert _calls(bound.parse(body)[1]) == [("get_weather", {"days": 3, "note": None})]
    odd = "<function=get_weather><parameter=days>three</parameter><parameter=celsius>0</parameter></function>"
    assert _calls(bound.parse(odd)[1]) == [("get_weather", {"days": "three", "celsius": False})]


# ---------------------------------------------------------------------- the JSON reader
@settings(max_examples=300, deadline=None)
@given(value=_values, style=_json_styles, cuts=st.lists(st.integers(1, 300), max_size=20))
def test_json_reader_writes_what_json_dumps_writes(value, style, cuts):
    text = json.dumps(value, **style)
    reader = JsonReader()
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    seen = ""
    for a, b in itertools.pairwise(bounds):
        reader.feed(text[a:b])
        assert reader.text.startswith(seen)
        seen = reader.text
    reader.close()
    assert reader.done and reader.error is None
    assert reader.text == json.dumps(json.loads(text), ensure_ascii=False)


@pytest.mark.parametrize("bad", ['{"a" 1}', "[1,]", "01", '"\\x"', "tru", '{"a": 1}}', '"a\nb"', "{'a': 1}"])
def test_json_reader_rejects(bad):
    reader = JsonReader()
    reader.feed(bad)
    reader.close()
    assert reader.error is not None or not reader.done or reader.consumed < len(bad)


def test_known_parser_names():
    assert set(PARSERS) >= {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "granite", "deepseek_v3"}


# fmt: off
_PIECES = [
    "<tool_call>", "</tool_call>", "<function=", "f>", "</function>", "<parameter=", "p>", "</parameter>",
    "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|tool_call|>", "<function_call>", "<|channel|>",
    "commentary to=functions.f", "final", "<|message|>", "<|call|>", "<|end|>", "<|start|>assistant",
    "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n", "```json", "```",
    "<｜tool▁call▁end｜>", '{"name": "f", ', '"arguments": ', '{"a": ', "[", "]", "{", "}", "(", ")", "f(", "x=",
    "1", "2.5", '"s"', "'q'", ", ", ";", "\n", " ", "text", "\\", '"', "\\u00e9",
]
# fmt: on


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(sorted(PARSERS)),
    pieces=st.lists(st.sampled_from(_PIECES), max_size=25),
    cuts=st.lists(st.integers(1, 200), max_size=30),
)
def test_any_text_streams_consistently(name, pieces, cuts, caplog):
    """Whatever the model writes: no error, no broken promise (a fragment that does not extend
    what went out), and a stream that adds up to the non-streamed message whenever it sent no
    call the end then took back."""
    caplog.clear()
    _check_stream(name, "".join(pieces), cuts)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_parsers_whose_markers_are_special_tokens():
    """As vLLM's adjust_request: these formats need skip_special_tokens off to see their markers."""
    keep = {name for name, cls in PARSERS.items() if cls.keep_special_tokens}
    assert keep == {"hermes", "qwen", "qwen3_json", "mistral", "granite", "qwen3_coder", "qwen3_xml", "openai"}
