"""Real redis-server processes for the remote tier tests, and small helpers.

`redis_server` starts a fresh server per test (about 20 ms) on a free loopback port, with no
persistence, so a kill really loses the data; `redis_cluster` starts a Redis Cluster of 3
primaries with one replica each once per session. `tls_files` makes a CA and a server
certificate with the openssl CLI (SAN 127.0.0.1 and localhost) for servers started with
`tls=`. All skip, with the reason, when redis-server (or openssl) is not installed (CI installs
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class TlsFiles:
    """A CA, a server certificate it signed (SAN 127.0.0.1, localhost), and a second CA that
    signed nothing here (a client trusting it must refuse the server)."""

    ca: Path
    cert: Path
    key: Path
    wrong_ca: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_tls_files(root: Path) -> TlsFiles:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed (apt-get install openssl)")
    root.mkdir(parents=True, exist_ok=True)
    for name in ("ca", "wrong-ca"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN=kvtier test {name}",
            "-keyout",
            str(root / f"{name}.key"),
            "-out",
            str(root / f"{name}.crt"),
        )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        str(root / "server.key"),
        "-out",
        str(root / "server.csr"),
    )
    (root / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(root / "server.csr"),
        "-CA",
        str(root / "ca.crt"),
        "-CAkey",
        str(root / "ca.key"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        str(root / "san.ext"),
        "-out",
        str(root / "server.crt"),
    )
    return TlsFiles(root / "ca.crt", root / "server.crt", root / "server.key", root / "wrong-ca.crt")


class RedisProcess:
    """One redis-server on 127.0.0.1:port, which a test can kill, restart, pause and resume.
    With `tls`, the port speaks TLS only (and so does the cluster bus)."""

    def __init__(
        self, binary: str, workdir: Path, port: int, extra_args: tuple[str, ...] = (), tls: TlsFiles | None = None
    ) -> None:
        self.binary, self.workdir, self.port, self.extra_args = binary, workdir, port, extra_args
        self.tls = tls
        self.proc: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca}"
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        if self.tls is not None:
            return redis.Redis(
                host="127.0.0.1", port=self.port, socket_timeout=2, ssl=True, ssl_ca_certs=str(self.tls.ca)
            )
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def _port_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        return [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(self.tls.cert),
            "--tls-key-file",
            str(self.tls.key),
            "--tls-ca-cert-file",
            str(self.tls.ca),
            "--tls-auth-clients",
            "no",
            "--tls-replication",
            "yes",
            "--tls-cluster",
            "yes",
        ]

    def start(self, timeout_s: float = 10.0) -> None:
        log = open(self.workdir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [
                self.binary,
                *self._port_args(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--protected-mode",
                "no",
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
        )
        log.close()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.workdir / 'redis.log'}")
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


def start_cluster(
    binary: str, root: Path, num_nodes: int = 3, replicas: int = 0, tls: TlsFiles | None = None
) -> list[RedisProcess]:
    """Start `num_nodes` cluster-enabled primaries and `replicas` replicas of each, joined into
    one cluster; returns the primaries first, then the replicas (each one's role is checked).
    Waits until every replica has synced. The caller stops them; on failure this stops the
    ones it started."""
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli is not installed (it comes with the redis-server package)")
    nodes: list[RedisProcess] = []
    try:
        for i in range(num_nodes * (1 + replicas)):
            port = free_port(with_bus=True)
            node = RedisProcess(
                binary,
                root / f"node{i}",
                port,
                (
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-node-timeout",
                    "1000",
                ),
                tls=tls,
            )
            node.start()
            nodes.append(node)
        tls_args = [] if tls is None else ["--tls", "--cacert", str(tls.ca)]
        subprocess.run(
            [
                cli,
                *tls_args,
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in nodes],
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        wait_cluster_ok(nodes)
        if replicas:
            wait_replicas_synced(nodes)
            nodes.sort(key=lambda n: role(n) != "master")
            assert [role(n) for n in nodes].count("master") == num_nodes
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


def role(node: RedisProcess) -> str | None:
    """ "master" / "slave" as the node says (ROLE), None when it does not answer."""
    import redis

    try:
        out = node.client().execute_command("ROLE")
    except redis.RedisError:
        return None
    first = out[0]
    return first.decode() if isinstance(first, bytes) else str(first)


def wait_replicas_synced(nodes: list[RedisProcess], timeout_s: float = 20.0) -> None:
    """Bounded poll until every replica's link to its primary is up (INFO replication)."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = [n.client().info("replication") for n in nodes]
        if all(i.get("role") == "master" or i.get("master_link_status") == "up" for i in infos):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas did not sync: {infos}")
        time.sleep(0.05)


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    """Bounded poll for a server-side condition (never an assertion about elapsed time)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def wait_cluster_ok(nodes: list[RedisProcess], timeout_s: float = 20.0) -> None:
    wait_until(
        lambda: all(_cluster_ok(n) for n in nodes), "the test Redis Cluster to reach cluster_state:ok", timeout_s
    )


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def redis_cluster(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisProcess]]:
    """A Redis Cluster of 3 primaries (listed first) and one replica each, shared by the
    session's tests: do not kill it."""
    nodes = start_cluster(redis_binary, tmp_path_factory.mktemp("redis_cluster"), replicas=1)
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture
def cluster_url(redis_cluster: list[RedisProcess]) -> str:
    return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in redis_cluster[:3])


def env_with_repo_on_path() -> dict[str, str]:
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    return env
