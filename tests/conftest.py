"""Shared fixtures.

Model fixtures: tiny random-weight checkpoints written by transformers itself (float32), one per
supported family plus variants, built once per session. `hf_reference(dir)` loads the matching
transformers model, the reference the parity tests compare against.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

# -- tiny model checkpoints -----------------------------------------------------------------------

TINY_DIMS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=512,
    # larger than HF's 0.02, so attention is peaked and a wrong mask or rope shows in the logits
    initializer_range=0.1,
)

# family -> (transformers config class name, extra config kwargs, save_pretrained kwargs)
TINY_FAMILIES: dict[str, tuple[str, dict, dict]] = {
    "llama": ("LlamaConfig", {}, {}),
    "llama3_rope": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # small, so that the scaling changes frequencies the tests' short prompts use
                "original_max_position_embeddings": 64,
            },
        },
        {},
    ),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}, {}),
    "mistral": ("MistralConfig", {"sliding_window": None}, {}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}, {"max_shard_size": "100KB"}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}, {}),
}


def _build_tiny(family: str, out_dir: Path) -> Path:
    import torch
    import transformers

    config_cls, extra, save_kwargs = TINY_FAMILIES[family]
    config = getattr(transformers, config_cls)(**TINY_DIMS, bos_token_id=1, eos_token_id=2, **extra)
    model_cls = getattr(transformers, config_cls.removesuffix("Config") + "ForCausalLM")
    torch.manual_seed(sorted(TINY_FAMILIES).index(family))
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():  # HF initialises norms to ones and biases to zeros; make them matter
        for layer in model.model.layers:
            attn = layer.self_attn
            if family == "qwen3":
                attn.q_norm.weight.uniform_(0.5, 1.5)
                attn.k_norm.weight.uniform_(0.5, 1.5)
            if family == "qwen2":
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0.0, 0.1)
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir, **save_kwargs)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> directory of a tiny float32 checkpoint (see TINY_FAMILIES)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tiny_models")
    return {family: _build_tiny(family, root / family) for family in TINY_FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@functools.cache
def hf_reference(model_dir: str | Path):
    """The float32 transformers model for a checkpoint directory, in eval mode (cached)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def reference_model():
    """`hf_reference` as a fixture: reference_model(model_dir) -> transformers model."""
    pytest.importorskip("transformers")
    return hf_reference
