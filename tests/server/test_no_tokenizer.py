"""A checkpoint without tokenizer.json: token-id prompts work, text gets a clear error, and a
stream still sends a chunk as tokens are produced (the client's only clock for TTFT and ITL)."""

from __future__ import annotations

import httpx
import pytest
from serverutil import MAX_MODEL_LEN, MODEL_NAME, start_server, stop_server

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory, engine_mode):
    from kvtier.model.builder import build_random_llama

    d = tmp_path_factory.mktemp("bare_model")
    build_random_llama(
        d,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=300,
        max_position_embeddings=MAX_MODEL_LEN,
        dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
    )
    assert not (d / "tokenizer.json").exists()
    s = start_server(d, tmp_path_factory.mktemp("bare_logs"), engine_mode=engine_mode)
    yield s
    stop_server(s)
    assert "Traceback" not in s.log(), s.log()


def test_stream_sends_a_chunk_per_token_without_a_tokenizer(bare_server):
    client = bare_server.openai()
    prompt = list(range(10, 40))
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, **GREEDY)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    token_chunks = [c for c in chunks if c.choices]
    # a chunk per engine step that produced tokens (steps the client fell behind on coalesce),
    # not one chunk at the end
    assert 1 <= len(token_chunks) <= 12
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 12
    bare_server.check_idle_clean()


def test_return_token_ids_stream_and_body(bare_server):
    """vLLM's `return_token_ids`: the body carries prompt and output ids; in a stream, the ids of
    the chunks add up to the same output (so a client counts tokens per chunk exactly)."""
    client = bare_server.openai()
    prompt = list(range(50, 90))
    body = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=10,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = body.choices[0].model_dump()
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 10
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=10,
            stream=True,
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    streamed = [t for c in chunks if c.choices for t in c.choices[0].model_dump()["token_ids"]]
    assert streamed == choice["token_ids"]
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0.0)
    assert "token_ids" not in plain.choices[0].model_dump()
    bare_server.check_idle_clean()


def test_text_prompt_without_a_tokenizer_is_a_clear_400(bare_server):
    r = httpx.post(
        f"{bare_server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 400
    assert "tokenizer" in r.json()["error"]["message"]
    bare_server.check_idle_clean()
