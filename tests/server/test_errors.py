"""Bad input gets a 4xx with OpenAI's error body, no stack trace and no leaked blocks, and the
server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from serverutil import MAX_MODEL_LEN, MODEL_NAME

OK_COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (name, path, body (dict, or raw bytes), expected status, expected param or None)
CASES = [
    ("malformed json", "/v1/completions", b'{"prompt": "hi",', 400, None),
    ("body not an object", "/v1/completions", b'["hi"]', 400, None),
    ("prompt wrong type", "/v1/completions", {**OK_COMPLETION, "prompt": 5}, 400, "prompt"),
    ("prompt missing", "/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    ("max_tokens wrong type", "/v1/completions", {**OK_COMPLETION, "max_tokens": "2"}, 400, "max_tokens"),
    ("max_tokens bool", "/v1/completions", {**OK_COMPLETION, "max_tokens": True}, 400, "max_tokens"),
    ("temperature wrong type", "/v1/completions", {**OK_COMPLETION, "temperature": "hot"}, 400, "temperature"),
    ("stream wrong type", "/v1/completions", {**OK_COMPLETION, "stream": "yes"}, 400, "stream"),
    ("prompt too long", "/v1/completions", {**OK_COMPLETION, "prompt": "x" * (MAX_MODEL_LEN + 10)}, 400, "prompt"),
    (
        "prompt + max_tokens too long",
        "/v1/completions",
        {**OK_COMPLETION, "prompt": "x" * 100, "max_tokens": MAX_MODEL_LEN},
        400,
        "prompt",
    ),
    ("max_tokens zero", "/v1/completions", {**OK_COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {**OK_COMPLETION, "max_tokens": -3}, 400, "max_tokens"),
    ("temperature negative", "/v1/completions", {**OK_COMPLETION, "temperature": -0.5}, 400, "temperature"),
    ("temperature huge", "/v1/completions", {**OK_COMPLETION, "temperature": 1e9}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {**OK_COMPLETION, "top_p": 0.0}, 400, "top_p"),
    ("n too large", "/v1/completions", {**OK_COMPLETION, "n": 100000}, 400, "n"),
    ("n zero", "/v1/completions", {**OK_COMPLETION, "n": 0}, 400, "n"),
    ("empty prompt list", "/v1/completions", {**OK_COMPLETION, "prompt": []}, 400, "prompt"),
    ("token id outside vocab", "/v1/completions", {**OK_COMPLETION, "prompt": [1, 999999]}, 400, "prompt"),
    ("one bad prompt of a batch", "/v1/completions", {**OK_COMPLETION, "prompt": [[1, 2], [1, 999999]]}, 400, "prompt"),
    ("penalty out of range", "/v1/completions", {**OK_COMPLETION, "presence_penalty": 3.0}, 400, "presence_penalty"),
    (
        "repetition penalty zero",
        "/v1/completions",
        {**OK_COMPLETION, "repetition_penalty": 0.0},
        400,
        "repetition_penalty",
    ),
    ("max_tokens 0 without echo", "/v1/completions", {**OK_COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    (
        "field kvtier does not implement",
        "/v1/completions",
        {**OK_COMPLETION, "logits_processors": ["x"]},
        400,
        "logits_processors",
    ),
    ("unknown model", "/v1/completions", {**OK_COMPLETION, "model": "gpt-9"}, 404, "model"),
    ("empty messages", "/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, "messages"),
    ("messages wrong type", "/v1/chat/completions", {**OK_CHAT, "messages": "hi"}, 400, "messages"),
    (
        "message without role",
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"content": "hi"}]},
        400,
        "messages.0.role",
    ),
    ("chat bad temperature", "/v1/chat/completions", {**OK_CHAT, "temperature": 101}, 400, "temperature"),
    ("chat unknown model", "/v1/chat/completions", {**OK_CHAT, "model": "nope"}, 404, "model"),
    (
        "chat stream too long",
        "/v1/chat/completions",
        {**OK_CHAT, "stream": True, "messages": [{"role": "user", "content": "y" * 400}]},
        400,
        "messages",
    ),
    ("oversized body", "/v1/completions", {**OK_COMPLETION, "prompt": "z" * (100 << 10)}, 413, None),
    # JSON that decodes to what no tokenizer or JSON encoder takes, or that the parser chokes on
    ("lone surrogate in prompt", "/v1/completions", b'{"prompt": "\\ud800abc", "max_tokens": 2}', 400, "prompt"),
    (
        "lone surrogate in streamed prompt",
        "/v1/completions",
        b'{"prompt": "\\ud800abc", "max_tokens": 2, "stream": true}',
        400,
        "prompt",
    ),
    ("lone surrogate in a batch", "/v1/completions", b'{"prompt": ["ok", "ab\\udfff"]}', 400, "prompt.1"),
    (
        "lone surrogate in chat",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\ud800abc"}]}',
        400,
        "messages.0.content",
    ),
    (
        "lone surrogate in a chat text part",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\udc00"}]}]}',
        400,
        "messages.0.content.0.text",
    ),
    ("surrogate as raw bytes (not UTF-8)", "/v1/completions", b'{"prompt": "\xed\xa0\x80"}', 400, None),
    ("nested 30000 deep", "/v1/completions", b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}", 400, None),
    (
        "nested 100 deep",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": '
        + b"[" * 100
        + b"]" * 100
        + b"}}",
        400,
        None,
    ),
    (
        "integer of 5000 digits",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
        400,
        "max_tokens",
    ),
    ("number out of range", "/v1/completions", b'{"prompt": "hi", "temperature": 1e400}', 400, "temperature"),
    ("NaN", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("Infinity", "/v1/chat/completions", b'{"messages": [], "top_p": -Infinity}', 400, "top_p"),
    ("seed beyond 64 bits", "/v1/completions", {**OK_COMPLETION, "seed": 2**64}, 400, "seed"),
]


def post(url: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0].replace(" ", "_") for c in CASES])
def test_bad_input_is_a_4xx_with_an_error_body(server, name, path, body, status, param):
    r = post(server.url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in r.text
    assert err["param"] == param
    # still serving, nothing leaked
    assert post(server.url, "/v1/completions", OK_COMPLETION).status_code == 200


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/v1/completions", b'{"prompt": "\\ud800abc"}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800abc"}], "stream": true}',
            "messages.0.content",
        ),
    ],
)
def test_lone_surrogate_error_names_the_field(server, path, body, field):
    r = post(server.url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_unicode"
    assert err["message"].startswith(f"{field} contains a lone UTF-16 surrogate (U+D800"), err
    assert "chat_template_kwargs" not in err["message"]


def test_depth_error_says_what_is_wrong(server):
    r = post(server.url, "/v1/completions", b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}")
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "the body is nested more than 64 levels deep",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_json",
    }


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_openai_client_raises_typed_errors(server):
    import openai

    client = server.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_no_leaks_after_errors(server):
    body = server.check_idle_clean()
    assert body["num_free_blocks"] == body["num_blocks"]
    assert "Traceback" not in server.log()
