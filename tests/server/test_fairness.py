"""One request cannot hold up the others: a batch of too many prompts or sequences, or text
longer than the context can possibly hold, is a 400 before the server does the expensive
thing (the error says which check fired), and other clients' requests complete correctly
while such requests are being answered. The figures are in benchmarks/fairness.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serverutil import MAX_MODEL_LEN, MODEL_NAME

from kvtier.server.sse import aiter_events

# the byte-level test tokenizer: its longest vocabulary entry is "<|assistant|>"
MAX_CHARS_PER_TOKEN = len("<|assistant|>")
MAX_TEXT_CHARS = MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN


@pytest.fixture(scope="module")
def default_server(serve):
    """Default request limits, a body limit that lets a 20,000-prompt batch in."""
    s = serve("--max-body-bytes", "8MiB")
    yield s
    assert "Traceback" not in s.log(), s.log()


@pytest.fixture(scope="module")
def big_server(serve):
    s = serve("--max-body-bytes", "8MiB", "--max-prompts-per-request", "4", "--max-seqs-per-request", "6")
    yield s
    assert "Traceback" not in s.log(), s.log()


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(
        server.url + path, content=json.dumps(body), timeout=timeout, headers={"content-type": "application/json"}
    )


def completion(server, **fields) -> httpx.Response:
    return post(server, "/v1/completions", {"model": MODEL_NAME, "max_tokens": 1, **fields})


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text[:500]
    return r.json()["error"]


# ------------------------------------------------------------------ prompts and sequences
def test_default_limit_rejects_20000_prompts(default_server):
    server = default_server
    err = error_of(completion(server, prompt=[[5, 6, 7]] * 20000, max_tokens=1))
    assert err["code"] == "too_many_prompts" and err["param"] == "prompt"
    assert "20000 prompts" in err["message"] and "at most 128" in err["message"]
    assert "--max-prompts-per-request" in err["message"]
    server.check_idle_clean()  # none of them reached the engine


def test_default_limit_admits_128_prompts(default_server):
    r = completion(default_server, prompt=[[5, 6, 7]] * 128, max_tokens=1)
    assert r.status_code == 200, r.text[:500]
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(128))


def test_prompt_limit_flag(big_server):
    err = error_of(completion(big_server, prompt=["a", "b", "c", "d", "e"]))
    assert err["code"] == "too_many_prompts" and "at most 4" in err["message"]
    r = completion(big_server, prompt=["a", "b", "c", "d"])
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_sequence_limit_counts_prompts_times_n(big_server):
    err = error_of(completion(big_server, prompt=[[1, 2], [3, 4]], n=4, max_tokens=2))
    assert err["code"] == "too_many_sequences" and err["param"] == "n"
    assert "8 sequences" in err["message"] and "--max-seqs-per-request" in err["message"]
    err = error_of(
        post(
            big_server,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "n": 7, "max_tokens": 2},
        )
    )
    assert err["code"] == "too_many_sequences"
    r = completion(big_server, prompt=[[1, 2], [3, 4]], n=3, max_tokens=2)
    assert r.status_code == 200 and len(r.json()["choices"]) == 6


def test_token_list_longer_than_the_context_is_rejected_by_length(big_server):
    err = error_of(completion(big_server, prompt=[5] * 1_000_000))
    assert err["code"] == "context_length_exceeded"
    assert err["message"].startswith("the prompt has 1000000 token ids")


# ------------------------------------------------------------------ text too long to tokenize
def test_3mb_text_is_rejected_before_tokenizing(big_server):
    err = error_of(completion(big_server, prompt="x" * (3 << 20)))
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    # counted in characters (the untokenized check), not in tokens
    assert err["message"].startswith(f"the prompt has {3 << 20} characters")
    assert f"no text over {MAX_TEXT_CHARS} characters" in err["message"]


def test_character_bound_is_tight_at_its_edge(big_server):
    # at the bound the text is tokenized (and is still too long in tokens); one more, it is not
    err = error_of(completion(big_server, prompt="x" * MAX_TEXT_CHARS))
    assert err["code"] == "context_length_exceeded"
    assert "tokens" in err["message"] and "characters" not in err["message"]
    err = error_of(completion(big_server, prompt="x" * (MAX_TEXT_CHARS + 1)))
    assert err["message"].startswith(f"the prompt has {MAX_TEXT_CHARS + 1} characters")


def test_each_prompt_of_a_batch_is_bounded(big_server):
    err = error_of(completion(big_server, prompt=["ok", "y" * (MAX_TEXT_CHARS + 1)]))
    assert err["code"] == "context_length_exceeded"
    assert "characters" in err["message"]


def test_long_chat_is_rejected_on_the_rendered_text(big_server):
    messages = [{"role": "user", "content": "z" * 1000}] * 1000
    err = error_of(post(big_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}))
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert err["message"].startswith("the rendered chat has ")


# ------------------------------------------------------------------ others keep being served
async def _stream_tokens(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> list[int]:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "temperature": 0,
    }
    ids: list[int] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for event in aiter_events(r):
            if event is not None:
                ids += event["choices"][0].get("token_ids") or []
    return ids


def test_normal_clients_complete_while_hostile_requests_are_answered(big_server):
    hostile = [
        {"model": MODEL_NAME, "prompt": [[5, 6, 7]] * 20000, "max_tokens": 1},
        {"model": MODEL_NAME, "prompt": "x" * (3 << 20), "max_tokens": 1},
        {"model": MODEL_NAME, "prompt": "x" * (MAX_TEXT_CHARS - 1), "max_tokens": 1},
        {"messages": [{"role": "user", "content": "z" * 1000}] * 3000, "max_tokens": 1},
    ]

    async def run() -> tuple[list[httpx.Response], list[list[int]]]:
        async with httpx.AsyncClient(base_url=big_server.url, timeout=120) as client:
            paths = ["/v1/completions"] * 3 + ["/v1/chat/completions"]
            headers = {"content-type": "application/json"}
            bad = [client.post(p, content=json.dumps(b), headers=headers) for p, b in zip(paths * 2, hostile * 2)]
            good = [_stream_tokens(client, f"client {i} says hello", 8) for i in range(4)]
            results = await asyncio.gather(*bad, *good)
            return list(results[: len(bad)]), list(results[len(bad) :])

    bad, good = asyncio.run(run())
    for r in bad:
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["code"] in ("too_many_prompts", "context_length_exceeded")
    alone = asyncio.run(_alone(big_server))
    assert good == alone  # each client got its 8 greedy tokens, the same as with nobody else about
    big_server.check_idle_clean()


async def _alone(server) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        return [await _stream_tokens(client, f"client {i} says hello", 8) for i in range(4)]
