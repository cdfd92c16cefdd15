"""TLS against real redis-server processes listening on --tls-port, with a CA and a server
certificate the openssl CLI made for the session (conftest.tls_files): a server and a 3-primary
cluster, each with the right CA (works) and a CA that did not sign the server (a miss, and a
WARNING that names the certificate problem)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.tiers.base import HealthGate
from kvtier.tiers.remote import RemoteTier

from .conftest import FINGERPRINT, ManualClock, RedisProcess, TlsFiles, free_port, make_keys, start_cluster


@pytest.fixture(autouse=True)
def no_ambient_ca(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the URL may tell the client which CA to trust."""
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)


@pytest.fixture
def tls_server(redis_binary: str, tmp_path: Path, tls_files: TlsFiles) -> Iterator[RedisProcess]:
    server = RedisProcess(redis_binary, tmp_path / "tls", free_port(), tls=tls_files)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tls_cluster(
    redis_binary: str, tmp_path_factory: pytest.TempPathFactory, tls_files: TlsFiles
) -> Iterator[list[RedisProcess]]:
    nodes = start_cluster(redis_binary, tmp_path_factory.mktemp("tls_cluster"), tls=tls_files)
    yield nodes
    for node in nodes:
        node.stop()


def _round_trip(url: str, caplog: pytest.LogCaptureFixture) -> RemoteTier:
    tier = RemoteTier(url, fingerprint=FINGERPRINT, timeout_s=2, health=HealthGate(clock=ManualClock()))
    keys = make_keys(8, salt=hash(url) % 1000)
    assert all(tier.put(key, b"frame-" + key) for key in keys), tier.stats
    assert tier.get_many(keys) == [b"frame-" + key for key in keys]
    assert tier.contains_prefix(keys) == len(keys)
    assert tier.healthy and tier.stats.errors == {} and caplog.records == []
    return tier


def _refused(url: str, caplog: pytest.LogCaptureFixture) -> None:
    tier = RemoteTier(url, fingerprint=FINGERPRINT, timeout_s=2, health=HealthGate(clock=ManualClock()))
    (key,) = make_keys(1)
    assert tier.get(key) is None and not tier.put(key, b"x")  # a miss, then gated
    assert not tier.healthy and tier.stats.errors == {"tls": 1}, tier.stats
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(messages) == 1, messages
    assert messages[0].startswith("tier remote unavailable: tls: ")
    assert "certificate verify failed" in messages[0], messages[0]


def test_tls_server_with_the_urls_ca(
    tls_server: RedisProcess, tls_files: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    url = f"rediss://127.0.0.1:{tls_server.port}/0?ssl_ca_certs={tls_files.ca}&ssl_cert_reqs=required"
    _round_trip(url, caplog)


def test_tls_server_with_a_wrong_ca_is_refused_and_warned(
    tls_server: RedisProcess, tls_files: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    _refused(f"rediss://127.0.0.1:{tls_server.port}/0?ssl_ca_certs={tls_files.wrong_ca}", caplog)


def _cluster_url(nodes: list[RedisProcess], ca: Path, extra: str = "") -> str:
    return "rediss+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes) + f"?ssl_ca_certs={ca}{extra}"


def test_tls_cluster_with_the_urls_ca(
    tls_cluster: list[RedisProcess], tls_files: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    tier = _round_trip(_cluster_url(tls_cluster, tls_files.ca, "&ssl_cert_reqs=required"), caplog)
    assert tier.cluster
    assert sum(n.client().dbsize() for n in tls_cluster) >= 8  # really stored over TLS


def test_tls_cluster_with_a_wrong_ca_is_refused_and_warned(
    tls_cluster: list[RedisProcess], tls_files: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    _refused(_cluster_url(tls_cluster, tls_files.wrong_ca), caplog)


def test_tls_cluster_without_verification_when_asked(
    tls_cluster: list[RedisProcess], caplog: pytest.LogCaptureFixture
) -> None:
    """ssl_cert_reqs=none reaches the cluster client too (a self-signed test deployment)."""
    caplog.set_level(logging.WARNING)
    url = (
        "rediss+cluster://"
        + ",".join(f"127.0.0.1:{n.port}" for n in tls_cluster)
        + "?ssl_cert_reqs=none&ssl_check_hostname=false"
    )
    _round_trip(url, caplog)
