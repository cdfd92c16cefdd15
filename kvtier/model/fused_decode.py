"""A whole decode step in one native call, for float32 models whose projections stay quantized.

The per-op forward of kvtier.model.llama dispatches about 20 ops per layer from Python; on a small
model's decode step (SmolLM2-135M: 30 layers, one row) that dispatch costs as much as the weights'
reads. `FusedDecode` hands the step's decode rows to csrc/decode_model_f32.c, which runs every layer
with the same kernels the per-op path calls (see that file for where the two agree bit for bit).

It applies where the step is decode rows only (no prefill chunk), at most
`quant_linear.KERNEL_MAX_ROWS` of them (larger batches take the per-op path's dense GEMM), on a plain
float32 pool (not a quantized KV cache), for models without per-head q/k norms whose body
projections are all `QuantLinear`; anywhere else `__call__` returns None and the per-op forward
runs.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

import torch

from kvtier.model import native, quant_linear
from kvtier.model.attention import AttentionMetadata, KVCache
from kvtier.model.quant_linear import QuantLinear

if TYPE_CHECKING:
    from kvtier.model.llama import DecoderLayer, DecoderLM

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _QProj(ctypes.Structure):
    _fields_ = [("q", _ptr), ("d", _ptr), ("m", _ptr), ("bias", _ptr), ("fmt", _i64), ("n", _i64), ("k", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("in_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _QProj),
        ("o", _QProj),
        ("gate_up", _QProj),
        ("down", _QProj),
        ("pool", _ptr),
    ]


def _layers(model: DecoderLM) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(model.layers))


def _projections(layer: DecoderLayer) -> tuple[torch.nn.Module, ...]:
    """qkv, o, gate_up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


class FusedDecode:
    """Built by `for_model` for a model it can serve; called from DecoderLM.forward."""

    def __init__(self, model: DecoderLM) -> None:
        arch = model.arch
        self.num_layers = arch.num_layers
        self.hidden = arch.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.inter = arch.intermediate_size
        self.eps = arch.rms_norm_eps
        self._keep: list[torch.Tensor] = []  # float32 biases the structs point at
        self._layers = (_Layer * self.num_layers)()
        for i, layer in enumerate(_layers(model)):
            s = self._layers[i]
            s.in_norm = layer.input_layernorm.weight.data_ptr()
            s.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for field, proj in zip(("qkv", "o", "gate_up", "down"), _projections(layer), strict=True):
                setattr(s, field, self._proj(cast(QuantLinear, proj)))
        self._first = cast(QuantLinear, _projections(_layers(model)[0])[0])
        self._weights_at = self._first.q.data_ptr()
        self._pools: tuple[int, ...] = ()

    @staticmethod
    def for_model(model: DecoderLM) -> FusedDecode | None:
        """A FusedDecode for `model`, or None where it does not apply (see the module docstring)."""
        first = model.embed_tokens.weight
        if first.dtype != torch.float32 or first.device.type != "cpu":
            return None
        for layer in _layers(model):
            projections = _projections(layer)
            if layer.self_attn.qk_norm is not None or not all(isinstance(p, QuantLinear) for p in projections):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
                return None
        return FusedDecode(model)

    def _proj(self, p: QuantLinear) -> _QProj:
        bias = None
        if p.bias is not None:
            bias = p.bias.detach().float().contiguous()
            self._keep.append(bias)
        return _QProj(
            p.q.data_ptr(),
            p.d.data_ptr(),
            p.m.data_ptr() if p.m is not None else None,
            bias.data_ptr() if bias is not None else None,
            quant_linear._FMT_CODE[p.fmt],
            p.out_features,
            p.in_features,
        )

    def __call__(
        self,
        model: DecoderLM,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The residual stream [T, hidden] after the last layer (as DecoderLM.forward returns it),
        with this step's K/V written to the pools; None where the fused call does not apply."""
        d = meta.decode
        rows = input_ids.shape[0]
        if d is None or meta.prefills or d.seq_lens.shape[0] != rows or rows > quant_linear.KERNEL_MAX_ROWS:
            return None
        if self._first.q.data_ptr() != self._weights_at:
            return None  # the weights moved (a .to() after load): the per-op path reads them where they are
        tensors = [c for c in kv_caches if isinstance(c, torch.Tensor)]  # not a QuantizedKVCache
        if len(tensors) != len(kv_caches) or not all(
            c.dtype == torch.float32 and c.device.type == "cpu" and c.is_contiguous() for c in tensors
        ):
            return None
        lib = native.decode_model_f32_lib()
        if lib is None:
            return None
        pools = tuple(c.data_ptr() for c in tensors)
        if pools != self._pools:
            for i, ptr in enumerate(pools):
                self._layers[i].pool = ptr
            self._pools = pools
        h = model.embed_tokens(input_ids)  # [T, hidden], a new tensor: the kernel writes the result into it
        cos, sin = model.rope.cos_sin(positions, torch.float32)  # [T, 1, D/2]
        cos, sin = cos.contiguous(), sin.contiguous()
        _two, _heads, num_blocks, block_size, _dim = tensors[0].shape
        max_blocks = d.block_tables.shape[1]
        rc = lib.kvt_decode_model_f32(
            ctypes.addressof(self._layers),
            self.num_layers,
            h.data_ptr(),
            rows,
            self.hidden,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.inter,
            self.eps,
            cos.data_ptr(),
            sin.data_ptr(),
            meta.slot_mapping.data_ptr(),
            d.block_tables.data_ptr(),
            max_blocks,
            d.seq_lens.data_ptr(),
            num_blocks,
            block_size,
            self.head_dim**-0.5,
        )
        if rc == native.BAD_INDEX:
            raise IndexError(f"decode step: a slot, block table or length is outside the pool of {num_blocks} blocks")
        return h if rc == 0 else None
