"""A tiny float32 model (byte-level tokenizer, so text prompts work too) and a `kvtier serve`
started apart from the harness, for the --url tests.

`bench(*flags)` runs `kvtier bench` in this process (it starts its own server for --model) and
returns (exit code, result JSON, output directory).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

VOCAB = 262  # the byte-level tokenizer's
SERVE_FLAGS = ("--dtype", "float32", "--block-size", "4", "--num-device-blocks", "256")


@pytest.fixture(scope="session")
def bench_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.model.builder import build_random_llama
    from kvtier.model.tokenizer import build_byte_tokenizer

    d = tmp_path_factory.mktemp("bench_model")
    vocab = build_byte_tokenizer(d)
    assert vocab == VOCAB
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
        bos_token_id=256,
        eos_token_id=257,
    )
    return d


@pytest.fixture(scope="module")
def url_server(bench_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A kvtier serve with a host tier, started by the test (not by the harness)."""
    from kvtier.bench.server import start

    log = tmp_path_factory.mktemp("bench_serve") / "serve.log"
    server = start(str(bench_model_dir), [*SERVE_FLAGS, "--host-cache-bytes", "64MiB"], log, ready_timeout_s=120)
    yield server
    server.stop()
    assert "Traceback" not in server.log_tail(100_000)


@pytest.fixture
def bench(tmp_path: Path):
    from kvtier.cli.main import main

    def _bench(*flags: str) -> tuple[int, dict | None, Path]:
        out = tmp_path / "out"
        rc = main(["bench", "--out", str(out), "--no-progress", "--vocab-size", str(VOCAB), *flags])
        files = sorted(out.glob("*.json"))
        return rc, (json.loads(files[0].read_text()) if files else None), out

    return _bench
