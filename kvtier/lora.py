"""LoRA adapters as vLLM serves them: `LoRARequest` names an adapter (a PEFT checkpoint directory)
for a request; the engine loads it on first use, checks it against the base model and keeps it.

    LLM(model, enable_lora=True, max_loras=2, max_lora_rank=16)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

A PEFT adapter directory holds adapter_config.json and adapter_model.safetensors (or .bin) with,
for each targeted projection, lora_A [r, in_features] and lora_B [out_features, r]. kvtier serves
LoRA on the q/k/v/o and gate/up/down projections of the decoder layers; anything else the
checkpoint asks for (DoRA, LoRA biases, embedding or lm_head LoRA, modules_to_save, extra
vocabulary) is refused at load with the reason, never served differently from PEFT.

Where an adapter lives (`LoRARegistry`, `kvtier.model.runner.ModelRunner`):

    disk          the PEFT directory, read on a request's first use
    host (LRU)    max_cpu_loras adapters in the model dtype, ready to run (on CPU: the only copy)
    device slots  max_loras adapters; the scheduler runs requests of at most max_loras distinct
                  adapters at once, and admits a request whose adapter has no slot once one frees

The KV of a request depends on its adapter, so the adapter is part of every block key: its content
digest (`LoRAWeights.key`: the adapter's config and weight files, so a different adapter loaded
under the same name later never meets the old one's KV) is folded into the root of the request's
key chain (`lora_fingerprint`), on the device and in every tier.

Importing this module loads no torch (the engine protocol carries LoRARequest).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch

    from kvtier.model.hf_config import ArchConfig
    from kvtier.model.lora import LoRAWeights


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """An adapter for a request, as vLLM's `LoRARequest`: `lora_name` names it, `lora_int_id`
    (>= 1) is its id, `lora_path` the PEFT checkpoint directory. Requests naming the same
    (name, id, path) share one loaded copy."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    """Accepted as vLLM accepts it; not checked against the served model."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must name the adapter's directory")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA serving limits (vLLM's names)."""

    max_loras: int = 1
    """Distinct adapters the requests of one step may use (device slots)."""
    max_lora_rank: int = 16
    """Highest rank an adapter may have; a higher one is refused when it loads."""
    max_cpu_loras: int | None = None
    """Loaded adapters kept in host memory, least recently used dropped first (None: max_loras)."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def lora_fingerprint(model_fingerprint: bytes, adapter_key: bytes) -> bytes:
    """The fingerprint a request with this adapter roots its block keys in (kvtier.kvcache.keys.
    root_key): the base model's, with the adapter's content digest folded in."""
    h = hashlib.blake2b(b"kvtier-lora\x00", digest_size=16)
    h.update(len(model_fingerprint).to_bytes(8, "little"))
    h.update(model_fingerprint)
    h.update(adapter_key)
    return h.digest()


class LoRARegistry:
    """Adapters loaded from their PEFT directories, kept for the next request: the
    `config.num_cpu_loras` most recently used. A cached adapter whose files changed on disk
    (another modification time or size) is loaded again. Engine thread only."""

    def __init__(self, config: LoRAConfig, arch: ArchConfig, dtype: torch.dtype) -> None:
        self.config = config
        self.arch = arch
        self.dtype = dtype
        self._cache: OrderedDict[tuple[str, int, str], tuple[tuple[int, ...], LoRAWeights]] = OrderedDict()
        self.num_loads = 0

    def get(self, request: LoRARequest) -> LoRAWeights:
        """The adapter `request` names, loaded on first use; ValueError (naming the adapter) when
        it cannot be read or does not fit the base model."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a kvtier.LoRARequest, got {type(request).__name__}")
        files = _adapter_files(request)
        stamp = _stamp(files)
        key = (request.lora_name, request.lora_int_id, request.lora_path)
        hit = self._cache.get(key)
        if hit is not None and hit[0] == stamp:
            self._cache.move_to_end(key)
            return hit[1]
        weights = load_adapter(request, self.arch, self.dtype, self.config.max_lora_rank, files)
        self.num_loads += 1
        self._cache[key] = (stamp, weights)
        self._cache.move_to_end(key)
        while len(self._cache) > self.config.num_cpu_loras:
            self._cache.popitem(last=False)
        return weights

    def __len__(self) -> int:
        return len(self._cache)


# ---------------------------------------------------------------------------------- loading
_PARTS = {
    # PEFT module -> (its block, kvtier projection index, part order within the fused projection)
    "q_proj": ("self_attn", 0, 0),
    "k_proj": ("self_attn", 0, 1),
    "v_proj": ("self_attn", 0, 2),
    "o_proj": ("self_attn", 1, 0),
    "gate_proj": ("mlp", 2, 0),
    "up_proj": ("mlp", 2, 1),
    "down_proj": ("mlp", 3, 0),
}
SUPPORTED_MODULES = tuple(_PARTS)

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>(?:model\.)?layers\.(?P<layer>\d+)\.(?P<block>\w+)\.(?P<proj>\w+))"
    r"\.lora_(?P<ab>[AB])\.weight$"
)

_REFUSED = {
    # adapter_config.json field -> what it would need
    "use_dora": "DoRA (use_dora=true): magnitude vectors",
    "lora_bias": "LoRA biases (lora_bias=true)",
    "fan_in_fan_out": "fan_in_fan_out=true (Conv1D-style weights)",
    "modules_to_save": "modules_to_save (full copies of other modules)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "target_parameters": "target_parameters (LoRA on parameters, not modules)",
    "use_qalora": "QA-LoRA (use_qalora=true)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
}


@dataclass(frozen=True)
class _Files:
    config: Path
    weights: Path


def _error(request: LoRARequest, message: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {message}")


def _adapter_files(request: LoRARequest) -> _Files:
    root = Path(request.lora_path)
    config = root / "adapter_config.json"
    if not config.is_file():
        raise _error(request, "no adapter_config.json there; give the directory PEFT's save_pretrained wrote")
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (root / name).is_file():
            return _Files(config, root / name)
    raise _error(request, "no adapter_model.safetensors or adapter_model.bin there")


def _stamp(files: _Files) -> tuple[int, ...]:
    a, b = files.config.stat(), files.weights.stat()
    return (a.st_mtime_ns, a.st_size, a.st_ino, b.st_mtime_ns, b.st_size, b.st_ino)


def _digest(files: _Files) -> bytes:
    """The adapter's identity: its config and weights, byte for byte."""
    h = hashlib.blake2b(b"kvtier-lora-adapter\x00", digest_size=16)
    for path in (files.config, files.weights):
        h.update(path.name.encode() + b"\x00")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.digest()


_DIGESTS: dict[str, tuple[tuple[int, ...], bytes]] = {}


def adapter_digest(path: str) -> bytes | None:
    """The content digest of the PEFT adapter directory `path` (`_digest`: its config and weight
    files byte for byte), re-read only when a file's size, inode or mtime changed; None when the
    directory holds no adapter. What names an adapter's KV for kvtier's vLLM connector, so a
    different adapter saved under the same name and id never meets the old one's KV."""
    try:
        files = _adapter_files(LoRARequest("adapter", 1, path))
        stamp = _stamp(files)
    except (ValueError, OSError):
        return None
    cached = _DIGESTS.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    digest = _digest(files)
    _DIGESTS[path] = (stamp, digest)
    return digest


def adapter_salt(lora: Any) -> str:
    """What a LoRA request adds to its KV key salt in kvtier's vLLM connector: the adapter's name,
    id and content digest (`adapter_digest`; its path where the directory holds no adapter).
    `lora` is vLLM's LoRARequest (or kvtier's)."""
    name = getattr(lora, "lora_name", None) or getattr(lora, "name", None)
    path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
    digest = adapter_digest(str(path)) if path else None
    content = digest.hex() if digest is not None else f"path={path}"
    return f"lora={name}:{getattr(lora, 'lora_int_id', '')}:{content}"


def read_adapter_config(request: LoRARequest, files: _Files) -> dict[str, Any]:
    """adapter_config.json, checked for what kvtier cannot serve (a clear error for each)."""
    try:
        config = json.loads(files.config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _error(request, f"adapter_config.json does not read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise _error(request, "adapter_config.json is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _error(request, f"peft_type {peft_type!r} is not supported; kvtier serves LoRA adapters only")
    for field, what in _REFUSED.items():
        if config.get(field):
            raise _error(request, f"{what} is not supported; train or merge a plain LoRA adapter")
    bias = config.get("bias", "none")
    if bias != "none":
        raise _error(request, f"bias={bias!r} is not supported (bias='none' only)")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for t in targets:
            _check_module_name(request, str(t).rsplit(".", 1)[-1])
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise _error(request, f"{field} must be a positive number, got {value!r}")
    for name in ("new_embeddings.safetensors", "new_embeddings.bin"):
        if (files.config.parent / name).exists():
            raise _error(request, f"{name}: adapters that add vocabulary are not supported")
    return config


def _check_module_name(request: LoRARequest, module: str) -> None:
    if module in _PARTS:
        return
    if module in ("embed_tokens", "lm_head"):
        raise _error(request, f"LoRA on {module} is not supported (only {', '.join(SUPPORTED_MODULES)})")
    raise _error(request, f"target module {module!r} is not one kvtier serves LoRA on ({', '.join(SUPPORTED_MODULES)})")


def _read_tensors(request: LoRARequest, files: _Files) -> dict[str, torch.Tensor]:
    import torch

    try:
        if files.weights.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(files.weights))
        state = torch.load(str(files.weights), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the adapter's fault: say which
        raise _error(request, f"{files.weights.name} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise _error(request, f"{files.weights.name} is not a state dict of tensors")
    return state


def _alpha(config: dict[str, Any], module: str) -> float:
    """lora_alpha of `module` (`model.layers.0.self_attn.q_proj`): alpha_pattern's first key that
    matches its name's tail, as PEFT's get_pattern_key, else lora_alpha."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha)
    return float(config["lora_alpha"])


def load_adapter(
    request: LoRARequest, arch: ArchConfig, dtype: torch.dtype, max_rank: int, files: _Files | None = None
) -> LoRAWeights:
    """Read and check a PEFT adapter against the base model `arch`; its weights in `dtype`, fused
    as kvtier's projections are (kvtier.model.lora)."""
    import torch

    from kvtier.model.lora import PROJECTIONS, LoRAWeights

    files = files or _adapter_files(request)
    config = read_adapter_config(request, files)
    tensors = _read_tensors(request, files)
    if not tensors:
        raise _error(request, f"{files.weights.name} holds no tensors")

    hq, hkv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, inter = arch.hidden_size, arch.intermediate_size
    # per PEFT module: (row offset in the fused output, rows, in_features)
    shapes = {
        "q_proj": (0, hq, h),
        "k_proj": (hq, hkv, h),
        "v_proj": (hq + hkv, hkv, h),
        "o_proj": (0, h, hq),
        "gate_proj": (0, inter, h),
        "up_proj": (inter, inter, h),
        "down_proj": (0, h, inter),
    }
    out_rows = (hq + 2 * hkv, h, 2 * inter, h)  # per kvtier projection

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules: dict[tuple[int, str], str] = {}
    for name, t in tensors.items():
        m = _KEY.match(name)
        if m is None:
            if "lora_magnitude_vector" in name:
                raise _error(request, f"{name}: DoRA adapters are not supported")
            if "lora_embedding" in name or "embed_tokens" in name or "lm_head" in name:
                raise _error(request, f"{name}: LoRA on embeddings or lm_head is not supported")
            raise _error(request, f"tensor {name!r} is not a LoRA weight of a decoder projection kvtier knows")
        proj = m["proj"]
        _check_module_name(request, proj)
        if m["block"] != _PARTS[proj][0]:
            raise _error(request, f"tensor {name!r}: {proj} belongs to {_PARTS[proj][0]}, not {m['block']}")
        layer = int(m["layer"])
        if layer >= arch.num_layers:
            raise _error(request, f"tensor {name!r}: layer {layer}, but the base model has {arch.num_layers} layers")
        pairs.setdefault((layer, proj), {})[m["ab"]] = t
        modules[(layer, proj)] = "model." + m["module"].removeprefix("model.")

    # [layer][projection] -> parts (part order, row offset, rows, A [r, K], B [rows, r] scaled)
    parts: list[list[list[tuple[int, int, int, torch.Tensor, torch.Tensor]]]] = [
        [[] for _ in PROJECTIONS] for _ in range(arch.num_layers)
    ]
    max_seen = 0
    for (layer, proj), ab in sorted(pairs.items()):
        module = modules[(layer, proj)]
        if set(ab) != {"A", "B"}:
            raise _error(request, f"{module}: lora_{'B' if 'A' in ab else 'A'} is missing")
        a, b = ab["A"], ab["B"]
        offset, rows, in_features = shapes[proj]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or tuple(b.shape) != (rows, r):
            raise _error(
                request,
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base model "
                f"(want [r, {in_features}] and [{rows}, r]): an adapter of another model?",
            )
        if r > max_rank:
            raise _error(
                request, f"{module} has rank {r}, above max_lora_rank={max_rank}; start the engine with a higher one"
            )
        max_seen = max(max_seen, r)
        alpha = _alpha(config, module)
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        _, index, order = _PARTS[proj]
        parts[layer][index].append((order, offset, rows, a, b.double() * scale))

    layers = []
    for layer_parts in parts:
        fused: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for index, ps in enumerate(layer_parts):
            if not ps:
                fused.append(None)
                continue
            ps.sort(key=lambda p: p[0])
            a_cat = torch.cat([p[3] for p in ps]).to(dtype).contiguous()  # [R, K]
            b_bd = torch.zeros(out_rows[index], a_cat.shape[0], dtype=dtype)  # [N, R]
            col = 0
            for _, offset, rows, a, b in ps:
                b_bd[offset : offset + rows, col : col + a.shape[0]] = b.to(dtype)
                col += a.shape[0]
            fused.append((a_cat, b_bd))
        layers.append(fused)
    return LoRAWeights(_digest(files), request.lora_name, max_seen, layers)
