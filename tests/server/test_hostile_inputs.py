"""Every request field bounded at the edge of `kvtier serve`, against a real server in both
engine modes (its own process, where a too-large integer once failed to serialize as a 500,
and --engine-in-process): each numeric field of /v1/completions and /v1/chat/completions
given 2^63, 2^64, 10^30, -1, NaN (raw), true and "1", and each list field at ten times its
cap (RequestLimits), is a 400 naming the field (or a 200 where the value is valid), never a
5xx, and a valid request still succeeds afterwards. Then the content type (415), unknown
fields (a warning, or a 400 under --strict-request-fields), logit_bias keys of non-ASCII
digits, out-of-vocabulary stop_token_ids, a huge model name, and bad_words at the engine:
capped, deduplicated, tokenized in one pass and matched by an index."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from serverutil import MODEL_NAME

from kvtier.server.serving import RequestLimits

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
BASE = {
    CMPL: {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1},
    CHAT: {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 1},
}
JSON = {"content-type": "application/json"}

# value name -> raw JSON text (NaN is not JSON: the body carries it as the attacker sends it)
VALUES = {
    "2^63": str(2**63),
    "2^64": str(2**64),
    "10^30": str(10**30),
    "-1": "-1",
    "NaN": "NaN",
    "true": "true",
    "str1": '"1"',
}
V = "__VALUE__"

# field -> (endpoints, body fragment with V where the value goes, the name the error must carry)
FIELDS: dict[str, tuple[tuple[str, ...], dict[str, Any], str]] = {
    "max_tokens": ((CMPL, CHAT), {"max_tokens": V}, "max_tokens"),
    "max_completion_tokens": ((CHAT,), {"max_completion_tokens": V}, "max_completion_tokens"),
    "n": ((CMPL, CHAT), {"n": V}, "n"),
    "top_k": ((CMPL, CHAT), {"top_k": V}, "top_k"),
    "min_tokens": ((CMPL, CHAT), {"min_tokens": V}, "min_tokens"),
    "priority": ((CMPL, CHAT), {"priority": V}, "priority"),
    "logprobs": ((CMPL,), {"logprobs": V}, "logprobs"),
    "top_logprobs": ((CHAT,), {"logprobs": True, "top_logprobs": V}, "top_logprobs"),
    "prompt_logprobs": ((CMPL, CHAT), {"prompt_logprobs": V}, "prompt_logprobs"),
    "truncate_prompt_tokens": ((CMPL, CHAT), {"truncate_prompt_tokens": V}, "truncate_prompt_tokens"),
    "seed": ((CMPL, CHAT), {"seed": V}, "seed"),
    "temperature": ((CMPL, CHAT), {"temperature": V}, "temperature"),
    "top_p": ((CMPL, CHAT), {"top_p": V}, "top_p"),
    "min_p": ((CMPL, CHAT), {"min_p": V}, "min_p"),
    "presence_penalty": ((CMPL, CHAT), {"presence_penalty": V}, "presence_penalty"),
    "frequency_penalty": ((CMPL, CHAT), {"frequency_penalty": V}, "frequency_penalty"),
    "repetition_penalty": ((CMPL, CHAT), {"repetition_penalty": V}, "repetition_penalty"),
    "prompt_token_id": ((CMPL,), {"prompt": [5, V]}, "prompt"),
    "stop_token_ids_item": ((CMPL, CHAT), {"stop_token_ids": [V]}, "stop_token_ids"),
    "allowed_token_ids_item": ((CMPL, CHAT), {"allowed_token_ids": [V]}, "allowed_token_ids"),
    "logit_bias_key": ((CMPL, CHAT), {"logit_bias": {V: 1}}, "logit_bias"),
    "logit_bias_value": ((CMPL, CHAT), {"logit_bias": {"5": V}}, "logit_bias"),
}
VALID = {
    ("top_k", "-1"),  # disabled
    ("truncate_prompt_tokens", "-1"),  # as many as fit
    ("seed", "-1"),
    ("presence_penalty", "-1"),
    ("frequency_penalty", "-1"),
    ("logit_bias_value", "-1"),
    ("logit_bias_key", "str1"),  # JSON keys are strings: "1" is token 1
}
"""(field, value) pairs that are valid requests: a 200."""

CASES = [
    pytest.param(path, field, value, id=f"{path.rsplit('/', 1)[1]}-{field}-{value}")
    for field, (paths, _, _) in FIELDS.items()
    for path in paths
    for value in VALUES
]


def raw_body(path: str, fragment: dict[str, Any], literal: str) -> bytes:
    """The endpoint's base body with `fragment` merged in, V replaced by the raw literal (as a
    value), or by the literal's text without quotes (as a logit_bias key)."""
    text = json.dumps({**BASE[path], **fragment})
    text = text.replace(f'"{V}":', json.dumps(literal.strip('"')) + ":")
    return text.replace(f'"{V}"', literal).encode()


@pytest.fixture(scope="module")
def server(serve):  # in each engine mode (conftest's engine_mode)
    s = serve("--max-body-bytes", "8MiB")
    yield s
    # nothing lost: after the barrage a valid request is served and every block is free again
    r = httpx.post(s.url + CMPL, json={**BASE[CMPL], "max_tokens": 4, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    s.check_idle_clean()
    log = s.log()
    assert "Traceback" not in log and "OverflowError" not in log, log[-3000:]


def assert_names(r: httpx.Response, name: str, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert name in (err["param"] or "") or name in err["message"], err
    return err


@pytest.mark.parametrize("path,field,value", CASES)
def test_numeric_field_out_of_range_is_a_400_naming_it(server, path, field, value):
    _, fragment, name = FIELDS[field]
    r = httpx.post(server.url + path, content=raw_body(path, fragment, VALUES[value]), headers=JSON, timeout=60)
    assert r.status_code < 500, r.text[:500]
    if (field, value) in VALID:
        assert r.status_code == 200, r.text[:500]
    else:
        assert_names(r, name)


def test_integers_past_the_parser_limit_name_their_field(server):
    for digits in (4300, 5000):  # the most Python parses; one past it
        body = raw_body(CMPL, {"max_tokens": V}, "9" * digits)
        assert_names(httpx.post(server.url + CMPL, content=body, headers=JSON, timeout=60), "max_tokens")
    body = raw_body(CHAT, {"max_completion_tokens": V}, "9" * 4300)
    assert_names(httpx.post(server.url + CHAT, content=body, headers=JSON, timeout=60), "max_completion_tokens")


LIMITS = RequestLimits()
LISTS = {
    "stop": (CMPL, lambda k: {"stop": [f"s{i}" for i in range(k)]}, LIMITS.max_stop),
    "stop_token_ids": (CMPL, lambda k: {"stop_token_ids": [i % 200 for i in range(k)]}, LIMITS.max_stop_token_ids),
    "bad_words": (CMPL, lambda k: {"bad_words": [f"w{i}" for i in range(k)]}, LIMITS.max_bad_words),
    "logit_bias": (CMPL, lambda k: {"logit_bias": {str(i): 1 for i in range(k)}}, LIMITS.max_logit_bias),
    "allowed_token_ids": (CMPL, lambda k: {"allowed_token_ids": [i % 200 for i in range(k)]}, None),
    "messages": (CHAT, lambda k: {"messages": MSGS * k}, LIMITS.max_messages),
    "tools": (
        CHAT,
        lambda k: {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(k)]},
        LIMITS.max_tools,
    ),
}


@pytest.mark.parametrize("field", list(LISTS))
def test_list_field_past_its_cap_is_a_400_naming_it_and_the_cap(server, server_model_dir, field):
    from kvtier.model.tokenizer import Tokenizer

    path, make, cap = LISTS[field]
    cap = cap or Tokenizer(server_model_dir).vocab_size  # allowed_token_ids: the vocabulary
    r = httpx.post(server.url + path, json={**BASE[path], **make(10 * cap)}, timeout=120)
    err = assert_names(r, field)
    assert err["param"] == field and str(cap) in err["message"], err
    assert err["code"] == "too_many_items"
    r = httpx.post(server.url + path, json={**BASE[path], **make(min(cap, 8))}, timeout=120)
    assert r.status_code == 200 or (field == "tools" and r.status_code == 400), r.text[:300]


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/xml", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
@pytest.mark.parametrize("path", [CMPL, CHAT, "/tokenize"])
def test_json_endpoints_refuse_other_content_types(server, path, content_type):
    body = json.dumps(BASE.get(path, {"prompt": "hi"})).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    r = httpx.post(server.url + path, content=body, headers=headers, timeout=60)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]


def test_json_with_a_charset_is_taken(server):
    r = httpx.post(
        server.url + CMPL,
        content=json.dumps(BASE[CMPL]).encode(),
        headers={"content-type": "Application/JSON; charset=utf-8"},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_unknown_fields_are_logged_by_name(server):
    r = httpx.post(server.url + CMPL, json={**BASE[CMPL], "max_token": 5, "gided_json": {}, "store": False}, timeout=60)
    assert r.status_code == 200, r.text
    log = server.log()
    line = next(x for x in log.splitlines() if "present in the request but ignored" in x)
    assert "max_token" in line and "gided_json" in line and "store" not in line  # store: OpenAI's, neutral


def test_logit_bias_keys_are_ascii_decimal_token_ids_only(server):
    for key in ("\u0663", "\uff13", "3.0", " 3", "+3", "0x3"):  # Arabic-Indic and fullwidth 3, ...
        r = httpx.post(server.url + CMPL, json={**BASE[CMPL], "logit_bias": {key: 5}}, timeout=60)
        assert_names(r, "logit_bias")
    assert httpx.post(server.url + CMPL, json={**BASE[CMPL], "logit_bias": {"3": 5}}, timeout=60).status_code == 200


def test_out_of_vocabulary_token_ids_are_refused(server, server_model_dir):
    from kvtier.model.tokenizer import Tokenizer

    vocab = Tokenizer(server_model_dir).vocab_size
    for field in ("stop_token_ids", "allowed_token_ids"):
        r = httpx.post(server.url + CMPL, json={**BASE[CMPL], field: [1, vocab + 5]}, timeout=60)
        err = assert_names(r, field)
        assert "vocabulary" in err["message"], err


def test_a_huge_model_name_is_cut_in_the_404(server):
    r = httpx.post(server.url + CMPL, json={**BASE[CMPL], "model": "m" * (1 << 20)}, timeout=60)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and len(err["message"]) < 400 and "m" * 100 + "..." in err["message"]


def test_bad_words_are_tokenized_and_matched_at_the_server(server, server_model_dir):
    from kvtier.model.tokenizer import Tokenizer

    (q,) = Tokenizer(server_model_dir).encode("q", add_special_tokens=False)
    body = {**BASE[CMPL], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logit_bias": {str(q): 100}}
    free = httpx.post(server.url + CMPL, json=body, timeout=60).json()["choices"][0]["text"]
    assert free == "q" * 12  # the bias alone makes every token q
    words = [f"w{i}" for i in range(1000)] + ["q"] * 50  # a long list with repeats, under the cap
    r = httpx.post(server.url + CMPL, json={**body, "bad_words": words}, timeout=60)
    assert r.status_code == 200, r.text
    assert "q" not in r.json()["choices"][0]["text"]


# ------------------------------------------------------------------ strict mode
def test_strict_mode_refuses_unknown_fields_and_keeps_openai_clients_working(serve):
    s = serve("--strict-request-fields")
    r = httpx.post(s.url + CMPL, json={**BASE[CMPL], "max_token": 5}, timeout=60)
    err = assert_names(r, "max_token")
    assert err["param"] == "max_token" and err["code"] == "unknown_field" and "'max_tokens'" in err["message"]
    r = httpx.post(s.url + CHAT, json={**BASE[CHAT], "gided_json": {}}, timeout=60)
    assert assert_names(r, "gided_json")["param"] == "gided_json"
    client = s.openai()
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_completion_tokens=2, store=False, metadata={"k": "v"}, user="u", seed=1
    )
    assert out.choices[0].message.content is not None
    out2 = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
    assert out2.usage.completion_tokens == 2
    assert "Traceback" not in s.log()


# ------------------------------------------------------------------ the engine's bad_words
def test_engine_caps_bad_words_and_tokenizes_each_distinct_word_once(server_model_dir):
    from kvtier import SamplingParams
    from kvtier.model.sampler import tokenize_bad_words
    from kvtier.model.tokenizer import Tokenizer

    with pytest.raises(
        ValueError, match=rf"bad_words has 20000 distinct words; at most {SamplingParams.MAX_BAD_WORDS}"
    ):
        SamplingParams(bad_words=[f"w{i}" for i in range(20000)])
    words = [f"w{i}" for i in range(1000)]
    sp = SamplingParams(bad_words=words * 3)  # repeats do not count against the cap
    assert sp.bad_words == words
    tok = Tokenizer(server_model_dir)
    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return tok.encode(text, add_special_tokens=False)

    seqs = tokenize_bad_words(words * 3, encode)
    assert len(calls) == 2 * len(words)  # one pass: each distinct word as is and with a space
    assert len({tuple(s) for s in seqs}) == len(seqs) == 2 * len(words)


def test_bad_words_index_matches_every_word_it_completes(server_model_dir):
    import torch

    from kvtier import SamplingParams
    from kvtier.model.sampler import SampleRow, bad_words_index, process_row, tokenize_bad_words
    from kvtier.model.tokenizer import Tokenizer

    tok = Tokenizer(server_model_dir)
    words = [f"w{i}" for i in range(1000)] + ["x"]
    sp = SamplingParams(bad_words=words)
    sp.bad_words_token_ids = tokenize_bad_words(words, lambda t: tok.encode(t, add_special_tokens=False))
    index = bad_words_index(sp)
    assert index is bad_words_index(sp)  # built once
    assert len(index.prefix_lengths) <= 4  # a lookup per prefix length, not per word
    for output in ("say w1", "w99", " w", ""):
        out_ids = tok.encode(output, add_special_tokens=False)
        expect = {  # the brute force: every word whose all-but-last tokens end the output
            s[-1]
            for s in sp.bad_words_token_ids
            if len(s) == 1 or (len(out_ids) >= len(s) - 1 and out_ids[len(out_ids) - len(s) + 1 :] == s[:-1])
        }
        assert len(expect) > 1 or not output
        assert set(index.banned(out_ids)) == expect
        logits = process_row(torch.zeros(tok.vocab_size), SampleRow(0, sp, None, [], out_ids))
        assert {int(i) for i in torch.nonzero(torch.isinf(logits)).flatten()} == expect
    assert tok.encode("x", add_special_tokens=False)[0] in index.banned([])
