"""vLLM's drop-in endpoints and request fields, over real HTTP (the openai client or httpx):
SageMaker's /ping and /invocations, /load (--enable-server-load-tracking), /openapi.json and
/docs, the admin POST /reset_prefix_cache (device, host, disk; Redis only when named), and the
request fields return_tokens_as_token_ids, request_id and echo (completions with max_tokens 0,
chat, streamed), the server settings response_role, enable_force_include_usage,
enable_log_requests / max_log_len, and uvicorn's: root_path, TLS, its log level and access log.

The ServerConfig fields without a `kvtier serve` flag of their own are set through
serverutil.start_server's `config` (the CLI's settings, those fields replaced). These are
features of the HTTP layer, above the engine client, so the tests run in the default engine mode
only (conftest.py), but for test_reset_prefix_cache_empties_every_own_tier: the reset is an
admin call to the engine (its tiers, Redis among them) and runs against both engine clients."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from pathlib import Path

import httpx
import pytest
from serverutil import ENGINE_MODES, MODEL_NAME, Server, start_server, stop_server

openai = pytest.importorskip("openai")
redis = pytest.importorskip("redis")

pytestmark = pytest.mark.engine_modes("process")  # the HTTP layer: either engine client serves it alike
ADMIN_KEY = "sk-admin-key-0123456789abcdef"
MAX_LOG_LEN = 12


@pytest.fixture(scope="module")
def vserver(server_model_dir, tmp_path_factory, engine_mode, redis_url):
    """Host, disk and Redis tiers, an admin key, load tracking, request logging at debug level,
    replies spoken as "helper", uvicorn at info without its access log."""
    d = tmp_path_factory.mktemp("vllm_endpoints")
    admin = d / "admin.key"
    admin.write_text(ADMIN_KEY + "\n")
    admin.chmod(0o600)
    redis.Redis.from_url(redis_url).flushdb()  # the other engine mode's server used it too
    s = start_server(
        server_model_dir,
        d,
        "--admin-key-file",
        str(admin),
        "--host-cache-bytes",
        "4MiB",
        "--disk-cache-dir",
        str(d / "disk"),
        "--remote-cache-url",
        redis_url,
        "--restore-policy",
        "always",  # a restore from any tier shows in cached_tokens (the cost policy may recompute)
        "--log-level",
        "debug",
        "--enable-server-load-tracking",
        "--enable-log-requests",
        "--max-log-len",
        str(MAX_LOG_LEN),
        "--response-role",
        "helper",
        "--uvicorn-log-level",
        "info",
        "--disable-uvicorn-access-log",
        engine_mode=engine_mode,
    )
    yield s
    try:
        assert "Traceback" not in s.log(), s.log()[-5000:]
    finally:
        stop_server(s)


def admin(s: Server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, f"{s.url}{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60, **kw)


def check_integrity(s: Server) -> None:
    """The engine's invariants hold once it is idle, and no block is in use."""
    r = admin(s, "POST", "/admin/check_integrity")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ok"] is True and body["num_unfinished"] == 0, body
    assert body["num_free_blocks"] == body["num_blocks"], body


def prompt(s: Server, name: str) -> str:
    """A prompt of several blocks, its own per test and engine mode (Redis outlives servers)."""
    return f"[{s.engine_mode}:{name}] A long shared document that fills several KV blocks. " * 2


def cached_tokens(s: Server, text: str) -> tuple[int, dict[str, int]]:
    r = httpx.post(
        f"{s.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": text, "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["prompt_tokens_details"]
    return details["cached_tokens"], details["cached_tokens_by_tier"]


# ------------------------------------------------------------------ SageMaker, /load, OpenAPI
def test_ping_is_the_health_check(vserver):
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{vserver.url}/ping", timeout=10)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
    assert httpx.get(f"{vserver.url}/health", timeout=10).json() == {"status": "ok"}


def test_invocations_dispatch_on_the_body(vserver):
    url = f"{vserver.url}/invocations"
    chat = httpx.post(
        url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}, timeout=60
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "helper"
    done = httpx.post(url, json={"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}, timeout=60)
    assert done.status_code == 200 and done.json()["object"] == "text_completion", done.text
    assert done.json()["usage"]["completion_tokens"] == 3
    # the same answer as the route itself, streams too
    direct = httpx.post(
        f"{vserver.url}/v1/completions",
        json={"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0},
        timeout=60,
    )
    assert direct.json()["choices"][0]["text"] == done.json()["choices"][0]["text"]
    with httpx.stream("POST", url, json={"prompt": "Once", "max_tokens": 3, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2
    # the route's own validation answers a body of its shape
    bad = httpx.post(url, json={"prompt": "x", "max_tokens": -1}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text
    # neither shape: a 400 naming what it takes
    r = httpx.post(url, json={"model": MODEL_NAME, "text": "hello"}, timeout=60)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "`messages`" in msg and "`prompt`" in msg and r.json()["error"]["code"] == "unknown_invocation"
    assert httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    # `input`: the Responses API where this server registers /v1/responses, else a 400 saying so
    has_responses = "/v1/responses" in httpx.get(f"{vserver.url}/openapi.json", timeout=10).json()["paths"]
    r = httpx.post(url, json={"input": "Say hi", "max_output_tokens": 3}, timeout=60)
    if has_responses:
        assert r.status_code == 200 and r.json()["object"] == "response", r.text
    else:
        assert r.status_code == 400 and "/v1/responses" in r.json()["error"]["message"], r.text


def test_openapi_and_docs_list_the_routes(vserver):
    r = httpx.get(f"{vserver.url}/openapi.json", timeout=10)
    assert r.status_code == 200, r.text
    paths = r.json()["paths"]
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/ping",
        "/invocations",
        "/load",
        "/reset_prefix_cache",
        "/v1/cache",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/version",
        "/admin/check_integrity",
    ):
        assert path in paths, (path, sorted(paths))
    assert set(paths["/ping"]) == {"get", "post"} and "post" in paths["/invocations"]
    docs = httpx.get(f"{vserver.url}/docs", timeout=10)
    assert docs.status_code == 200 and "/openapi.json" in docs.text


def _load(s: Server) -> int:
    r = httpx.get(f"{s.url}/load", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["server_load"]


def _wait_load(s: Server, want: int) -> int:
    """/load once it reads `want` (a stream's count drops when its response has ended, just
    after the client read its last byte), or its last reading."""
    for _ in range(400):
        load = _load(s)
        if load == want:
            return load
        time.sleep(0.025)
    return load


def _half_sent(s: Server, path: str, body: bytes) -> socket.socket:
    """A request whose body has only begun to arrive: the server holds it (in flight) until
    `_finish` sends the rest."""
    port = int(s.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + body[:5])
    return sock


def _finish(sock: socket.socket, body: bytes) -> bytes:
    """Send the rest of a `_half_sent` body; the whole response."""
    sock.sendall(body[5:])
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


def test_load_counts_requests_in_flight(vserver):
    assert _wait_load(vserver, 0) == 0
    completion = json.dumps({"prompt": "Count me", "max_tokens": 3}).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": "and me"}], "max_tokens": 3, "stream": True}).encode()
    a = _half_sent(vserver, "/v1/completions", completion)
    b = _half_sent(vserver, "/v1/chat/completions", chat)
    assert _wait_load(vserver, 2) == 2  # both are in the server now
    assert b" 200 OK" in _finish(a, completion).split(b"\r\n", 1)[0]
    assert _wait_load(vserver, 1) == 1
    assert b"data: [DONE]" in _finish(b, chat)  # a stream counts until it has ended
    assert _wait_load(vserver, 0) == 0
    # a request refused before it runs leaves the count as it was
    r = httpx.post(f"{vserver.url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=60)
    assert r.status_code == 400 and _wait_load(vserver, 0) == 0
    check_integrity(vserver)


# ------------------------------------------------------------------ /reset_prefix_cache
@pytest.mark.engine_modes(*ENGINE_MODES)  # crosses the engine client: both modes
def test_reset_prefix_cache_empties_every_own_tier(vserver):
    text = prompt(vserver, "reset")
    first = cached_tokens(vserver, text)[0]  # a block's worth at most: other prompts share its start
    assert cached_tokens(vserver, text)[0] > first
    usage = admin(vserver, "GET", "/v1/cache").json()["tiers"]  # waits for the queued tier writes
    assert all(usage[t]["blocks"] > 0 for t in ("device", "host", "disk", "remote")), usage

    r = admin(vserver, "POST", "/reset_prefix_cache")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "cache.reset" and body["success"] is True and body["not_configured"] == []
    tiers = body["tiers"]
    assert set(tiers) == {"device", "host", "disk"}, body  # the shared remote tier only when named
    for name in ("device", "host", "disk"):
        assert tiers[name]["blocks"] == usage[name]["blocks"], (name, body, usage)
        assert tiers[name]["bytes"] > 0
    assert tiers["device"]["blocks_in_use"] == 0
    after = admin(vserver, "GET", "/v1/cache").json()["tiers"]
    assert [after[t]["blocks"] for t in ("device", "host", "disk")] == [0, 0, 0], after
    assert after["remote"]["blocks"] == usage["remote"]["blocks"], after
    check_integrity(vserver)

    # Redis kept the prompt's blocks: the next request restores them from there
    hit, by_tier = cached_tokens(vserver, text)
    assert hit > 0 and by_tier.get("remote", 0) > 0, by_tier

    # every tier, Redis too: a miss right after, a hit again later
    admin(vserver, "GET", "/v1/cache")
    r = admin(vserver, "POST", "/reset_prefix_cache?tiers=device,host,disk,remote")
    assert r.status_code == 200 and r.json()["tiers"]["remote"]["blocks"] > 0, r.text
    check_integrity(vserver)
    assert cached_tokens(vserver, text)[0] == 0
    assert cached_tokens(vserver, text)[0] > 0
    check_integrity(vserver)


def test_reset_of_redis_spares_what_is_not_this_configurations(vserver, redis_url):
    r = redis.Redis.from_url(redis_url)
    r.set(b"someone-else:key", b"keep me")
    r.set(b"kvtier:00ff00ff:" + b"ab" * 16, b"another model's block")
    text = prompt(vserver, "redis")
    cached_tokens(vserver, text)
    remote_blocks = admin(vserver, "GET", "/v1/cache").json()["tiers"]["remote"]["blocks"]
    assert remote_blocks > 0
    cleared = admin(vserver, "POST", "/reset_prefix_cache?tiers=remote")
    assert cleared.status_code == 200, cleared.text
    assert set(cleared.json()["tiers"]) == {"remote"} and cleared.json()["tiers"]["remote"]["blocks"] >= remote_blocks
    assert r.get(b"someone-else:key") == b"keep me"
    assert r.get(b"kvtier:00ff00ff:" + b"ab" * 16) == b"another model's block"
    # the device still holds the prompt (only Redis was named)
    hit, by_tier = cached_tokens(vserver, text)
    assert hit > 0 and set(by_tier) == {"device"}, by_tier
    check_integrity(vserver)


def test_reset_during_a_stream(vserver):
    """A reset between a stream's chunks leaves it running to its end (that its blocks stay
    and are counted as blocks_in_use is tests/engine/test_reset.py's: there the request is
    held mid-decode; here it may finish first)."""
    client = vserver.openai()
    stream = client.completions.create(
        model=MODEL_NAME, prompt="A stream the reset must not disturb.", max_tokens=150, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    r = admin(vserver, "POST", "/reset_prefix_cache")
    assert r.status_code == 200, r.text
    assert r.json()["tiers"]["device"]["blocks_in_use"] >= 0
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    check_integrity(vserver)


def test_reset_refusals(vserver):
    url = f"{vserver.url}/reset_prefix_cache"
    assert httpx.post(url, timeout=10).status_code == 401
    assert httpx.post(url, headers={"Authorization": "Bearer not-the-admin-key"}, timeout=10).status_code == 403
    for query, param in (
        ("tiers=device,gpu", "tiers"),
        ("tiers=", "tiers"),
        ("reset_running_requests=true", "reset_running_requests"),
        ("reset_external=maybe", "reset_external"),
        ("tenant=acme", "tenant"),
    ):
        r = admin(vserver, "POST", f"/reset_prefix_cache?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (query, r.text)
    # vLLM's own spellings: reset_external=false is the device alone
    r = admin(vserver, "POST", "/reset_prefix_cache?reset_external=false")
    assert r.status_code == 200 and set(r.json()["tiers"]) == {"device"}, r.text
    r = admin(vserver, "POST", "/reset_prefix_cache?reset_external=true&reset_running_requests=false")
    assert r.status_code == 200 and set(r.json()["tiers"]) == {"device", "host", "disk"}, r.text
    check_integrity(vserver)


# ------------------------------------------------------------------ request fields
def test_return_tokens_as_token_ids(vserver):
    client = vserver.openai()
    plain = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, logprobs=2, temperature=0)
    as_ids = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=4,
        logprobs=2,
        temperature=0,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    lp = as_ids.choices[0].logprobs
    ids = as_ids.choices[0].model_extra["token_ids"]
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    assert lp.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert lp.text_offset == plain.choices[0].logprobs.text_offset  # offsets count the text
    assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)

    streamed = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=4,
        logprobs=1,
        temperature=0,
        stream=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    tokens = [t for chunk in streamed for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert tokens == lp.tokens

    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    streamed_chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    tokens = [c.token for chunk in streamed_chat for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    assert tokens == [c.token for c in content]


def test_request_id_names_the_response(vserver):
    url = f"{vserver.url}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "request_id": "job-7.a"}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "cmpl-job-7.a" and r.headers["x-request-id"] == "job-7.a"
    chat = httpx.post(
        f"{vserver.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "request_id": "job-8"},
        timeout=60,
    )
    assert chat.json()["id"] == "chatcmpl-job-8" and chat.headers["x-request-id"] == "job-8"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as s:
        assert s.headers["x-request-id"] == "job-7.a"
        assert '"id":"cmpl-job-7.a"' in s.read().decode()
    # the header wins, as in vLLM
    r = httpx.post(url, json=body, headers={"X-Request-Id": "from-header"}, timeout=60)
    assert r.json()["id"] == "cmpl-from-header" and r.headers.get_list("x-request-id") == ["from-header"]
    bad = httpx.post(url, json={**body, "request_id": "has space"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id", bad.text
    # the log names the request by it
    assert "Received request cmpl-job-7.a" in vserver.log()


def test_same_request_id_twice_at_once(vserver):
    """Two requests with one request_id in flight together: neither collides in the engine."""
    client = vserver.openai()
    streams = [
        client.completions.create(
            model=MODEL_NAME, prompt=f"twin {i}", max_tokens=30, stream=True, extra_body={"request_id": "twin"}
        )
        for i in range(2)
    ]
    heads = [next(iter(s)) for s in streams]  # both are running now
    tails = [list(s) for s in streams]
    for head, tail in zip(heads, tails):
        assert head.id == "cmpl-twin" and tail[-1].choices[0].finish_reason == "length"
    # and concurrently through separate connections
    results: list[httpx.Response] = []

    def post() -> None:
        body = {"model": MODEL_NAME, "prompt": "twin", "max_tokens": 20, "request_id": "twin-2"}
        results.append(httpx.post(f"{vserver.url}/v1/completions", json=body, timeout=60))

    threads = [threading.Thread(target=post) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200, 200, 200], [r.text for r in results]
    check_integrity(vserver)


def test_request_log_lines(vserver):
    text = "A secret prompt that is much longer than the log limit"
    httpx.post(
        f"{vserver.url}/v1/completions",
        json={"prompt": text, "max_tokens": 2, "temperature": 0.5, "request_id": "logged-1"},
        timeout=60,
    )
    log = vserver.log()
    line = next(x for x in log.splitlines() if "Received request cmpl-logged-1" in x)
    assert "INFO" in line and "temperature=0.5" in line and "num_prompt_tokens:" in line
    details = next(x for x in log.splitlines() if "Request cmpl-logged-1" in x and "details" in x)
    assert "DEBUG" in details and repr(text[:MAX_LOG_LEN]) in details and text[: MAX_LOG_LEN + 1] not in details
    assert "Application startup complete" in log  # uvicorn at info ...
    assert '"POST /v1/completions HTTP/1.1" 200' not in log  # ... without its access log


def test_echo_with_max_tokens_zero(vserver):
    client = vserver.openai()
    text = "Score this sentence"
    out = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == out.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and all(isinstance(x, float) for x in lp.token_logprobs[1:])
    plain = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=0, echo=True)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None
    # streamed: one chunk, the prompt and its logprobs
    chunks = list(
        client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=0, echo=True, logprobs=1, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == text
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert chunks[-1].choices[0].finish_reason == "length"
    # without echo, max_tokens 0 is a 400 that says what it needs
    r = httpx.post(f"{vserver.url}/v1/completions", json={"prompt": text, "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"], r.text


def test_echo_streamed_with_logprobs(vserver):
    client = vserver.openai()
    text = "Echo me, then go on"
    whole = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=5, echo=True, logprobs=1, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=text, max_tokens=5, echo=True, logprobs=1, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].text.startswith(text)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == whole.choices[0].logprobs.tokens
    n = whole.usage.prompt_tokens  # (a stream's later offsets follow the text as it is released)
    assert [o for lp in streamed for o in lp.text_offset][:n] == whole.choices[0].logprobs.text_offset[:n]


def test_chat_echo_and_response_role(vserver):
    client = vserver.openai()
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, extra_body={**cont, "echo": True}
    )
    without = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, extra_body=cont
    )
    # the reply continues the assistant's message: its role, its text first
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == "The colour is" + without.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={**cont, "echo": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[1].choices[0].delta.content == "The colour is"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    # a new turn is spoken as --response-role; the user's message is not echoed into it
    new_turn = client.chat.completions.create(
        model=MODEL_NAME, messages=messages[:1], max_tokens=4, temperature=0, extra_body={"echo": True}
    )
    assert new_turn.choices[0].message.role == "helper"
    assert not new_turn.choices[0].message.content.startswith("Name a colour.")
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages[:1], max_tokens=2, stream=True)
    assert next(iter(stream)).choices[0].delta.role == "helper"
    list(stream)
    check_integrity(vserver)


# ------------------------------------------------------------------ TLS, root path, usage
def self_signed_cert(d: Path) -> tuple[Path, Path]:
    """(certificate, key) for 127.0.0.1, made here (no network, no files from elsewhere)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvtier test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .add_extension(ski, False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), False)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, False, False, False), True
        )  # digital_signature, key_cert_sign
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = d / "cert.pem", d / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_server(server_model_dir, tmp_path_factory, engine_mode):
    """HTTPS with a self-signed certificate, under the root path /kv, usage forced into every
    stream, prompt token details flag on, uvicorn's access log at info, no load tracking."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_cert(d)
    trust = ssl.create_default_context(cafile=str(cert))
    s = start_server(
        server_model_dir,
        d,
        "--log-level",
        "info",
        "--ssl-certfile",
        str(cert),
        "--ssl-keyfile",
        str(key),
        "--root-path",
        "/kv",
        "--enable-force-include-usage",
        "--enable-prompt-tokens-details",
        engine_mode=engine_mode,
        verify=trust,
    )
    yield s, trust
    try:
        assert "Traceback" not in s.log(), s.log()[-5000:]
    finally:
        stop_server(s)


class TestTLSAndRootPath:
    def test_https_with_the_openai_client(self, tls_server):
        s, trust = tls_server
        assert s.url.startswith("https://")
        client = openai.OpenAI(
            base_url=f"{s.url}/v1", api_key="k", max_retries=0, http_client=httpx.Client(verify=trust, timeout=60)
        )
        out = client.completions.create(model=MODEL_NAME, prompt="Over TLS", max_tokens=3)
        assert out.usage.completion_tokens == 3
        assert out.usage.prompt_tokens_details.cached_tokens == 0
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
            httpx.get(s.url.replace("https://", "http://") + "/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(f"{s.url}/health", timeout=5)

    def test_root_path(self, tls_server):
        s, trust = tls_server
        for path in ("/v1/models", "/kv/v1/models"):  # behind a proxy that strips the prefix, or not
            r = httpx.get(f"{s.url}{path}", verify=trust, timeout=10)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL_NAME, (path, r.text)
        spec = httpx.get(f"{s.url}/openapi.json", verify=trust, timeout=10).json()
        assert spec["servers"] == [{"url": "/kv"}]
        docs = httpx.get(f"{s.url}/docs", verify=trust, timeout=10).text
        assert "/kv/openapi.json" in docs
        assert '"GET /v1/models HTTP/1.1" 200' in s.log()  # uvicorn's access log, at --log-level info

    def test_force_include_usage_and_load_untracked(self, tls_server):
        s, trust = tls_server
        client = openai.OpenAI(
            base_url=f"{s.url}/v1", api_key="k", max_retries=0, http_client=httpx.Client(verify=trust, timeout=60)
        )
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        chunks = iter(stream)
        first = next(chunks)
        # without --enable-server-load-tracking /load answers 0, as vLLM
        load = httpx.get(f"{s.url}/load", verify=trust, timeout=10)
        assert load.status_code == 200 and load.json() == {"server_load": 0}
        chunks_all = [first, *chunks]
        assert all(c.usage is not None for c in chunks_all), chunks_all  # no stream_options asked
        assert chunks_all[-1].choices == [] and chunks_all[-1].usage.completion_tokens == 5
        done = list(client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, stream=True))
        assert done[-1].choices == [] and done[-1].usage.completion_tokens == 3
        assert all(c.usage is not None for c in done)


def test_bad_uvicorn_settings_fail_before_the_model_loads():
    from kvtier.server.app import ServerConfig

    for kwargs, word in (
        ({"ssl_keyfile": "k.pem"}, "--ssl-certfile"),
        ({"ssl_ca_certs": "ca.pem"}, "--ssl-ca-certs"),
        ({"uvicorn_log_level": "loud"}, "--uvicorn-log-level"),
        ({"root_path": "kv/"}, "--root-path"),
        ({"max_log_len": -1}, "--max-log-len"),
    ):
        with pytest.raises(ValueError, match=word):
            ServerConfig(**kwargs)
