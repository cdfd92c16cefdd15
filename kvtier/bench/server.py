"""A `kvtier serve` the harness starts itself, so the in-process engine is measured over the
same HTTP path as any --url server.

It runs as a child process on a free loopback port (not a thread of the harness): the client's
event loop and the engine thread then do not share one interpreter lock, so client-side times
are not inflated by the engine's Python work.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVED_MODEL_NAME = "kvtier-bench"


def stop_process(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Terminate a server process, killing it if it does not exit within `timeout_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis_server(
    data_dir: str | Path, port: int | None = None, ready_timeout_s: float = 30.0, extra_args: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, int]:
    """A real redis-server (Debian's, on PATH) on a loopback port, without persistence; returns
    once it answers PING. The caller stops it (it may also SIGSTOP / kill it on purpose)."""
    import shutil

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
    port = port or free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data_dir),
            *extra_args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + ready_timeout_s
    while True:
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on port {port}") from None
            time.sleep(0.02)
        finally:
            client.close()


def _free_port_with_bus() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) for a Redis Cluster node")


def start_redis_cluster(
    data_dir: str | Path, primaries: int = 3, replicas: int = 1, ready_timeout_s: float = 60.0
) -> tuple[list[subprocess.Popen], str]:
    """A real Redis Cluster on loopback (Debian's redis-server and redis-cli): `primaries`
    primaries with `replicas` replicas each, without persistence; returns the processes and a
    `redis+cluster://` URL of one node once the cluster says ok and every replica has synced.
    The caller stops the processes (stop_process each)."""
    import shutil

    import redis

    cli = shutil.which("redis-cli")
    if cli is None:
        raise FileNotFoundError("redis-cli is not installed (it comes with Debian's redis-server package)")
    procs: list[subprocess.Popen] = []
    ports: list[int] = []
    try:
        for _ in range(primaries * (1 + replicas)):
            port = _free_port_with_bus()
            node_dir = Path(data_dir) / f"node-{port}"
            node_dir.mkdir(parents=True, exist_ok=True)
            proc, _ = start_redis_server(
                node_dir,
                port,
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ),
            )
            procs.append(proc)
            ports.append(port)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in ports],
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + ready_timeout_s
        clients = [redis.Redis(port=p, socket_timeout=5) for p in ports]
        try:
            while True:
                ok = all(c.cluster("info")["cluster_state"] == "ok" for c in clients)
                roles = [c.info("replication") for c in clients]
                synced = all(r.get("master_link_status") == "up" for r in roles if r["role"] == "slave")
                if ok and synced and sum(r["role"] == "slave" for r in roles) == primaries * replicas:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Redis Cluster on ports {ports} did not become ready")
                time.sleep(0.1)
        finally:
            for c in clients:
                c.close()
    except BaseException:
        for proc in procs:
            stop_process(proc)
        raise
    return procs, f"redis+cluster://127.0.0.1:{ports[0]}"


def serve_flags(engine_kwargs: dict[str, Any]) -> list[str]:
    """`kvtier serve` flags for LLM keyword arguments as `kvtier.cli.main.engine_kwargs` builds
    them (the engine and tier flag group)."""
    flags: list[str] = []
    for key, value in engine_kwargs.items():
        if value is None:
            continue
        if key == "enable_prefix_caching":
            if value is False:
                flags.append("--no-prefix-caching")
        elif key == "tier_faults":
            for tier, spec in value.items():
                flags += ["--tier-faults", f"{tier}={spec}"]
        else:
            flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


@dataclass
class ManagedServer:
    url: str
    proc: subprocess.Popen
    log_path: Path
    flags: list[str]

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self.proc)

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(model: str, flags: list[str], log_path: Path, ready_timeout_s: float = 600.0) -> ManagedServer:
    """Start `kvtier serve --model MODEL FLAGS` on a free loopback port; returns once /health
    answers 200 (raises RuntimeError with the log's tail if it exits or never does)."""
    import httpx

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvtier",
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--log-level",
        "warning",
        *flags,
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env())
    server = ManagedServer(f"http://127.0.0.1:{port}", proc, log_path, flags)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"kvtier serve exited with {proc.returncode}; its log ({log_path}):\n{server.log_tail()}"
            )
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(
        f"kvtier serve did not answer /health within {ready_timeout_s:.0f} s; "
        f"its log ({log_path}):\n{server.log_tail()}"
    )


def _child_env() -> dict[str, str]:
    """This environment, with the directory holding this kvtier package first on PYTHONPATH
    (so the child runs the same kvtier, installed or not)."""
    import kvtier

    root = str(Path(kvtier.__file__).resolve().parents[1])
    paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def write_api_keys(path: Path, keys: dict[str, str]) -> Path:
    """An `--api-keys` file mapping each key to its tenant (owner-only permissions)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"keys": keys}, f)
    return path
