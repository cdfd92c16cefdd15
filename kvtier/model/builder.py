"""Write random-weight Llama checkpoints in Hugging Face format, with torch + safetensors only.

Used by the demo and the benchmarks (no transformers, no network). Initialisation follows HF:
normal(0, 0.02) for linear and embedding weights, ones for RMSNorm weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

REFERENCE_MODEL: dict = dict(
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    num_kv_heads=4,
    intermediate_size=2048,
    vocab_size=32000,
    max_position_embeddings=8192,
    dtype="bfloat16",
)
"""The project's benchmark reference model: a ~110M-parameter Llama with GQA (3 queries per KV head)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INIT_STD = 0.02


def build_random_llama(
    out_dir: str | Path,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    max_position_embeddings: int = 8192,
    dtype: str = "bfloat16",
    seed: int = 0,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> Path:
    """Write config.json, generation_config.json and model.safetensors to `out_dir`; returns it."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    head_dim = hidden_size // num_heads
    gen = torch.Generator().manual_seed(seed)
    torch_dtype = _DTYPES[dtype]

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * _INIT_STD).to(torch_dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch_dtype)

    tensors = {"model.embed_tokens.weight": normal(vocab_size, hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(num_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": normal(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.v_proj.weight": normal(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.o_proj.weight": normal(hidden_size, num_heads * head_dim),
            p + "mlp.gate_proj.weight": normal(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": normal(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": normal(hidden_size, intermediate_size),
            p + "input_layernorm.weight": ones(hidden_size),
            p + "post_attention_layernorm.weight": ones(hidden_size),
        }
    tensors["model.norm.weight"] = ones(hidden_size)
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = normal(vocab_size, hidden_size)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        # the pre-transformers-5 rope keys: read by every transformers version and by kvtier
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "initializer_range": _INIT_STD,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir
