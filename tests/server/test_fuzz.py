"""Hypothesis-generated bodies against one live `kvtier serve`: whatever a client sends (lone
surrogates, control characters, deep nesting, huge or non-finite numbers, wrong types, bytes
that are not UTF-8), every endpoint answers below 500, streams carry no server error, and the
server stays healthy with no Traceback in its log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from serverutil import MODEL_NAME

# no shrinking: each example is a round trip to the server; the failing body is printed as is
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# ------------------------------------------------------------------ values
_nasty_chars = st.sampled_from(
    [
        "\ud800",
        "\udfff",
        "\udc00",
        "\x00",
        "\x1b",
        "\x7f",
        "\u2028",
        "\ufeff",
        "\U0001f600",
        "<|user|>",
        "</s>",
        "{{",
        "{%",
        "\\",
    ]
)
text = st.one_of(
    st.text(max_size=20),
    st.lists(st.one_of(st.characters(), _nasty_chars), max_size=12).map("".join),
)
huge_int = st.sampled_from([2**63, -(2**63) - 1, 10**30, -(10**30), 10**4000])
numbers = st.one_of(st.integers(-5, 300), huge_int, st.floats(allow_nan=False, allow_infinity=False))
scalars = st.one_of(st.none(), st.booleans(), numbers, text)


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.lists(children, max_size=4), st.dictionaries(text, children, max_size=4))


json_value = st.recursive(scalars, _containers, max_leaves=12)

# a field's value: mostly valid (so that requests reach the engine), else hostile or anything
good_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
good_ids = st.lists(st.integers(0, 261), min_size=1, max_size=6)
bad_ids = st.lists(st.one_of(st.integers(-3, 300), huge_int), max_size=6)


def field(good: st.SearchStrategy, bad: st.SearchStrategy | None = None) -> st.SearchStrategy:
    """Ten to one good; else bad (or any JSON value)."""
    choices = [good] * 10 + [bad if bad is not None else json_value, json_value]
    return st.integers(0, len(choices) - 1).flatmap(choices.__getitem__)


prompt = field(
    st.one_of(
        good_text, good_ids, st.lists(good_text, min_size=1, max_size=3), st.lists(good_ids, min_size=1, max_size=3)
    ),
    st.one_of(text, bad_ids, st.lists(text, max_size=3), st.lists(bad_ids, max_size=3)),
)

SAMPLING = {
    "model": field(st.just(MODEL_NAME), st.sampled_from(["gpt-9", ""])),
    "temperature": field(st.floats(0, 2), st.floats()),
    "top_p": field(st.floats(0.01, 1), st.floats()),
    "top_k": field(st.integers(-1, 300), st.one_of(st.integers(), huge_int)),
    "min_p": field(st.floats(0, 1), st.floats()),
    "n": field(st.integers(1, 3), st.one_of(st.integers(-2, 300), huge_int)),
    "stop": field(st.one_of(good_text, st.lists(good_text, max_size=3)), st.lists(text, max_size=3)),
    "stop_token_ids": field(good_ids, bad_ids),
    "seed": field(st.integers(-(2**63), 2**63 - 1), huge_int),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "cache_salt": field(good_text, text),
    "priority": field(st.integers(-10, 10), huge_int),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.integers(0, 4), st.one_of(st.integers(), huge_int)),
    "skip_special_tokens": field(st.booleans()),
    "include_stop_str_in_output": field(st.booleans()),
    "return_token_ids": field(st.booleans()),
    "presence_penalty": field(st.just(0.0), st.floats()),
    "logit_bias": field(st.just({}), st.dictionaries(text, st.floats(), max_size=2)),
    "user": field(good_text, text),
}
max_tokens = field(st.integers(1, 4), st.one_of(st.integers(-2, 300), huge_int))
COMPLETION = {
    **SAMPLING,
    "max_tokens": max_tokens,
    "logprobs": field(st.integers(0, 5), st.integers(-2, 30)),
    "echo": field(st.just(False), st.booleans()),
    "best_of": field(st.integers(1, 3)),
    "suffix": field(st.none(), text),
}
content = st.one_of(
    good_text,
    st.none(),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": good_text}), min_size=1, max_size=2),
)
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "system", "assistant"]), text)},
    optional={"content": field(content, text), "name": field(good_text, text), "tool_calls": json_value},
)
CHAT = {
    **SAMPLING,
    "max_tokens": max_tokens,
    "max_completion_tokens": max_tokens,
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(0, 5), st.integers(-2, 30)),
    "add_generation_prompt": field(st.booleans()),
    "chat_template_kwargs": field(
        st.dictionaries(good_text, json_value, max_size=2), st.dictionaries(text, json_value, max_size=3)
    ),
    "tools": field(st.none()),
    "tool_choice": field(st.sampled_from(["none", "auto"])),
    "response_format": field(st.just({"type": "text"})),
}


@st.composite
def body_of(
    draw: st.DrawFn, required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]
) -> dict[str, Any]:
    """The required fields and a few optional ones (few, so that many bodies are valid and
    reach the engine; all of them at once would almost never be)."""
    names = draw(st.lists(st.sampled_from(sorted(optional)), max_size=5, unique=True))
    body = {k: draw(v) for k, v in required.items()}
    body.update((k, draw(optional[k])) for k in names)
    return body


ALWAYS = ("max_tokens", "n", "stream")  # drawn in every body: they decide what the engine does
completion_body = body_of({"prompt": prompt, **{k: COMPLETION.pop(k) for k in ALWAYS}}, COMPLETION)
chat_body = body_of(
    {
        "messages": field(st.lists(message, min_size=1, max_size=3), st.lists(message, max_size=0)),
        **{k: CHAT.pop(k) for k in ALWAYS},
    },
    CHAT,
)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@st.composite
def encoded(draw: st.DrawFn, bodies: st.SearchStrategy) -> bytes:
    """A body as bytes: its JSON, with surrogates as escapes (valid UTF-8) or raw (invalid
    UTF-8); sometimes a NaN / 1e400 / 10**5000 / deeply nested value spliced in, a truncation,
    or not an object."""
    body = draw(bodies if draw(st.integers(0, 5)) else json_value)
    raw = json.dumps(body, ensure_ascii=draw(st.booleans()))
    how = draw(st.sampled_from(["plain"] * 8 + ["splice", "truncate"]))
    if how == "splice" and raw.startswith("{") and len(raw) > 2:
        key = draw(st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "n", "seed", "x"]))
        junk = draw(
            st.sampled_from(
                [
                    "NaN",
                    "Infinity",
                    "-Infinity",
                    "1e400",
                    "-1e999",
                    "1" + "0" * 5000,
                    _deep(200),
                    _deep(5000),
                    '"\\ud800"',
                    '"\\udfff\\ud800"',
                ]
            )
        )
        raw = f'{{"{key}": {junk}, {raw[1:]}'
    elif how == "truncate" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    return raw.encode("utf-8", "surrogatepass")


# ------------------------------------------------------------------ fixtures and checks
@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=20) as c:
        yield c


@pytest.fixture(scope="module")
def other_client(serve) -> Iterator[httpx.Client]:
    """A server of its own: /admin/check_integrity waits for an idle engine, which requests
    left over by a completion bug would never let it see."""
    s = serve()
    with httpx.Client(base_url=s.url, timeout=20) as c:
        yield c
    assert "Traceback" not in s.log(), s.log()[-5000:]


def _assert_handled(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:2000]
    if r.status_code >= 400 and r.status_code != 499:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text[:2000]
    assert "server_error" not in r.text, r.text[:2000]  # an engine failure inside a stream


def _post(client: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return client.post(path, content=content, headers={"content-type": "application/json"})


@FUZZ
@given(content=encoded(completion_body))
def test_completions_never_5xx(client, content: bytes) -> None:
    _assert_handled(_post(client, "/v1/completions", content))


@FUZZ
@given(content=encoded(chat_body))
def test_chat_completions_never_5xx(client, content: bytes) -> None:
    _assert_handled(_post(client, "/v1/chat/completions", content))


query = st.dictionaries(st.sampled_from(["tenant", "all", "x"]), text, max_size=2).map(
    lambda q: {k: v.encode("utf-8", "surrogatepass").decode("utf-8", "replace") for k, v in q.items()}
)
requests_elsewhere = st.tuples(
    st.sampled_from(
        [
            ("DELETE", "/v1/cache"),
            ("GET", "/v1/cache"),
            ("POST", "/admin/check_integrity"),
            ("GET", "/v1/models"),
            ("GET", "/health"),
            ("GET", "/metrics"),
            ("POST", "/v1/models"),
            ("PUT", "/v1/completions"),
        ]
    ),
    query,
    encoded(json_value),
)


@FUZZ
@given(request=requests_elsewhere)
def test_other_endpoints_never_5xx(other_client, request: tuple[tuple[str, str], dict[str, str], bytes]) -> None:
    (method, path), params, content = request
    r = other_client.request(method, path, params=params, content=content, headers={"content-type": "application/json"})
    _assert_handled(r)


def test_server_healthy_and_clean_after_fuzzing(server, client) -> None:
    assert client.get("/health").status_code == 200
    r = _post(
        client,
        "/v1/completions",
        json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}).encode(),
    )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    server.check_idle_clean()
    assert "Traceback" not in server.log(), server.log()[-5000:]
