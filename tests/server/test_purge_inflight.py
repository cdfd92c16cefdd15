"""DELETE /v1/cache while the tenant's own request runs: the request is aborted (the answer
says so and its stream ends with finish_reason "abort"), and nothing of the tenant from
before the purge is readable or hittable anywhere afterwards: not on device (blocks its
running request referenced), not in host, disk or Redis (stores queued on the I/O threads,
write-back evictions), and no new data key appears."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("cryptography")
redis = pytest.importorskip("redis")

from serverutil import start_server  # noqa: E402

PROMPT = "Tenant A's running document: " + "0123456789abcdef" * 48  # 797 tokens
LONG_CONTEXT = 4096


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The tiny test model with a 4k context, so one request can decode for thousands of steps."""
    from kvtier.model.builder import build_random_llama
    from kvtier.model.tokenizer import build_byte_tokenizer

    d = tmp_path_factory.mktemp("long_model")
    vocab = build_byte_tokenizer(d)
    build_random_llama(
        d,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=LONG_CONTEXT,
        dtype="float32",
        bos_token_id=256,
        eos_token_id=257,
    )
    return d


@pytest.fixture(scope="module")
def start(long_model_dir, tmp_path_factory, engine_mode):
    from serverutil import stop_server

    started = []
    logs = tmp_path_factory.mktemp("inflight_logs")

    def _start(*flags: str):
        s = start_server(long_model_dir, logs, *flags, engine_mode=engine_mode)
        started.append(s)
        return s

    yield _start
    for s in started:
        stop_server(s)
        assert "Traceback" not in s.log(), s.log()


def call(s, method: str, path: str, key: str, **kw) -> httpx.Response:
    return httpx.request(method, f"{s.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=120, **kw)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_purge_aborts_the_running_request_and_leaves_nothing(start, tmp_path, redis_url, policy):
    from kvtier.tiers.crypto import KeyStore

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": "acme", "sk-admin": {"tenant": "ops", "admin": True}}}))
    redis.Redis.from_url(redis_url).flushdb()  # this module's redis-server: start empty
    s = start(
        "--api-keys",
        str(keys),
        "--num-device-blocks",
        "2048",
        "--host-cache-bytes",
        "256KiB",
        "--disk-cache-dir",
        str(tmp_path / "disk"),
        "--remote-cache-url",
        redis_url,
        "--kv-key-dir",
        str(tmp_path / "keys"),
        "--cache-write-policy",
        policy,
    )
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": LONG_CONTEXT - 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    finish = []
    with httpx.stream(
        "POST", f"{s.url}/v1/completions", json=body, timeout=120, headers={"Authorization": "Bearer sk-a"}
    ) as stream:
        lines = stream.iter_lines()
        for line in lines:  # the first token: the prompt's blocks are cached and being stored
            if line.startswith("data: {"):
                break
        during = call(s, "GET", "/v1/cache", "sk-a").json()["tiers"]
        assert during["device"]["blocks"] > 0
        if policy == "write_through":
            assert during["host"]["blocks"] > 0 and during["disk"]["blocks"] > 0 and during["remote"]["blocks"] > 0

        res = call(s, "DELETE", "/v1/cache", "sk-a")
        assert res.status_code == 200, res.text
        res = res.json()
        assert res["aborted_requests"] == 1 and res["complete"] is True and res["pending"] == []
        assert res["deleted_blocks"]["device_in_use"] == 0
        assert res["data_key_destroyed"] is (policy == "write_through")  # write-back: none was made yet
        for line in lines:  # the stream ends, aborted
            if line.startswith("data: {"):
                finish += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
    assert finish == ["abort"]

    # nothing of acme anywhere: device, host, disk files, Redis entries; no new data key
    usage = call(s, "GET", "/v1/cache", "sk-a").json()["tiers"]
    assert {name: t["blocks"] for name, t in usage.items()} == {"device": 0, "host": 0, "disk": 0, "remote": 0}
    assert list((tmp_path / "disk").rglob("*.kv")) == []
    assert list(redis.Redis.from_url(redis_url).scan_iter(match="kvtier:*")) == []
    assert not KeyStore(tmp_path / "keys").has_key("acme")

    # the prompt starts from nothing
    r = call(
        s,
        "POST",
        "/v1/completions",
        "sk-a",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0},
    )
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ok = call(s, "POST", "/admin/check_integrity", "sk-admin")
    assert ok.status_code == 200 and ok.json()["ok"] is True and ok.json()["num_unfinished"] == 0
