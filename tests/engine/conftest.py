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
    build_random_llama(d, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=128, vocab_size=vocab, max_position_embeddings=256,
                       dtype="float32", bos_token_id=256, eos_token_id=257)
    return d
