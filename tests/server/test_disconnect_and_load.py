"""Clients that go away free their blocks; concurrent streaming clients under a small pool
(preemptions, shared prefixes, early disconnects) see no errors and leave the engine clean."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from serverutil import MODEL_NAME, scrape, start_redis, stop_redis

from kvtier.server.sse import aiter_events

LONG = {
    "model": MODEL_NAME,
    "prompt": "a request that the client abandons",
    "max_tokens": 210,
    "temperature": 0.0,
    "ignore_eos": True,
}


def aborted(url: str) -> float:
    return scrape(url).get(("kvtier:request_success_total", (("finished_reason", "abort"),)), 0.0)


def wait_until_idle_clean(server, timeout_s: float = 30.0) -> None:
    """/admin/check_integrity reports a clean, idle engine (it waits for the engine to go idle)."""
    server.check_idle_clean(timeout_s=timeout_s)


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    """Poll until `predicate()` holds; a bound against a hang, never a measure of speed."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def stalled_redis(tmp_path_factory):
    """A real redis-server that the test can freeze (SIGSTOP) and thaw (SIGCONT)."""
    pytest.importorskip("redis")
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield proc, url
    stop_redis(proc)


def test_stream_closed_early_aborts_and_frees_blocks(server):
    """A client that hangs up mid-stream aborts its request (max_tokens is the whole context
    budget, so the request is still decoding when the client leaves)."""
    before = aborted(server.url)
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data:") and json.loads(line[5:])["choices"][0]["text"]:
                break  # one token of text arrived: the request is running; hang up
    wait_until_idle_clean(server)
    assert aborted(server.url) == before + 1


def test_non_streaming_client_timeout_aborts(serve, stalled_redis):
    """A non-streaming client that times out aborts its request. The request is held in the
    engine by its remote-tier lookup against a frozen redis-server, so the client's timeout fires
    while it is unfinished however fast the machine is; thawing Redis lets the engine go idle."""
    import signal

    proc, url = stalled_redis
    server = serve("--remote-cache-url", url, "--remote-timeout-s", "120")
    before = aborted(server.url)
    proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{server.url}/v1/completions", json={**LONG, "max_tokens": 8}, timeout=httpx.Timeout(30, read=0.5)
            )
        wait_for(lambda: aborted(server.url) == before + 1, what="the abort of the timed-out request")
    finally:
        proc.send_signal(signal.SIGCONT)
    wait_until_idle_clean(server)
    # the engine still serves once Redis answers again
    r = httpx.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    wait_until_idle_clean(server)


@pytest.mark.engine_modes("process")  # a load test, 14 s a mode: the default mode only (conftest.py)
def test_concurrent_streaming_clients(serve):
    """16 streaming clients for ~10 s against a device pool that cannot hold them all, over a
    small host tier (evicted prefixes come back from it while others are aborted)."""
    server = serve("--num-device-blocks", "64", "--max-num-seqs", "16", "--host-cache-bytes", "2MiB")
    prefixes = [f"shared system prompt {i}: be brief and exact. " for i in range(3)]
    stats = {"requests": 0, "errors": [], "tokens": 0, "hung_up": 0}
    deadline = time.monotonic() + 10.0

    async def one_client(seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            while time.monotonic() < deadline:
                body = {
                    "model": MODEL_NAME,
                    "prompt": rng.choice(prefixes) + f"question {rng.randrange(1000)}",
                    "max_tokens": rng.randrange(4, 24),
                    "temperature": rng.choice([0.0, 0.8]),
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                hang_up_after = rng.randrange(1, 4) if rng.random() < 0.15 else None
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            stats["errors"].append(f"{r.status_code}: {await r.aread()!r}")
                            continue
                        n_chunks, done = 0, False
                        async for chunk in aiter_events(r):
                            if chunk is None:
                                done = True
                                break
                            if "error" in chunk:
                                stats["errors"].append(chunk["error"]["message"])
                            elif chunk.get("usage"):
                                stats["tokens"] += chunk["usage"]["completion_tokens"]
                            n_chunks += 1
                            if hang_up_after is not None and n_chunks >= hang_up_after:
                                stats["hung_up"] += 1
                                break
                        if hang_up_after is None and not done:
                            stats["errors"].append("stream ended without [DONE]")
                        stats["requests"] += 1
                except httpx.HTTPError as e:
                    stats["errors"].append(repr(e))

    async def main() -> None:
        await asyncio.gather(*(one_client(i) for i in range(16)))

    asyncio.run(main())
    assert stats["errors"] == []
    assert stats["requests"] >= 16 and stats["tokens"] > 0
    server.check_idle_clean()
    metrics = scrape(server.url)
    assert metrics[("kvtier:kv_cache_usage_perc", ())] == 0.0
    assert metrics[("kvtier:prefix_cache_hits_total", (("tier", "device"),))] > 0
    assert "Traceback" not in server.log(), server.log()
