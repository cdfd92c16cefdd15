"""Hostile structured-outputs constraints (issue 33, items 1, 3, 9): a grammar llguidance
gives up on is a 400 naming the field before it runs (never a "stop" with text that breaks
the constraint), too many choices or too deep a schema is a 400 naming the cap with no Rust
backtrace, and a grammar that fails while decoding ends its sequence with finish_reason
"error" (the reason in stop_reason) in the offline engine."""

from __future__ import annotations

import json

import httpx
import pytest
from serverutil import MODEL_NAME, scrape

from kvtier import SamplingParams
from kvtier.structured import LIMITS, StructuredOutputsParams

pytest.importorskip("llguidance")

USER = [{"role": "user", "content": "Say a."}]


@pytest.fixture(scope="module")
def server(serve):
    s = serve()
    yield s
    assert "Traceback" not in s.log(), s.log()


def _chat(server, **body):
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=120,
        json={"model": MODEL_NAME, "messages": USER, "max_tokens": 20, "temperature": 0.0, **body},
    )


def _completion(server, **body):
    return httpx.post(
        f"{server.url}/v1/completions",
        timeout=120,
        json={"model": MODEL_NAME, "prompt": "a:", "max_tokens": 20, "temperature": 0.0, **body},
    )


LOOPING_SCHEMA = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs"),
        ({"guided_regex": "(((a{100}){100}){100})"}, "guided_regex"),
        ({"structured_outputs": {"grammar": 'start: "a" start'}}, "structured_outputs"),
        ({"guided_grammar": 'root ::= "a" root'}, "guided_grammar"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": LOOPING_SCHEMA}}},
            "response_format",
        ),
    ],
)
def test_grammar_llguidance_gives_up_on_is_400(server, body, param):
    for post in (_chat, _completion):
        r = post(server, **body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param
        assert "structured_outputs" in error["message"] and "\n" not in error["message"]
    for stream in (True, False):  # streamed too: refused before any chunk, never a "stop"
        r = _chat(server, stream=stream, **body)
        assert r.status_code == 400, r.text


def test_refusals_are_counted(server):
    _chat(server, guided_grammar='root ::= "b" root')
    series = scrape(server.url)
    refused = sum(
        v
        for (name, labels), v in series.items()
        if name == "kvtier:structured_output_errors_total" and ("reason", "too_complex") in labels
    )
    assert refused >= 1


def test_too_many_choices_is_400_naming_the_cap(server):
    choices = [f"option {i}" for i in range(10 * LIMITS.max_choices)]
    r = _chat(server, structured_outputs={"choice": choices})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs"
    assert "choice" in error["message"] and str(LIMITS.max_choices) in error["message"]
    assert "panic" not in error["message"] and "backtrace" not in error["message"].lower()


def test_oversized_constraint_is_400(server):
    r = _completion(server, guided_regex="a" * (LIMITS.max_bytes + 1))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_regex"
    assert str(LIMITS.max_bytes) in r.json()["error"]["message"]


def test_deep_schema_string_is_400(server):
    deep = '{"not":' * 2000 + "{}" + "}" * 2000
    r = _chat(server, structured_outputs={"json": deep})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs"
    assert "deeper" in error["message"]


def test_a_good_constraint_still_runs(server):
    r = _completion(server, guided_choice=["yes", "no"])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    assert r.json()["choices"][0]["finish_reason"] == "stop"


# `b|c(a{1000000})` passes validation (its probe follows "b"); a client whose logit_bias
# picks "c" walks into a{1000000}, whose lexer llguidance gives up on at the next token
FAILS_LATER = "b|c(a{1000000})"


def _token_of_c(server) -> int:
    r = httpx.post(f"{server.url}/tokenize", timeout=30, json={"prompt": "c", "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return r.json()["tokens"][0]


def _decode_errors(server) -> float:
    return sum(
        v
        for (name, labels), v in scrape(server.url).items()
        if name == "kvtier:structured_output_errors_total" and ("reason", "decode") in labels
    )


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_grammar_failing_while_decoding_is_an_error_not_stop(server, endpoint):
    post = _chat if endpoint == "chat" else _completion
    before = _decode_errors(server)
    r = post(server, guided_regex=FAILS_LATER, logit_bias={str(_token_of_c(server)): 100})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "structured_output_failed" and error["type"] == "server_error"
    assert "grammar failed while decoding" in error["message"] and "\n" not in error["message"]
    assert _decode_errors(server) == before + 1


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_grammar_failure_ends_with_an_error_event(server, endpoint):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = {"messages": USER} if endpoint == "chat" else {"prompt": "a:"}
    events = []
    with httpx.stream(
        "POST",
        f"{server.url}{path}",
        timeout=120,
        json={
            "model": MODEL_NAME,
            "max_tokens": 20,
            "stream": True,
            "guided_regex": FAILS_LATER,
            "logit_bias": {str(_token_of_c(server)): 100},
            **body,
        },
    ) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "structured_output_failed"
    for event in events[:-2]:
        for choice in json.loads(event).get("choices", []):
            assert choice.get("finish_reason") in (None, "error") and choice.get("finish_reason") != "stop"


def test_grammar_failing_while_decoding_finishes_with_error(llm):
    c_id = llm.get_tokenizer().encode("c", False)[0]
    spec = StructuredOutputsParams(regex=FAILS_LATER)
    sp = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={c_id: 100.0}, structured_outputs=spec)
    [out] = llm.generate(["a:"], sp)
    c = out.outputs[0]
    assert c.finish_reason == "error"
    assert isinstance(c.stop_reason, str) and c.stop_reason.startswith("structured_outputs: the grammar failed")
    # and the engine goes on serving
    [ok] = llm.generate(["b:"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert ok.outputs[0].finish_reason == "length"


def test_offline_refuses_what_the_server_refuses(llm):
    with pytest.raises(ValueError, match="too complex"):
        llm.generate(
            ["a:"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a{1000000}"))
        )
    with pytest.raises(ValueError, match="at most"):
        StructuredOutputsParams(choice=[str(i) for i in range(LIMITS.max_choices + 1)])
    with pytest.raises(ValueError, match="deeper"):
        StructuredOutputsParams(
            json='{"not":' * (LIMITS.max_schema_depth + 1) + "{}" + "}" * (LIMITS.max_schema_depth + 1)
        )


@pytest.mark.engine_modes("in-process")  # a fresh in-process server, its decode errors counted from 0
def test_engine_in_process_validates_in_the_server_too(serve):
    s = serve("--engine-in-process")
    r = _chat(s, guided_grammar='root ::= "a" root')
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_grammar"
    r = _completion(s, guided_regex=FAILS_LATER, logit_bias={str(_token_of_c(s)): 100})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "structured_output_failed"
    assert _decode_errors(s) == 1
    assert "Traceback" not in s.log(), s.log()
