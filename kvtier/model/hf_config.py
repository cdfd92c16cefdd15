"""Architecture description parsed from a Hugging Face model directory's `config.json`.

The file format is chosen above this module (kvtier.model.loader.arch_config: a GGUF file's
metadata through kvtier.model.gguf, else config.json here); it imports no other kvtier module.

`ArchConfig.from_dir(path)` reads `config.json` (and `generation_config.json` for extra EOS ids)
without importing transformers, and turns everything the decoder needs into one frozen dataclass.
Both config dialects are accepted:

    transformers >= 5:  "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8, ...}
    older:              "rope_theta": 5e5, "rope_scaling": {"type" | "rope_type": "llama3", ...}

Not modelled: sliding-window attention (Mistral v0.1, Qwen2 `use_sliding_window`). kvtier always
attends over the full context; `sliding_window` is recorded so callers can warn, and outputs match
the reference only while a context stays within the window.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
_DTYPE_NAMES = {"float32", "float16", "bfloat16"}


class ModelLoadError(ValueError):
    """A model directory kvtier cannot load; the message says what to do about it."""


class ModelFilesNotFoundError(ModelLoadError, FileNotFoundError):
    """The directory, its config.json or its *.safetensors files are missing."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling. `default` rope is `ArchConfig.rope_scaling is None`."""

    rope_type: str
    """"linear" or "llama3"."""
    factor: float
    low_freq_factor: float | None = None
    """llama3 only."""
    high_freq_factor: float | None = None
    """llama3 only."""
    original_max_position_embeddings: int | None = None
    """llama3 only: the pretraining context length."""


@dataclass(frozen=True, slots=True)
class ArchConfig:
    """Everything the decoder needs to know about a checkpoint's architecture."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """Bias on q/k/v projections (Qwen2 always; Llama/Qwen3 with `attention_bias`)."""
    o_bias: bool
    """Bias on the output projection (Llama/Qwen3 with `attention_bias`)."""
    mlp_bias: bool
    qk_norm: bool
    """Per-head RMSNorm of q and k before rope (Qwen3)."""
    sliding_window: int | None
    """Recorded only: kvtier attends over the full context (see module docstring)."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    """config.json's eos ids followed by any extra ones from generation_config.json."""
    dtype: str | None
    """The checkpoint's dtype ("bfloat16", ...), from `dtype` or `torch_dtype`; None if absent."""

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ArchConfig:
        """From a Hugging Face directory's config.json (and generation_config.json). A path
        that may also be a GGUF file: kvtier.model.loader.arch_config, which dispatches."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelFilesNotFoundError(
                f"model directory {str(model_dir)!r} does not exist; pass the path of a local "
                f"Hugging Face checkpoint (a folder with config.json and *.safetensors) or of a .gguf file"
            )
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ModelFilesNotFoundError(
                f"{str(model_dir)!r} has no config.json; it does not look like a Hugging Face "
                f"checkpoint (download the full model repository, not just the weights)"
            )
        try:
            config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{str(config_path)!r} is not valid JSON ({exc}); re-download it") from exc
        generation = _read_optional_json(model_dir / "generation_config.json")
        return cls.from_dict(config, generation_config=generation, source=str(config_path))

    @classmethod
    def from_dict(
        cls,
        config: dict[str, Any],
        *,
        generation_config: dict[str, Any] | None = None,
        source: str = "config.json",
    ) -> ArchConfig:
        architecture = _architecture(config, source)
        hidden_act = config.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ModelLoadError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu')")
        hidden_size = _require_int(config, "hidden_size", source)
        num_heads = _require_int(config, "num_attention_heads", source)
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        head_dim = config.get("head_dim") or hidden_size // num_heads
        max_positions = int(config.get("max_position_embeddings", 2048))
        rope_theta, rope_scaling = _parse_rope(config, max_positions, source)

        attention_bias = bool(config.get("attention_bias", False))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        sliding_window = config.get("sliding_window")
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not config.get("use_sliding_window"):
            sliding_window = None
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            num_layers=_require_int(config, "num_hidden_layers", source),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            intermediate_size=_require_int(config, "intermediate_size", source),
            vocab_size=_require_int(config, "vocab_size", source),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=int(sliding_window) if sliding_window else None,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_eos_ids(config, generation_config),
            dtype=_dtype_name(config),
        )


def _read_optional_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # generation_config.json only adds EOS ids; a broken one is not fatal


def _architecture(config: dict[str, Any], source: str) -> str:
    architectures = config.get("architectures") or []
    if not architectures and config.get("model_type") in _MODEL_TYPE_TO_ARCH:
        architectures = [_MODEL_TYPE_TO_ARCH[config["model_type"]]]
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = ", ".join(architectures) or f"model_type={config.get('model_type')!r}"
    raise ModelLoadError(
        f"{source}: unsupported architecture {found}; kvtier supports "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}. Pick a checkpoint of one of these families."
    )


def _require_int(config: dict[str, Any], key: str, source: str) -> int:
    value = config.get(key)
    if value is None:
        raise ModelLoadError(f"{source}: required key {key!r} is missing; the config is incomplete")
    return int(value)


def _parse_rope(config: dict[str, Any], max_positions: int, source: str) -> tuple[float, RopeScaling | None]:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        raise ModelLoadError(f"{source}: per-layer-type rope_parameters are not supported")
    theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"{source}: partial_rotary_factor={partial} is not supported")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    factor = float(params["factor"])
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=factor)
    original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    return theta, RopeScaling(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original or max_positions),
    )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _eos_ids(config: dict[str, Any], generation_config: dict[str, Any] | None) -> tuple[int, ...]:
    ids = list(_as_id_tuple(config.get("eos_token_id")))
    if generation_config:
        ids += [i for i in _as_id_tuple(generation_config.get("eos_token_id")) if i not in ids]
    return tuple(ids)


def _dtype_name(config: dict[str, Any]) -> str | None:
    name = config.get("dtype") or config.get("torch_dtype")
    if isinstance(name, str):
        name = name.removeprefix("torch.")
        return name if name in _DTYPE_NAMES else None
    return None
