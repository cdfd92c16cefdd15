"""What a vLLM user sends beyond OpenAI's fields, over real HTTP: vLLM's sampling extras
(penalties, logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens) give the offline
API's tokens; the fields kvtier does not implement are a 400 naming them, never ignored;
/tokenize, /detokenize, /version, CORS, X-Request-Id, continuous usage stats, a request's own
chat template, continue_final_message, several served model names and `--api-key`."""

from __future__ import annotations

import json

import httpx
import pytest
from serverutil import MODEL_NAME

from kvtier import SamplingParams

pytest.importorskip("openai")

PROMPT = "The quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def vserver(serve, tmp_path_factory):
    admin = tmp_path_factory.mktemp("admin") / "admin.key"
    admin.write_text("sk-admin-key-0123456789abcdef\n")
    admin.chmod(0o600)
    s = serve(
        "--served-model-name",
        MODEL_NAME,
        "tiny-alias",
        "--api-key",
        "sk-one",
        "sk-two",
        "--admin-key-file",
        str(admin),
        "--trust-request-chat-template",  # test_request_chat_template_and_continue sends its own
    )
    yield s
    assert "Traceback" not in s.log(), s.log()


def _post(server, path, body, key="sk-one", headers=None):
    h = {"Authorization": f"Bearer {key}", **(headers or {})}
    return httpx.post(f"{server.url}{path}", json=body, headers=h, timeout=60)


@pytest.mark.parametrize(
    "extra",
    [
        dict(repetition_penalty=1.4),
        dict(frequency_penalty=0.9, presence_penalty=0.5),
        dict(logit_bias={"97": 5.0}),
        dict(allowed_token_ids=[97, 98, 99, 32]),
        dict(truncate_prompt_tokens=7),
    ],
)
def test_sampling_extras_match_offline(vserver, llm, extra):
    r = _post(
        vserver,
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True, **extra},
    )
    assert r.status_code == 200, r.text
    kw = dict(extra)
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **kw))[0]
    assert r.json()["choices"][0]["text"] == ref.outputs[0].text
    assert r.json()["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)


def test_bad_words_over_http(vserver, llm):
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, bad_words=["e", "o"]))[0]
    r = _post(
        vserver,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True, "bad_words": ["e", "o"]},
    )
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text == ref.outputs[0].text and "e" not in text and "o" not in text


@pytest.mark.parametrize(
    "field,value",
    [
        ("guided_whitespace_pattern", " *"),
        ("use_beam_search", True),
        ("logits_processors", ["x"]),
        ("suffix", "tail"),
        ("length_penalty", 0.5),
        ("spaces_between_special_tokens", False),
    ],
)
def test_unimplemented_fields_refused(vserver, field, value):
    r = _post(vserver, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize(
    "field,value",
    [
        ("documents", [{"text": "x"}]),
        ("vllm_xargs", {"a": 1}),
    ],
)
def test_unimplemented_chat_fields_refused(vserver, field, value):
    r = _post(
        vserver,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize(
    "body,param",
    [
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"priority": 3}, "priority"),
        ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    ],
)
def test_bad_extras_are_400(vserver, body, param):
    r = _post(vserver, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_detokenize_version(vserver, llm):
    r = _post(vserver, "/tokenize", {"prompt": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == llm.tokenizer.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0
    r = _post(vserver, "/tokenize", {"prompt": "ab", "add_special_tokens": False, "return_token_strs": True})
    assert r.json()["token_strs"] == ["a", "b"]
    messages = [{"role": "user", "content": "Hi"}]
    r = _post(vserver, "/tokenize", {"messages": messages})
    assert r.json()["tokens"] == llm.tokenizer.encode_chat(messages)
    r = _post(vserver, "/detokenize", {"tokens": llm.tokenizer.encode("hello", add_special_tokens=False)})
    assert r.status_code == 200 and r.json() == {"prompt": "hello"}
    assert _post(vserver, "/detokenize", {"tokens": [10**7]}).status_code == 400
    assert _post(vserver, "/tokenize", {"prompt": "x"}, key="sk-wrong").status_code == 401
    v = httpx.get(f"{vserver.url}/version", timeout=10)
    assert v.status_code == 200 and v.json()["version"]


def test_api_key_and_model_aliases(vserver):
    assert _post(vserver, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, key="nope").status_code == 401
    for key, name in (("sk-one", MODEL_NAME), ("sk-two", "tiny-alias")):
        r = _post(vserver, "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 1}, key=key)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL_NAME
    assert httpx.get(f"{vserver.url}/v1/models", timeout=10).status_code == 401  # as vLLM: every /v1 path
    ids = [
        m["id"]
        for m in httpx.get(f"{vserver.url}/v1/models", timeout=10, headers={"Authorization": "Bearer sk-one"}).json()[
            "data"
        ]
    ]
    assert ids == [MODEL_NAME, "tiny-alias"]


def test_cors_and_request_id(vserver):
    pre = httpx.options(
        f"{vserver.url}/v1/completions",
        timeout=10,
        headers={
            "Origin": "http://example.org",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] in ("*", "http://example.org")
    r = _post(
        vserver,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"X-Request-Id": "trace-42"},
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-42"
    assert r.json()["id"] == "chatcmpl-trace-42"
    # the same id twice at once is fine: the engine's own id stays unique
    r2 = _post(
        vserver, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2}, headers={"X-Request-Id": "trace-42"}
    )
    assert r2.status_code == 200 and r2.json()["id"] == "cmpl-trace-42"


def test_continuous_usage_stats(vserver):
    with httpx.stream(
        "POST",
        f"{vserver.url}/v1/chat/completions",
        timeout=60,
        headers={"Authorization": "Bearer sk-one"},
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ) as r:
        chunks = [
            json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices and all("usage" in c for c in with_choices)
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_request_chat_template_and_continue(vserver, llm):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    r = _post(vserver, "/tokenize", {"messages": messages, "chat_template": template, "add_generation_prompt": False})
    assert r.json()["tokens"] == llm.tokenizer.encode("<user>Hi<assistant>Once upon", add_special_tokens=False)
    r = _post(
        vserver,
        "/v1/chat/completions",
        {
            "messages": messages,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    assert r.status_code == 200, r.text
    text = llm.tokenizer.apply_chat_template(messages, False, continue_final_message=True)
    assert text.endswith("Once upon")
    ref = llm.generate(
        {"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False)},
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
    )[0]
    assert r.json()["choices"][0]["message"]["content"] == ref.outputs[0].text
    both = _post(
        vserver, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "continue_final_message": True}
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "messages"
    broken = _post(
        vserver, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "chat_template": "{% for %}"}
    )
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "chat_template"
    body = _post(vserver, "/admin/check_integrity", {}, key="sk-admin-key-0123456789abcdef").json()
    assert body["ok"] is True and body["num_unfinished"] == 0


def test_echo_loglikelihood_as_lm_eval_sends_it(vserver, llm):
    """lm-evaluation-harness `local-completions` scores a continuation with echo=true,
    logprobs=1, max_tokens=1 and reads token_logprobs of the prompt."""
    context, continuation = "The capital of France is", " Paris"
    r = _post(
        vserver,
        "/v1/completions",
        {
            "model": MODEL_NAME,
            "prompt": context + continuation,
            "echo": True,
            "logprobs": 1,
            "max_tokens": 1,
            "temperature": 0.0,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = llm.tokenizer.encode(context + continuation)
    ref = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, logprobs=1)
    )[0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(context + continuation)
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None
    want = [ref.prompt_logprobs[i][t] for i, t in enumerate(ids) if i > 0]
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=1e-5)
    assert all(top is None or len(top) >= 1 for top in lp["top_logprobs"])
    # vLLM's prompt_logprobs field, asked for directly
    r = _post(vserver, "/v1/completions", {"prompt": context, "max_tokens": 1, "prompt_logprobs": 0})
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(llm.tokenizer.encode(context))
    # each entry carries its rank across the engine process's wire, as the offline engine gives it
    ctx_ids = llm.tokenizer.encode(context)
    ref_ctx = llm.generate({"prompt_token_ids": ctx_ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    for i, t in enumerate(ctx_ids[1:], 1):
        assert plp[i][str(t)]["rank"] == ref_ctx.prompt_logprobs[i][t].rank >= 1
    # echo with a stream: the prompt comes first, then the generated text (as vLLM streams it)
    r = _post(vserver, "/v1/completions", {"prompt": context, "max_tokens": 1, "echo": True, "stream": True})
    assert r.status_code == 200, r.text
    chunks = [
        json.loads(line[len("data: ") :])
        for line in r.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert streamed.startswith(context) and len(streamed) > len(context)
