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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvtier.model import gguf
from kvtier.model.attention import AttentionBackend, TorchPagedAttention
from kvtier.model.fused_decode import FusedDecode
from kvtier.model.hf_config import ArchConfig, ModelFilesNotFoundError, ModelLoadError
from kvtier.model.linear import Linear
from kvtier.model.llama import MLP, Attention, DecoderLayer, DecoderLM, RMSNorm
from kvtier.model.quant_linear import GGUF_REPACKED, QuantLinear, QuantWeight, from_gguf, quantize_int8

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


WEIGHT_FORMATS = ("dense", "gguf", "int8")
"""How the projections hold their weights: `dense` (the model dtype), `gguf` (a GGUF file's
quantized blocks as they are: kvtier.model.quant_linear), `int8` (8-bit weight-only quantization
of the checkpoint at load)."""


def load_model(
    model_dir: str | Path,
    arch: ArchConfig,
    backend: AttentionBackend,
    *,
    dtype: torch.dtype,
    device: torch.device,
    weights: str = "dense",
) -> DecoderLM:
    """Build a `DecoderLM` for `arch` and fill it from the checkpoint in `model_dir` (a Hugging
    Face directory, or a GGUF file: kvtier.model.gguf), its projections' weights held as
    `weights` says (WEIGHT_FORMATS)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r}: use one of {', '.join(WEIGHT_FORMATS)}")
    if weights == "gguf" and not gguf.is_gguf(model_dir):
        raise ValueError(f"weights='gguf' needs a GGUF file, got {str(model_dir)!r}")
    if weights != "dense" and device.type != "cpu":
        raise ValueError(f"quantized weights ({weights}) run on CPU only, not on {device.type}")
    names = _checkpoint_names(model_dir)
    tie = arch.tie_word_embeddings or "lm_head.weight" not in names
    with torch.device("meta"):
        model = DecoderLM(arch, backend, dtype=dtype, device=device, tie_word_embeddings=tie)
    quantized: dict[str, QuantWeight] = {}
    loaded: set[str] = set()  # checkpoint weights the quantized projections hold already
    if weights == "gguf":
        ckpt = gguf.open_checkpoint(str(model_dir))
        quantized, loaded = _install_quantized(model, arch, lambda hf: _gguf_quant_weight(ckpt, hf))
    tensors = _checkpoint_tensors(model_dir, dtype, frozenset(loaded - {"model.embed_tokens.weight"}))
    model.to_empty(device=device)
    for name, qw in quantized.items():
        _set_module(model, name, QuantLinear(qw, _meta_bias(model, name), dtype=dtype))
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
    if weights == "int8":
        for name, module in list(model.named_modules()):
            if isinstance(module, Linear) and module.in_features % 32 == 0:
                _set_module(model, name, QuantLinear(quantize_int8(module.weight), module.bias, dtype=dtype))
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        model.weight_format = weights
        # the projections sum in another order than transformers' already: the per-layer ops may
        # too (fused float32 kernels, csrc/layer_ops_f32.c)
        for module in model.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.native_f32 = True
        if isinstance(backend, TorchPagedAttention):
            backend.native_f32 = True
            # decode-only steps: every layer in one native call (csrc/decode_model_f32.c)
            model.fused_decode = FusedDecode.for_model(model)
    return model.eval()


def _gguf_quant_weight(ckpt: gguf.GGUFCheckpoint, hf: str) -> QuantWeight | None:
    """A GGUF weight repacked for the quantized kernels, or None where its type is not repacked
    (quant_linear.GGUF_REPACKED: it loads dense)."""
    raw = ckpt.raw_weight(hf)
    if raw is None or raw[0] not in GGUF_REPACKED:
        return None
    type_name, blocks, n, k, order = raw
    weight = from_gguf(type_name, blocks, n, k)
    return weight.rows(order) if order is not None else weight


def _quantizable(model: DecoderLM, arch: ArchConfig) -> Iterator[tuple[str, list[str]]]:
    """(module name, the checkpoint weights stacked into it) for every projection."""
    lm_head = "model.embed_tokens.weight" if model.tie_word_embeddings else "lm_head.weight"
    yield "lm_head", [lm_head]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        yield f"layers.{i}.self_attn.qkv_proj", [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        yield f"layers.{i}.self_attn.o_proj", [p + "self_attn.o_proj.weight"]
        yield f"layers.{i}.mlp.gate_up_proj", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        yield f"layers.{i}.mlp.down_proj", [p + "mlp.down_proj.weight"]


def _install_quantized(
    model: DecoderLM, arch: ArchConfig, quant_weight: Callable[[str], QuantWeight | None]
) -> tuple[dict[str, QuantWeight], set[str]]:
    """(the projections whose every part the checkpoint has in a repackable quantized type, as
    QuantWeights by module name; the checkpoint weights they hold). Their dense modules are
    replaced by a placeholder (nothing to allocate) until the caller installs the QuantLinear."""
    found: dict[str, QuantWeight] = {}
    loaded: set[str] = set()
    for name, parts in _quantizable(model, arch):
        weights = [quant_weight(part) for part in parts]
        if any(w is None for w in weights):
            continue  # e.g. a float tensor: this projection stays dense
        found[name] = QuantWeight.cat([w for w in weights if w is not None])
        loaded.update(parts)
        _set_module(model, name, _Pending(model.get_submodule(name)))
    return found, loaded


class _Pending(torch.nn.Module):
    """Stands for a projection between the meta model and its QuantLinear (keeps the bias shape)."""

    def __init__(self, dense: torch.nn.Module) -> None:
        super().__init__()
        bias = getattr(dense, "bias", None)
        self.bias_shape = None if bias is None else tuple(bias.shape)


def _meta_bias(model: DecoderLM, name: str) -> torch.Tensor | None:
    pending = model.get_submodule(name)
    assert isinstance(pending, _Pending)
    return None if pending.bias_shape is None else torch.zeros(pending.bias_shape)


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _checkpoint_names(model_dir: str | Path) -> set[str]:
    """The checkpoint's tensor names (Hugging Face names for a GGUF file)."""
    if gguf.is_gguf(model_dir):
        return set(gguf.open_checkpoint(str(model_dir)).tensor_names())
    names: set[str] = set()
    for f in safetensors_files(model_dir):
        names.update(n for n in _read_header(f)[1] if n != "__metadata__")
    return names


def _checkpoint_tensors(
    model_dir: str | Path, dtype: torch.dtype, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the checkpoint's tensors but `skip`, read one at a time."""
    if gguf.is_gguf(model_dir):
        return gguf.open_checkpoint(str(model_dir)).tensors(dtype, skip)

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for f in safetensors_files(model_dir):
            with safe_open(str(f), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    if name not in skip:
                        yield name, reader.get_tensor(name)

    return read()


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
    if not model.tie_word_embeddings and isinstance(model.lm_head, Linear):
        yield "lm_head.weight", model.lm_head.weight.data
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)  # nn.ModuleList yields plain Modules to the checker
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        # a QuantLinear holds its weight already (load_model); its bias loads here
        qkv_params = [("weight", attn.qkv_proj.weight.data)] if isinstance(attn.qkv_proj, Linear) else []
        if attn.qkv_proj.bias is not None:
            qkv_params.append(("bias", attn.qkv_proj.bias.data))
        for kind, param in qkv_params:
            yield f"{prefix}self_attn.q_proj.{kind}", param[:hq]
            yield f"{prefix}self_attn.k_proj.{kind}", param[hq : hq + hkv]
            yield f"{prefix}self_attn.v_proj.{kind}", param[hq + hkv :]
        if isinstance(attn.o_proj, Linear):
            yield f"{prefix}self_attn.o_proj.weight", attn.o_proj.weight.data
        if attn.o_proj.bias is not None:
            yield f"{prefix}self_attn.o_proj.bias", attn.o_proj.bias.data
        if attn.qk_norm is not None:
            yield f"{prefix}self_attn.q_norm.weight", attn.qk_norm.weight.data[: arch.num_heads]
            yield f"{prefix}self_attn.k_norm.weight", attn.qk_norm.weight.data[arch.num_heads :]
        biases = ["bias"] if arch.mlp_bias else []
        for kind in (["weight"] if isinstance(mlp.gate_up_proj, Linear) else []) + biases:
            gate_up = getattr(mlp.gate_up_proj, kind).data
            yield f"{prefix}mlp.gate_proj.{kind}", gate_up[:inter]
            yield f"{prefix}mlp.up_proj.{kind}", gate_up[inter:]
        for kind in (["weight"] if isinstance(mlp.down_proj, Linear) else []) + biases:
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
    model_dir: str | Path,
    dtype: torch.dtype | str,
    kv_dtype: torch.dtype | str,
    block_size: int,
    *,
    weights: str = "dense",
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
    if weights != "dense":  # other weights compute other KV: never shared with the dense model's
        h.update(f" weights={weights}".encode())
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
