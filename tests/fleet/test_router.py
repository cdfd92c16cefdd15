"""A fleet behind a real KV-aware router: two `kvtier serve` instances publishing KV events, and
vllm-router's `kv_aware` policy reading them (`pip install vllm-router`). Revisits of a prefix go
to the instance that holds it, so they hit; round robin would send every other one to the
instance that does not. The heavy multi-process group of the suite (marked `fleet`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvtier.bench.server import SERVED_MODEL_NAME, free_port, start, stop_process

pytestmark = [
    pytest.mark.fleet,
    pytest.mark.skipif(
        shutil.which("vllm-router") is None, reason="vllm-router is not installed (pip install vllm-router)"
    ),
]

BS = 8


@pytest.fixture(scope="module")
def word_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose tokenizer maps id i <-> the word w{i}: text round-trips to the
    same ids, so the router (which tokenizes through the instance's /tokenize) and the engine
    see the same tokens."""
    from kvtier.model.builder import build_random_llama
    from kvtier.model.tokenizer import build_word_tokenizer

    d = tmp_path_factory.mktemp("word_model")
    vocab = 512
    build_random_llama(
        d,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=1024,
        dtype="float32",
    )
    build_word_tokenizer(d, vocab, 1024)
    return d


def _wait(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer")


def _cached(router: str, prompt: str) -> int:
    r = httpx.post(
        router + "/v1/completions",
        json={"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_kv_aware_router_sends_revisits_where_the_prefix_is(word_model: Path, tmp_path: Path) -> None:
    servers, events = [], []
    procs: list[subprocess.Popen] = []
    try:
        for i in range(2):
            ev, replay = free_port(), free_port()
            config = {
                "enable_kv_cache_events": True,
                "endpoint": f"tcp://*:{ev}",
                "replay_endpoint": f"tcp://*:{replay}",
            }
            flags = ["--block-size", str(BS), "--num-device-blocks", "256", "--kv-events-config", json.dumps(config)]
            servers.append(start(str(word_model), flags, tmp_path / f"instance{i}.log"))
            events.append((ev, replay))
        port = free_port()
        cmd = ["vllm-router", "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware"]
        cmd += ["--worker-urls", *[s.url for s in servers], "--worker-startup-check-interval", "1"]
        cmd += ["--prometheus-port", str(free_port())]
        for s, (ev, replay) in zip(servers, events):
            cmd += ["--kv-event-source", f"{s.url}=tcp://127.0.0.1:{ev}"]
            cmd += ["--kv-event-replay-source", f"{s.url}=tcp://127.0.0.1:{replay}"]
        cmd += ["--kv-event-block-size", str(BS), "--kv-event-model", SERVED_MODEL_NAME]
        log = tmp_path / "router.log"
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
        router = f"http://127.0.0.1:{port}"
        _wait(router + "/health", procs[0], log)
        for p in range(3):  # three conversations, each revisited four times
            base = " ".join(f"w{3 + (p * 97 + j * 13) % 500}" for j in range(64))
            assert _cached(router, base) == 0
            time.sleep(0.5)  # the instance's events reach the router
            for turn in range(4):
                assert _cached(router, base + f" w{10 + turn} w{20 + turn}") >= 64 - BS, (p, turn)
    finally:
        for proc in procs:
            stop_process(proc)
        for s in servers:
            s.stop()
