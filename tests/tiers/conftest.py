"""Real redis-server processes for the remote tier tests, and small helpers.

`redis_server` starts a fresh server per test (about 20 ms) on a free loopback port, with no
persistence, so a kill really loses the data; `redis_cluster` starts a 3-primary Redis Cluster
once per session. Both skip, with the reason, when redis-server is not installed (CI installs
Debian's package).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

FINGERPRINT = bytes(range(16))
OTHER_FINGERPRINT = bytes(range(1, 17))


def make_keys(n: int, salt: int = 0) -> list[bytes]:
    """n chained 16-byte keys, as the engine would compute them."""
    from kvtier.kvcache.keys import hash_id_key, root_key

    parent, out = root_key(FINGERPRINT, f"test-{salt}"), []
    for i in range(n):
        parent = hash_id_key(parent, i)
        out.append(parent)
    return out


class ManualClock:
    """An injectable clock for health-gate backoffs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# -- redis-server processes ------------------------------------------------------------------------

def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(with_bus: bool = False) -> int:
    """A free loopback port; with_bus: port + 10000 (the cluster bus) is free too."""
    if not with_bus:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(1000):
        port = random.randint(20000, 55000)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisProcess:
    """One redis-server on 127.0.0.1:port, which a test can kill, restart, pause and resume."""

    def __init__(self, binary: str, workdir: Path, port: int, extra_args: tuple[str, ...] = ()) -> None:
        self.binary, self.workdir, self.port, self.extra_args = binary, workdir, port, extra_args
        self.proc: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def start(self, timeout_s: float = 10.0) -> None:
        log = open(self.workdir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no",
             *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        log.close()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see "
                                   f"{self.workdir / 'redis.log'}")
            try:
                if self.client().ping():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, its data with it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused process must not stay stopped
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel but never answered (timeouts)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does it)")
    return binary


@pytest.fixture
def redis_server(redis_binary: str, tmp_path: Path) -> Iterator[RedisProcess]:
    """A fresh redis-server for one test."""
    server = RedisProcess(redis_binary, tmp_path / "redis", free_port())
    server.start()
    yield server
    server.stop()


def _cluster_ok(node: RedisProcess) -> bool:
    import redis

    try:
        info = node.client().execute_command("CLUSTER", "INFO")  # redis-py parses it into a dict
    except redis.RedisError:
        return False
    state = info.get("cluster_state") if isinstance(info, dict) else info
    return state in ("ok", b"ok") or b"cluster_state:ok" in (state if isinstance(state, bytes) else b"")


def start_cluster(binary: str, root: Path, num_nodes: int = 3) -> list[RedisProcess]:
    """Start `num_nodes` cluster-enabled servers and join them as primaries (no replicas).
    The caller stops them; on failure this stops the ones it started."""
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli is not installed (it comes with the redis-server package)")
    nodes: list[RedisProcess] = []
    try:
        for i in range(num_nodes):
            port = free_port(with_bus=True)
            node = RedisProcess(binary, root / f"node{i}", port,
                                ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                                 "--cluster-node-timeout", "1000"))
            node.start()
            nodes.append(node)
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=30)
        wait_cluster_ok(nodes)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


def wait_cluster_ok(nodes: list[RedisProcess], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(_cluster_ok(n) for n in nodes):
        if time.monotonic() > deadline:
            raise RuntimeError("the test Redis Cluster did not reach cluster_state:ok")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def redis_cluster(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisProcess]]:
    """A 3-primary Redis Cluster (no replicas), shared by the session's tests: do not kill it."""
    nodes = start_cluster(redis_binary, tmp_path_factory.mktemp("redis_cluster"))
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture
def cluster_url(redis_cluster: list[RedisProcess]) -> str:
    return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in redis_cluster)


def env_with_repo_on_path() -> dict[str, str]:
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    return env
