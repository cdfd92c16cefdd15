"""Load HF safetensors checkpoints into `DecoderLM`, and fingerprint a model configuration.

Checkpoint tensors are routed to slices of kvtier's (fused) parameters::

    model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias} -> layers.{i}.self_attn.qkv_proj rows [q | k | v]
    model.layers.{i}.mlp.{gate,up}_proj.weight            -> layers.{i}.mlp.gate_up_proj rows [gate | up]
    model.layers.{i}.self_attn.{q,k}_norm.weight          -> layers.{i}.self_attn.qk_norm rows [q heads | k heads]
    everything else                                        -> the parameter of the same name without "model."

The model is built on the meta device and materialised once on the target device, so weights
are never held twice in the model dtype.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvtier.model import gguf
from kvtier.model.attention import AttentionBackend
from kvtier.model.hf_config import ArchConfig, ModelFilesNotFoundError, ModelLoadError
from kvtier.model.llama import DecoderLayer, DecoderLM

LAYOUT_VERSION = 1
"""Bump when the KV layout or numerics change so that stored KV of older versions stops matching."""

_FINGERPRINT_EDGE_BYTES = 1 << 20
_INDEX_FILE = "model.safetensors.index.json"


def arch_config(model_path: str | Path) -> ArchConfig:
    """The architecture of a checkpoint: from a GGUF file's metadata (kvtier.model.gguf), else
    from a Hugging Face directory's config.json (ArchConfig.from_dir)."""
    if gguf.is_gguf(model_path):
        return ArchConfig.from_dict(gguf.open_checkpoint(str(model_path)).config(), source=str(model_path))
    return ArchConfig.from_dir(model_path)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files: those named by the shard index, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{str(index)!r} is not a valid shard index ({exc}); re-download it") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFilesNotFoundError(
                f"{str(model_dir)!r}: shards listed in {_INDEX_FILE} are missing: {', '.join(missing)}; "
                f"the download is incomplete"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFilesNotFoundError(
            f"{str(model_dir)!r} has no *.safetensors weights; kvtier loads safetensors only "
            f"(convert .bin/.pth checkpoints with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def checkpoint_dtype(model_dir: str | Path) -> torch.dtype:
    """The dtype of the checkpoint's floating-point tensors, read from the first file's header."""
    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    header = _read_header(safetensors_files(model_dir)[0])[1]
    for name, entry in header.items():
        if name != "__metadata__" and entry["dtype"] in names:
            return names[entry["dtype"]]
    return torch.float32


def load_model(
    model_dir: str | Path,
    arch: ArchConfig,
    backend: AttentionBackend,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> DecoderLM:
    """Build a `DecoderLM` for `arch` and fill it from the checkpoint in `model_dir` (a Hugging
    Face directory, or a GGUF file: kvtier.model.gguf)."""
    names, tensors = _checkpoint_tensors(model_dir, dtype)
    tie = arch.tie_word_embeddings or "lm_head.weight" not in names
    with torch.device("meta"):
        model = DecoderLM(arch, backend, dtype=dtype, device=device, tie_word_embeddings=tie)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty re-creates parameters, which unties them

    routes = dict(_routes(model, arch))
    missing = sorted(set(routes) - names)
    if missing:
        shown = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
        raise ModelLoadError(
            f"{str(model_dir)!r}: checkpoint is missing tensors {shown}; it does not match its config.json "
            f"({arch.architecture}) or the download is incomplete"
        )
    for name, tensor in tensors:
        dest = routes.get(name)
        if dest is None:
            continue  # e.g. rotary_emb.inv_freq of old checkpoints
        # q/k norm weights [D] are broadcast into their rows of qk_norm [Hq + Hkv, D]
        is_head_norm = name.endswith(("q_norm.weight", "k_norm.weight"))
        expected = dest.shape[-tensor.dim() :] if is_head_norm else dest.shape
        if tuple(tensor.shape) != tuple(expected):
            raise ModelLoadError(
                f"{str(model_dir)!r}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies "
                f"{tuple(expected)}; the config and the weights belong to different models"
            )
        dest.copy_(tensor)  # casts to the model dtype and moves to the device
    return model.eval()


def _checkpoint_tensors(
    model_dir: str | Path, dtype: torch.dtype
) -> tuple[set[str], Iterator[tuple[str, torch.Tensor]]]:
    """(the checkpoint's tensor names, an iterator of (name, tensor) read one at a time)."""
    if gguf.is_gguf(model_dir):
        ckpt = gguf.open_checkpoint(str(model_dir))
        return set(ckpt.tensor_names()), ckpt.tensors(dtype)
    files = safetensors_files(model_dir)
    names: set[str] = set()
    for f in files:
        names.update(n for n in _read_header(f)[1] if n != "__metadata__")

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    yield name, reader.get_tensor(name)

    return names, read()


def read_kv_scales(model_dir: str | Path, num_layers: int) -> list[tuple[float, float]] | None:
    """Static per-layer (k_scale, v_scale) of a checkpoint quantized for an fp8 KV cache, else None.

    Follows vLLM's naming: `model.layers.{i}.self_attn.k_scale` / `v_scale` (or one `kv_scale` for
    both), scalars with x ~= fp8_e4m3 * scale. A checkpoint that has them for some layers only is
    an error: half-calibrated KV would silently lose accuracy.
    """
    if gguf.is_gguf(model_dir):
        return None  # GGUF files carry no KV scales
    found: dict[str, float] = {}
    kinds = ("k_scale", "v_scale", "kv_scale")
    wanted = {f"model.layers.{i}.self_attn.{kind}" for i in range(num_layers) for kind in kinds}
    for path in safetensors_files(model_dir):
        names = [n for n in _read_header(path)[1] if n in wanted]
        if not names:
            continue
        with safe_open(str(path), framework="pt", device="cpu") as reader:
            for name in names:
                tensor = reader.get_tensor(name)
                if tensor.numel() != 1:
                    raise ModelLoadError(
                        f"{str(model_dir)!r}: {name} has {tensor.numel()} values; kvtier reads per-layer "
                        f"(scalar) KV scales only"
                    )
                found[name] = float(tensor.float().item())
    if not found:
        return None
    scales: list[tuple[float, float]] = []
    for i in range(num_layers):
        prefix = f"model.layers.{i}.self_attn."
        both = found.get(prefix + "kv_scale")
        k, v = found.get(prefix + "k_scale", both), found.get(prefix + "v_scale", both)
        if k is None or v is None:
            raise ModelLoadError(
                f"{str(model_dir)!r}: KV scales are missing for layer {i} ({prefix}k_scale / v_scale); "
                f"the checkpoint is incompletely calibrated"
            )
        if not (k > 0 and v > 0) or k == float("inf") or v == float("inf"):
            raise ModelLoadError(f"{str(model_dir)!r}: layer {i} has invalid KV scales k={k}, v={v}")
        scales.append((k, v))
    return scales


def _routes(model: DecoderLM, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint tensor name, destination view) for every tensor the model needs."""
    hq = arch.num_heads * arch.head_dim  # rows of q in qkv_proj
    hkv = arch.num_kv_heads * arch.head_dim  # rows of k (and of v)
    inter = arch.intermediate_size
    yield "model.embed_tokens.weight", model.embed_tokens.weight.data
    yield "model.norm.weight", model.norm.weight.data
    if not model.tie_word_embeddings:
        yield "lm_head.weight", model.lm_head.weight.data
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)  # nn.ModuleList yields plain Modules to the checker
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv_params = [("weight", attn.qkv_proj.weight.data)]
        if attn.qkv_proj.bias is not None:
            qkv_params.append(("bias", attn.qkv_proj.bias.data))
        for kind, param in qkv_params:
            yield f"{prefix}self_attn.q_proj.{kind}", param[:hq]
            yield f"{prefix}self_attn.k_proj.{kind}", param[hq : hq + hkv]
            yield f"{prefix}self_attn.v_proj.{kind}", param[hq + hkv :]
        yield f"{prefix}self_attn.o_proj.weight", attn.o_proj.weight.data
        if attn.o_proj.bias is not None:
            yield f"{prefix}self_attn.o_proj.bias", attn.o_proj.bias.data
        if attn.qk_norm is not None:
            yield f"{prefix}self_attn.q_norm.weight", attn.qk_norm.weight.data[: arch.num_heads]
            yield f"{prefix}self_attn.k_norm.weight", attn.qk_norm.weight.data[arch.num_heads :]
        for kind in ("weight", "bias") if arch.mlp_bias else ("weight",):
            gate_up = getattr(mlp.gate_up_proj, kind).data
            yield f"{prefix}mlp.gate_proj.{kind}", gate_up[:inter]
            yield f"{prefix}mlp.up_proj.{kind}", gate_up[inter:]
            yield f"{prefix}mlp.down_proj.{kind}", getattr(mlp.down_proj, kind).data
        yield f"{prefix}input_layernorm.weight", layer.input_layernorm.weight.data
        yield f"{prefix}post_attention_layernorm.weight", layer.post_attention_layernorm.weight.data


def _read_header(path: Path) -> tuple[bytes, dict]:
    """(raw JSON header bytes, parsed header) of a safetensors file."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelLoadError(f"{str(path)!r} is truncated; re-download it")
        (header_len,) = struct.unpack("<Q", prefix)
        raw = f.read(header_len)
    try:
        return raw, json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{str(path)!r} is not a safetensors file ({exc}); re-download it") from exc


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def model_fingerprint(
    model_dir: str | Path, dtype: torch.dtype | str, kv_dtype: torch.dtype | str, block_size: int
) -> bytes:
    """16-byte blake2b identity of (weights, config, dtypes, block size, KV layout version).

    Reads config.json, and for each weight file its size, JSON header and at most the first and
    last MiB of tensor data: cheap on a multi-GB checkpoint, while any re-export, re-quantisation
    or shape change alters the header or the edges of the data.
    """
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"kvtier-layout-{LAYOUT_VERSION}\0".encode())
    if gguf.is_gguf(model_dir):
        h.update(gguf.open_checkpoint(str(model_dir)).fingerprint_bytes())
    else:
        _hash_safetensors(h, model_dir)
    h.update(f"\0dtype={_dtype_name(dtype)} kv_dtype={_dtype_name(kv_dtype)} block_size={block_size}".encode())
    return h.digest()


def _hash_safetensors(h: Any, model_dir: Path) -> None:
    """config.json, and for each weight file its size, header and the edges of its data."""
    h.update((model_dir / "config.json").read_bytes())
    for path in safetensors_files(model_dir):
        size = path.stat().st_size
        raw_header, _ = _read_header(path)
        data_start = 8 + len(raw_header)
        data_len = size - data_start
        h.update(f"\0file {size} {len(raw_header)}\0".encode())
        h.update(raw_header)
        with open(path, "rb") as f:
            f.seek(data_start)
            h.update(f.read(min(data_len, _FINGERPRINT_EDGE_BYTES)))
            if data_len > _FINGERPRINT_EDGE_BYTES:
                tail = min(data_len - _FINGERPRINT_EDGE_BYTES, _FINGERPRINT_EDGE_BYTES)
                f.seek(size - tail)
                h.update(f.read(tail))
