"""GGUF checkpoints (llama.cpp's format): config, weights and tokenizer read from one file.

    LLM(model="SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32")
    kvtier serve --model path/model.gguf

A GGUF file holds what a Hugging Face directory spreads over config.json, tokenizer.json,
tokenizer_config.json and the safetensors shards. `GGUFCheckpoint` reads it with the `gguf`
package (the optional extra `kvtier[gguf]`) and hands kvtier's loader the same things a
directory gives:

* `config()`: a config.json-style dict from the `{arch}.*` metadata (Llama, Mistral, Qwen2,
  Qwen3);
* `tensors(dtype)`: every weight under its Hugging Face name, dequantized at load into `dtype`
  (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, each the same float32 math as
  the `gguf` package's reference dequantization). llama.cpp stores the q and k projections of
  Llama-architecture models permuted for its interleaved rope; they are permuted back here;
* `tokenizer_parts()`: the byte-level BPE tokenizer its `tokenizer.ggml.*` metadata describes
  (vocabulary, merges, control tokens as special tokens), built as transformers builds it from
  the same file, and the chat template, BOS and EOS tokens.

The file is memory-mapped: only one tensor at a time is dequantized. Everything else (types
nobody needs for these families, other tokenizer models, other architectures) is a clear
`ModelLoadError`. transformers also reads GGUF (`from_pretrained(dir, gguf_file=...)`, which
needs `accelerate`), but cannot save what it loaded (`save_pretrained` refuses a GGUF-loaded
model); kvtier serves the file directly instead.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.model.hf_config import ModelFilesNotFoundError, ModelLoadError

GGUF_MAGIC = b"GGUF"
_FINGERPRINT_EDGE_BYTES = 1 << 20

_ARCHITECTURES = {  # general.architecture -> (config.json model_type, architectures[0])
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
_PERMUTED_QK = ("llama", "mistral")
"""Architectures whose attn_q / attn_k llama.cpp's converter permuted for interleaved rope."""

_LAYER_TENSORS = {  # blk.{i}.<gguf name> -> model.layers.{i}.<hf name>
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a GGUF file (its first four bytes)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _gguf_module():
    try:
        import gguf
    except ImportError:
        raise ModelLoadError(
            "reading a .gguf file needs the gguf package: pip install 'kvtier[gguf]' (or pip install gguf)"
        ) from None
    return gguf


@functools.lru_cache(maxsize=4)
def open_checkpoint(path: str) -> GGUFCheckpoint:
    """The checkpoint of `path`, opened once per process (config, tokenizer and weights all
    read the same file)."""
    return GGUFCheckpoint(path)


class GGUFCheckpoint:
    """One GGUF file (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFilesNotFoundError(f"{str(self.path)!r} does not exist")
        gguf = _gguf_module()
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:
            raise ModelLoadError(f"{str(self.path)!r} is not a readable GGUF file ({exc})") from exc
        self._meta: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[1] in (
                "tokens",
                "merges",
                "token_type",
                "scores",
            ):
                continue  # big arrays: read on demand
            try:
                self._meta[key] = field.contents()
            except Exception:  # noqa: BLE001, S112 - a field type this gguf version cannot render: unused
                continue
        self.arch = str(self._meta.get("general.architecture", ""))
        if self.arch not in _ARCHITECTURES:
            raise ModelLoadError(
                f"{str(self.path)!r}: GGUF architecture {self.arch!r} is not supported; kvtier serves "
                f"{', '.join(sorted(_ARCHITECTURES))}"
            )
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._hf_index: dict[str, Any] | None = None

    # -- config ------------------------------------------------------------------------------

    def _arch_value(self, key: str, default: Any = None) -> Any:
        return self._meta.get(f"{self.arch}.{key}", default)

    def config(self) -> dict[str, Any]:
        """A config.json equivalent of the file's metadata."""
        model_type, architecture = _ARCHITECTURES[self.arch]
        required = {
            "hidden_size": "embedding_length",
            "num_hidden_layers": "block_count",
            "intermediate_size": "feed_forward_length",
            "num_attention_heads": "attention.head_count",
        }
        cfg: dict[str, Any] = {"model_type": model_type, "architectures": [architecture]}
        for hf_key, key in required.items():
            value = self._arch_value(key)
            if value is None:
                raise ModelLoadError(f"{str(self.path)!r}: metadata {self.arch}.{key} is missing")
            cfg[hf_key] = int(value)
        heads = cfg["num_attention_heads"]
        cfg["num_key_value_heads"] = int(self._arch_value("attention.head_count_kv", heads))
        head_dim = self._arch_value("attention.key_length") or self._arch_value("rope.dimension_count")
        if head_dim is not None and int(head_dim) != cfg["hidden_size"] // heads:
            cfg["head_dim"] = int(head_dim)
        cfg["rms_norm_eps"] = float(self._arch_value("attention.layer_norm_rms_epsilon", 1e-6))
        cfg["rope_theta"] = float(self._arch_value("rope.freq_base", 10000.0))
        cfg["max_position_embeddings"] = int(self._arch_value("context_length", 2048))
        scaling = self._arch_value("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise ModelLoadError(f"{str(self.path)!r}: rope scaling {scaling!r} is not supported (linear is)")
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(self._arch_value("rope.scaling.factor"))}
        cfg["vocab_size"] = int(self._arch_value("vocab_size") or len(self._field_array("tokenizer.ggml.tokens")))
        cfg["tie_word_embeddings"] = "output.weight" not in self._tensors
        bos, eos = self._meta.get("tokenizer.ggml.bos_token_id"), self._meta.get("tokenizer.ggml.eos_token_id")
        if bos is not None:
            cfg["bos_token_id"] = int(bos)
        if eos is not None:
            cfg["eos_token_id"] = int(eos)
        cfg["torch_dtype"] = "float32"  # the dtype "auto" means for a GGUF: its values dequantize exactly
        return cfg

    # -- weights -----------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """The Hugging Face names of the file's tensors."""
        return [n for n in (hf_name(t) for t in self._tensors) if n is not None]

    def tensors(self, dtype: torch.dtype, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, weight in `dtype`) for each tensor of the file but those in `skip`,
        dequantized one at a time (float32 math, then cast)."""
        cfg = self.config()
        for name, tensor in self._tensors.items():
            hf = hf_name(name)
            if hf is None or hf in skip:
                continue  # e.g. rope_freqs of llama3 files: kvtier computes its own
            values = dequantize(tensor.tensor_type.name, np.asarray(tensor.data), self.path, name)
            shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists dimensions innermost first
            values = values.reshape(shape)
            if self.arch in _PERMUTED_QK and ".attn_q." in name:
                values = _unpermute(values, cfg["num_attention_heads"])
            elif self.arch in _PERMUTED_QK and ".attn_k." in name:
                values = _unpermute(values, cfg["num_key_value_heads"])
            yield hf, values.to(dtype)

    def raw_weight(self, hf: str) -> tuple[str, torch.Tensor, int, int, torch.Tensor | None] | None:
        """The 2-D weight `hf` (a Hugging Face name) as it is in the file: (GGUF type name, its blocks
        [num_blocks, block_bytes] uint8, out_features n, in_features k, the row order that undoes
        llama.cpp's q/k permutation or None), or None where the file has no such 2-D block-quantized
        tensor (kvtier.model.quant_linear repacks these)."""
        if self._hf_index is None:
            self._hf_index = {h: t for t in self._tensors.values() if (h := hf_name(t.name)) is not None}
        tensor = self._hf_index.get(hf)
        if tensor is None or tensor.tensor_type.name not in _BLOCK_BYTES or len(tensor.shape) != 2:
            return None
        type_name = tensor.tensor_type.name
        k, n = (int(d) for d in tensor.shape)  # GGUF lists dimensions innermost first
        raw = torch.from_numpy(np.array(tensor.data, copy=True, order="C")).reshape(-1).view(torch.uint8)
        order = None
        name = tensor.name
        if self.arch in _PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
            heads = self.config()["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"]
            order = _unpermute(torch.arange(n), heads)  # the rows' new order
        return type_name, raw.reshape(-1, _BLOCK_BYTES[type_name]), n, k, order

    # -- tokenizer ---------------------------------------------------------------------------

    def _field_array(self, key: str) -> list[Any]:
        field = self._reader.fields.get(key)
        return list(field.contents()) if field is not None else []

    def tokenizer_parts(self) -> tuple[Any, dict[str, Any]]:
        """(a `tokenizers.Tokenizer`, a tokenizer_config.json equivalent) built from the metadata."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        model = self._meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(
                f"{str(self.path)!r}: GGUF tokenizer model {model!r} is not supported; kvtier builds byte-level "
                f"BPE ('gpt2': Llama 3, Qwen2/3, SmolLM) tokenizers from GGUF metadata. Serve a Hugging Face "
                f"directory of this model instead, or pass token ids"
            )
        tokens = [str(t) for t in self._field_array("tokenizer.ggml.tokens")]
        merges: list[tuple[str, str]] = []
        for m in self._field_array("tokenizer.ggml.merges"):
            left, space, right = str(m).partition(" ")
            if not space:
                raise ModelLoadError(f"{str(self.path)!r}: GGUF merge {str(m)!r} is not 'LEFT RIGHT'")
            merges.append((left, right))
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        spelling = _bytes_to_unicode()
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        pre = self._meta.get("tokenizer.ggml.pre")
        split = _PRE_TOKENIZER_SPLITS.get(pre) if pre is not None else None
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            from tokenizers import Regex

            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tok.decoder = decoders.ByteLevel()
        types = [int(x) for x in self._field_array("tokenizer.ggml.token_type")]
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, types)
            if kind == 3 and set(t) <= alphabet
        ]  # 3: CONTROL
        if control:
            tok.add_special_tokens(control)
        user = [
            AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types) if kind == 4 and t in vocab
        ]  # 4: USER_DEFINED
        if user:
            tok.add_tokens(user)

        def token(key: str) -> str | None:
            i = self._meta.get(f"tokenizer.ggml.{key}")
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        bos = token("bos_token_id")
        if self._meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
            from tokenizers import processors

            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
            )
        config = {
            "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"),
            "pad_token": token("padding_token_id"),
            "unk_token": token("unknown_token_id"),
            "chat_template": self._meta.get("tokenizer.chat_template"),
            "add_bos_token": bool(self._meta.get("tokenizer.ggml.add_bos_token", False)),
        }
        return tok, config

    # -- conversion --------------------------------------------------------------------------

    def save_pretrained(self, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
        """A Hugging Face directory of this file (config.json, model.safetensors, tokenizer.json,
        tokenizer_config.json): what transformers 5 cannot write for a GGUF-loaded model, and
        what tools that read only safetensors (vLLM's CPU build among them) need."""
        import json

        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.config()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        tensors = {name: t.contiguous() for name, t in self.tensors(dtype)}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        tok, tok_config = self.tokenizer_parts()
        tok.save(str(out / "tokenizer.json"))
        tok_config = {k: v for k, v in tok_config.items() if v is not None}
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
        return out

    # -- identity ----------------------------------------------------------------------------

    def fingerprint_bytes(self) -> bytes:
        """What a model fingerprint hashes for this file: its size, metadata and tensor table
        (everything before the tensor data) and the first and last MiB of tensor data."""
        size = self.path.stat().st_size
        data_start = min((int(t.data_offset) for t in self._reader.tensors), default=size)
        h = hashlib.blake2b(digest_size=16)
        with open(self.path, "rb") as f:
            h.update(f.read(data_start))
            f.seek(data_start)
            h.update(f.read(min(size - data_start, _FINGERPRINT_EDGE_BYTES)))
            if size - data_start > _FINGERPRINT_EDGE_BYTES:
                f.seek(max(data_start, size - _FINGERPRINT_EDGE_BYTES))
                h.update(f.read())
        return f"gguf {size} ".encode() + h.digest()


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name (None: a tensor kvtier does not load)."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _TOP_TENSORS:
        return f"{_TOP_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    return None


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: rows (head, pair, half) -> (head, half, pair)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------- dequantization
QK = 32
QK_K = 256
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
SUPPORTED_TYPES = ("F32", "F16", "BF16", *_BLOCK_BYTES)


def dequantize(type_name: str, data: np.ndarray, path: Any = "", name: str = "") -> torch.Tensor:
    """A GGUF tensor's raw data (as the gguf package's reader gives it) -> flat float32 values."""
    raw = torch.from_numpy(np.array(data, copy=True, order="C"))  # the reader's arrays map the file read-only
    if type_name == "F32":
        return raw.reshape(-1).float()
    if type_name == "F16":
        return raw.reshape(-1).view(torch.float16).float()
    if type_name == "BF16":
        return raw.reshape(-1).view(torch.bfloat16).float()
    size = _BLOCK_BYTES.get(type_name)
    if size is None:
        raise ModelLoadError(
            f"{str(path)!r}: tensor {name} is of GGUF type {type_name}, which kvtier does not dequantize "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    blocks = raw.reshape(-1).view(torch.uint8).reshape(-1, size)
    return _DEQUANT[type_name](blocks).reshape(-1)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """[n, 1] float32 of the fp16 at byte `start` of each block."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, b] bytes -> [n, 2 b] values: the low nibbles of all bytes, then the high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes -> [n, 32] bits (bit j of the little-endian 32-bit word)."""
    word = qh.to(torch.int64)
    word = word[:, 0] | (word[:, 1] << 8) | (word[:, 2] << 16) | (word[:, 3] << 24)
    return ((word[:, None] >> torch.arange(32)) & 1).to(torch.uint8)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K super-block ([n, 12] bytes -> [n, 8] each)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mn.float()


def _sub_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes -> [n, 8, 32]: per 32-byte group, its low nibbles then its high nibbles."""
    q = qs.reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc).reshape(-1, 8, 1)
    dm = (_f16(b, 2) * mn).reshape(-1, 8, 1)
    return d * _sub_nibbles(b[:, 16:]).float() - dm


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc).reshape(-1, 8, 1)
    dm = (_f16(b, 2) * mn).reshape(-1, 8, 1)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    q = _sub_nibbles(b[:, 48:]) | ((qh & 1) << 4)
    return d * q.float() - dm


def _q6_k_values(b: torch.Tensor) -> torch.Tensor:
    """[n, 210] Q6_K super-blocks -> [n, 256] int8: each element's 6-bit value - 32, in element order."""
    ql, qh = b[:, :128], b[:, 128:192]
    low = ql.reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    low = (low & 0x0F).reshape(-1, 8, 32)
    high = qh.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (high & 0x03).reshape(-1, 8, 32)
    return ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b, 208) * scales).reshape(-1, 16, 1)
    return d * _q6_k_values(b).reshape(-1, 16, 16).float()


_DEQUANT = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


# ---------------------------------------------------------------------------------- tokenizer
@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of byte-level BPE vocabularies)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
"""How text is split before BPE, by `tokenizer.ggml.pre` (others: GPT-2's own split, as in
transformers' GGUF tokenizer for them)."""
