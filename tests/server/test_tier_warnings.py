"""At `--log-level warning` an operator sees a tier go down in the server's log, with its level
and source, and the requests meanwhile are served correctly by recomputing."""

from __future__ import annotations

import time

import httpx
import pytest
from serverutil import MODEL_NAME, start_redis, stop_redis

redis = pytest.importorskip("redis")


def test_redis_down_is_a_warning_in_the_server_log(serve, tmp_path):
    proc, url = start_redis(tmp_path)
    try:
        server = serve("--remote-cache-url", url)
        body = {
            "model": MODEL_NAME,
            "prompt": "a prompt that Redis would have stored " * 2,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        }
        first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 60
        while "WARNING kvtier.tiers" not in server.log():
            assert time.monotonic() < deadline, server.log()[-3000:]
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200
            assert r.json()["choices"][0]["text"] == first["choices"][0]["text"]
        line = next(x for x in server.log().splitlines() if "WARNING kvtier.tiers" in x)
        assert "remote" in line and "unavailable" in line, line
        server.check_idle_clean()
    finally:
        stop_redis(proc)
