"""At `--log-level warning` an operator sees a tier go down in the server's log, with its level
and source, and the requests meanwhile are served correctly by recomputing."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest

from serverutil import MODEL_NAME, free_port

redis = pytest.importorskip("redis")


def test_redis_down_is_a_warning_in_the_server_log(serve, tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (CI installs Debian's redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)
        server = serve("--remote-cache-url", f"redis://127.0.0.1:{port}/0")
        body = {"model": MODEL_NAME, "prompt": "a prompt that Redis would have stored " * 2,
                "max_tokens": 4, "temperature": 0, "ignore_eos": True}
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
        if proc.poll() is None:
            proc.kill()
