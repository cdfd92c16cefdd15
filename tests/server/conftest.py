"""A real `kvtier serve` subprocess on a free loopback port, driven over HTTP.

`serve(*flags)` starts one (tiny float32 byte-level model, small pool) and waits for /health;
the module-scoped `server` fixture is shared by the tests of a file. Helpers: serverutil.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from serverutil import MAX_MODEL_LEN, Server, start_redis, start_server, stop_redis, stop_server


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 Llama with the byte-level tokenizer and chat template."""
    from kvtier.model.builder import build_random_llama
    from kvtier.model.tokenizer import build_byte_tokenizer

    d = tmp_path_factory.mktemp("server_model")
    vocab = build_byte_tokenizer(d)
    build_random_llama(
        d,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=MAX_MODEL_LEN,
        dtype="float32",
        bos_token_id=256,
        eos_token_id=257,
    )
    return d


@pytest.fixture(scope="module")
def serve(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """serve(*flags) -> Server; every server started is stopped at the end of the module."""
    started: list[Server] = []
    log_dir = tmp_path_factory.mktemp("serve_logs")

    def _serve(*flags: str) -> Server:
        server = start_server(server_model_dir, log_dir, *flags)
        started.append(server)
        return server

    yield _serve
    for server in started:
        stop_server(server)


@pytest.fixture(scope="module")
def server(serve) -> Iterator[Server]:
    s = serve("--max-body-bytes", "64KiB")
    yield s
    assert "Traceback" not in s.log(), s.log()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A real redis-server on a free loopback port (skips if Debian's redis-server is absent)."""
    pytest.importorskip("redis")
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    stop_redis(proc)


@pytest.fixture(scope="module")
def llm(server_model_dir: Path):
    """The offline engine over the servers' checkpoint and pool: what a server must match."""
    from serverutil import BLOCK_SIZE, NUM_DEVICE_BLOCKS

    from kvtier import LLM

    with LLM(str(server_model_dir), dtype="float32", num_device_blocks=NUM_DEVICE_BLOCKS, block_size=BLOCK_SIZE) as llm:
        yield llm
