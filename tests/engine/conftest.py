from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.model.builder import build_random_llama
from kvtier.model.tokenizer import build_byte_tokenizer


@pytest.fixture(scope="session")
def byte_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 Llama with the demo's byte-level tokenizer and chat template."""
    d = tmp_path_factory.mktemp("byte_model")
    vocab = build_byte_tokenizer(d)
    build_random_llama(
        d,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=256,
        dtype="float32",
        bos_token_id=256,
        eos_token_id=257,
    )
    return d


@pytest.fixture(scope="module")
def llm(byte_model_dir: Path):
    """The offline engine over the byte model, shared by a file's tests (each ends clean)."""
    from kvtier import LLM

    with LLM(str(byte_model_dir), dtype="float32", num_device_blocks=96, block_size=4) as llm:
        yield llm
