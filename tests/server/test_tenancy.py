"""API keys map to tenants: a listed key is required, the same prompt never hits across
tenants (no timing side channel), it does hit within a tenant, a client's cache_salt only
subdivides its tenant, admin endpoints need an admin key, and the request log records what
later tooling needs without raw text."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from serverutil import engine_mode_flags

PROMPT = "A long shared prompt that both tenants send, word for word, to the same server. " * 3


@pytest.fixture(scope="module")
def tenant_server(serve, tmp_path_factory):
    d = tmp_path_factory.mktemp("tenancy")
    keys = d / "keys.json"
    keys.write_text(
        json.dumps(
            {"keys": {"sk-a": "acme", "sk-a2": "acme", "sk-b": "globex", "sk-admin": {"tenant": "ops", "admin": True}}}
        )
    )
    log = d / "requests.jsonl"
    s = serve("--api-keys", str(keys), "--request-log", str(log), "--num-device-blocks", "256")
    yield s, log
    assert "Traceback" not in s.log()


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60.0)


def cached(server, key: str, prompt: str = PROMPT, **extra) -> int:
    r = client(server, key).completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra or None
    )
    return r.usage.prompt_tokens_details.cached_tokens


def test_keys_are_required(tenant_server):
    s, _ = tenant_server
    with pytest.raises(openai.AuthenticationError):
        cached(s, "sk-wrong")
    r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_no_cross_tenant_hits_but_hits_within_a_tenant(tenant_server):
    s, _ = tenant_server
    assert cached(s, "sk-a") == 0
    assert cached(s, "sk-b") == 0  # same prompt, other tenant: nothing shared
    assert cached(s, "sk-a2") > 0  # another key of the same tenant: a hit
    assert cached(s, "sk-b") > 0
    # a client salt subdivides its tenant's space; it cannot reach into another tenant's
    assert cached(s, "sk-a", cache_salt="project-x") == 0
    assert cached(s, "sk-a", cache_salt="project-x") > 0
    assert cached(s, "sk-b", cache_salt="project-x") == 0


def test_admin_endpoint_needs_an_admin_key(tenant_server):
    s, _ = tenant_server
    r = httpx.post(f"{s.url}/admin/check_integrity", headers={"Authorization": "Bearer sk-a"})
    assert r.status_code == 403
    r = httpx.post(f"{s.url}/admin/check_integrity", headers={"Authorization": "Bearer sk-admin"}, timeout=30)
    assert r.status_code == 200 and r.json()["ok"] is True


def test_request_log_has_tokens_and_tenant_hash_but_no_text(tenant_server):
    s, log = tenant_server
    before = len(log.read_text().splitlines())
    cached(s, "sk-b", prompt="log me please")
    deadline = time.monotonic() + 30.0  # the log's writer thread appends the line after the answer
    while len(log.read_text().splitlines()) <= before:
        assert time.monotonic() < deadline, "no request-log line for the request"
        time.sleep(0.02)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    rec = lines[-1]
    assert rec["prompt_token_ids"] and rec["output_token_ids"] and rec["tenant"]
    assert rec["tenant"] != "globex" and len(rec["tenant"]) == 16
    assert "log me please" not in log.read_text() and "prompt" not in rec
    assert rec["first_token_time"] >= rec["arrival_time"] > 1.7e9  # wall clock
    assert "device" in rec["cached_tokens_by_tier"]
    tenants = {r["tenant"] for r in lines}
    assert len(tenants) >= 2


def test_bad_key_file_is_a_clear_error(server_model_dir, tmp_path, engine_mode):
    import subprocess
    import sys

    bad = tmp_path / "keys.json"
    bad.write_text("{not json")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "serve",
            "--model",
            str(server_model_dir),
            *engine_mode_flags(engine_mode, ("--api-keys", str(bad))),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "not valid JSON" in p.stderr and "Traceback" not in p.stderr
