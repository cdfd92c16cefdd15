"""Helpers of the server tests: start and stop a real `kvtier serve` subprocess, read /metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
BLOCK_SIZE = 4
NUM_DEVICE_BLOCKS = 128
MAX_MODEL_LEN = 256
# The two engine clients of `kvtier serve`: the engine core in its own process (the default) and
# in a thread of the server (--engine-in-process). conftest.py's `engine_mode` fixture runs the
# server tests against both.
ENGINE_MODES = ("process", "in-process")
IN_PROCESS_FLAG = "--engine-in-process"


def engine_mode_flags(engine_mode: str, flags: tuple[str, ...]) -> tuple[str, ...]:
    """`flags` for a server in `engine_mode`: --engine-in-process added once for "in-process"
    (never doubled when the caller passed it already)."""
    if engine_mode not in ENGINE_MODES:
        raise ValueError(f"engine_mode must be one of {ENGINE_MODES}, not {engine_mode!r}")
    if engine_mode == "in-process" and IN_PROCESS_FLAG not in flags:
        return (*flags, IN_PROCESS_FLAG)
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    engine_mode: str = "process"  # "in-process" when started with --engine-in-process

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_idle_clean(self, timeout_s: float = 30.0) -> dict:
        """POST /admin/check_integrity: the engine's invariants hold and no block is in use."""
        r = httpx.post(f"{self.url}/admin/check_integrity", timeout=timeout_s)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["ok"] is True
        assert body["num_unfinished"] == 0
        assert body["kv_cache_usage_perc"] == 0.0 and body["num_free_blocks"] == body["num_blocks"]
        return body

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="test-key", max_retries=0, timeout=kwargs.pop("timeout", 60.0), **kwargs
        )


def start_server(
    model_dir: Path,
    log_dir: Path,
    *flags: str,
    engine_mode: str = "process",
    ready_timeout_s: float = 120.0,
    verify: Any = True,
) -> Server:
    """`kvtier serve` over `model_dir` with `flags`, its engine in `engine_mode` (see
    ENGINE_MODES; --engine-in-process among `flags` also means "in-process"), once healthy.
    With --ssl-certfile among `flags` the server speaks HTTPS (`url` is https://..., its health
    checked with `verify`: an ssl.SSLContext that trusts its certificate)."""
    flags = engine_mode_flags(engine_mode, flags)
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    launcher = ["-m", "kvtier"]
    cmd = [
        sys.executable,
        *launcher,
        "serve",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK_SIZE),
        "--log-level",
        "warning",
        *flags,
    ]
    if not any(f in flags for f in ("--num-device-blocks", "--kv-cache-bytes")):
        cmd += ["--num-device-blocks", str(NUM_DEVICE_BLOCKS)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    mode = "in-process" if IN_PROCESS_FLAG in flags else "process"
    scheme = "https" if "--ssl-certfile" in flags else "http"
    server = Server(f"{scheme}://127.0.0.1:{port}", proc, log_path, mode)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvtier serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0, verify=verify).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"kvtier serve did not become healthy in {ready_timeout_s} s:\n{server.log()}")


def stop_server(server: Server) -> None:
    from kvtier.bench.server import stop_process

    stop_process(server.proc, timeout_s=15)


def scrape(url: str, model_name: bool = False) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}. Every series carries the served
    model's `model_name` label (as vLLM's do); it is left out of the keys unless `model_name`."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = dict(s.labels)
            if not model_name:
                labels.pop("model_name", None)
            key = (s.name, tuple(sorted(labels.items())))
            out[key] = out.get(key, 0.0) + s.value
    return out


def start_redis(data_dir: Path) -> tuple[subprocess.Popen, str]:
    """A real redis-server of the caller's own (it may stop or kill it): (process, URL). Skips
    the test when Debian's redis-server is absent."""
    import shutil

    import pytest

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (CI installs Debian's redis-server)")
    from kvtier.bench.server import start_redis_server

    proc, port = start_redis_server(data_dir)
    return proc, f"redis://127.0.0.1:{port}/0"


def stop_redis(proc: subprocess.Popen) -> None:
    """Stop a redis-server from start_redis, also one that a test left paused (SIGSTOP)."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(10)
