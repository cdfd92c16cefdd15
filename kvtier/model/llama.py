"""One decoder for Llama 2/3.x, Mistral, Qwen2 and Qwen3.

The families differ only in flags of `ArchConfig`: q/k/v (and o) bias, per-head q/k RMSNorm
(Qwen3), rope scaling (llama3, linear) and tied embeddings. Numerics follow transformers:
RMSNorm in float32 then cast back, rope frequencies and cos/sin in float32 then cast, the
rotate-half rope convention.

Shapes: T = tokens of all sequences in the step, flattened; Hq/Hkv query/KV heads; D head_dim.
Projections are fused at load time (q|k|v into `qkv_proj`, gate|up into `gate_up_proj`): one
larger GEMM is faster than three small ones, most of all for decode-sized T.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.model import layer_ops
from kvtier.model.attention import AttentionBackend, AttentionMetadata, KVCache
from kvtier.model.hf_config import ArchConfig
from kvtier.model.linear import ONEDNN, GemmPlan, Linear, plan_for
from kvtier.model.lora import DOWN, GATE_UP, O_PROJ, QKV, LoRABatch

if TYPE_CHECKING:
    from kvtier.model.fused_decode import FusedDecode


class RMSNorm(nn.Module):
    """y = w * (x / rms(x)), computed in float32 and cast back before the weight, like HF."""

    def __init__(self, shape: int | tuple[int, ...], eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    native_f32 = False
    """Fused float32 kernel (layer_ops.add_rms_norm_f32): set for models with quantized weights."""

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), or (norm(x), x) without a residual: the residual
        stream carried beside the layers' outputs, as vLLM's layers do, so that the add fuses
        into the norm (one native pass for bfloat16 on CPU, csrc/layer_ops.c, which updates
        `residual` in place). Same sums as HF's `h = residual + h`."""
        normed = layer_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if normed is None and self.native_f32:
            normed = layer_ops.add_rms_norm_f32(x, residual, self.weight, self.eps)
        if normed is not None:
            return normed, x if residual is None else residual
        residual = x if residual is None else residual + x
        return self(residual), residual


class RotaryEmbedding:
    """Rope frequencies (float32, as HF computes them) and per-step cos/sin."""

    def __init__(self, arch: ArchConfig, device: torch.device) -> None:
        dim = arch.head_dim
        # explicit device: the model may be constructed under a meta-device context
        exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        inv_freq = 1.0 / (arch.rope_theta**exponent)  # [D/2] float32
        scaling = arch.rope_scaling
        if scaling is not None and scaling.rope_type == "linear":
            inv_freq = inv_freq / scaling.factor
        elif scaling is not None and scaling.rope_type == "llama3":
            # hf_config sets all three for llama3
            assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
            assert scaling.original_max_position_embeddings is not None
            inv_freq = _llama3_inv_freq(
                inv_freq,
                scaling.factor,
                scaling.low_freq_factor,
                scaling.high_freq_factor,
                scaling.original_max_position_embeddings,
            )
        self.inv_freq = inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, D/2] in `dtype`.

        HF builds cos over cat(freqs, freqs); both halves are equal, so one half is kept.
        """
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2] float32
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def _llama3_inv_freq(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, old_context_len: int
) -> torch.Tensor:
    """Llama 3.1 frequency scaling (as transformers' `_compute_llama3_parameters`)."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native_f32: bool = False) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, 1, D/2] -> x * cos + rotate_half(x) * sin (same rounding as HF);
    in place by the native kernel for bfloat16 on CPU (and float32 with `native_f32`), else a new
    tensor."""
    if layer_ops.rope_(x, cos, sin) or (native_f32 and layer_ops.rope_f32_(x, cos, sin)):
        return x
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    native_f32 = False
    """Fused float32 rope (layer_ops.rope_f32_): set for models with quantized weights."""

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        qkv_out = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
        self.qkv_proj = Linear(arch.hidden_size, qkv_out, bias=arch.qkv_bias, dtype=dtype)
        self.o_proj = Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=arch.o_bias, dtype=dtype)
        # Qwen3: q_norm rows for the Hq query heads, then k_norm rows for the Hkv key heads, so one
        # norm call covers q and k.  [Hq + Hkv, D]
        self.qk_norm = (
            RMSNorm((arch.num_heads + arch.num_kv_heads, arch.head_dim), arch.rms_norm_eps, dtype)
            if arch.qk_norm
            else None
        )
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        if lora is not None:
            lora.apply(self.layer_idx, QKV, x, qkv)
        qk = qkv[:, : num_qk_heads * self.head_dim].view(num_tokens, num_qk_heads, self.head_dim)
        v = qkv[:, num_qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        qk = apply_rope(qk, cos, sin, self.native_f32)  # [T, Hq + Hkv, D]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        self.backend.write_kv(k, v, kv_cache, meta)
        out = self.backend.forward(q, k, v, kv_cache, meta)  # [T, Hq * D]
        if lora is not None:
            return lora.apply(self.layer_idx, O_PROJ, out, self.o_proj(out))
        return self.o_proj(out)


class MLP(nn.Module):
    native_f32 = False
    """Fused float32 SiLU * up (layer_ops.silu_mul_f32): set for models with quantized weights."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias, dtype=dtype)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        if lora is not None:
            lora.apply(self.layer_idx, GATE_UP, x, gate_up)
        act = layer_ops.silu_mul(gate_up, self.intermediate_size)
        if act is None and self.native_f32:
            act = layer_ops.silu_mul_f32(gate_up, self.intermediate_size)
        if act is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
            act = F.silu(gate) * up
        if lora is not None:
            return lora.apply(self.layer_idx, DOWN, act, self.down_proj(act))
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, backend, dtype, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = MLP(arch, dtype, layer_idx)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the stream after the layer
        is their sum, which the next layer's input norm takes (see RMSNorm.add_norm)."""
        x, residual = self.input_layernorm.add_norm(h, residual)
        h = self.self_attn(x, cos, sin, kv_cache, meta, lora)
        x, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(x, lora), residual


class DecoderLM(nn.Module):
    """Embeddings, decoder layers, final norm and lm_head.

    `forward` returns the residual stream [T, hidden] before the final norm; `compute_logits`
    applies norm + lm_head to the rows that are sampled only (the lm_head is the largest GEMM
    of a small model, and a prefill samples one row out of thousands).
    """

    def __init__(
        self,
        arch: ArchConfig,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tie_word_embeddings: bool,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.tie_word_embeddings = tie_word_embeddings
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, backend, dtype, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False, dtype=dtype)
        self.tie_weights()
        self.rope = RotaryEmbedding(arch, device)
        self.requires_grad_(False)

    fused_decode: FusedDecode | None = None
    """A kvtier.model.fused_decode.FusedDecode where the loader found one applies (float32 with
    quantized projections): decode-only steps then run every layer in one native call."""

    weight_format = "dense"
    """How the projections hold their weights (kvtier.model.loader.WEIGHT_FORMATS); `dense` also
    where a quantized format was asked for but no projection of the checkpoint has one."""

    def tie_weights(self) -> None:
        """Share lm_head with embed_tokens (call again after anything that re-creates parameters)."""
        if self.tie_word_embeddings and isinstance(self.lm_head, Linear):  # not a QuantLinear
            self.lm_head.weight = self.embed_tokens.weight

    def plan_linears(self, *, pack: bool) -> GemmPlan | None:
        """Choose how the projections multiply (kvtier.model.linear): a GEMM plan measured once
        on this CPU (None outside bfloat16 on CPU), and, if `pack` (check `can_pack_linears`
        first) and the plan uses oneDNN, packed weights. A layer keeps its dense weight where
        the plan reads it (and the lm_head where it is tied to the embeddings). Returns the plan."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        body = [m for m in linears if m is not self.lm_head]
        plan = plan_for(body, self.embed_tokens.weight.dtype, self.embed_tokens.weight.device, packed=pack)
        for m in linears:
            m.plan = plan
            if pack and (plan is None or ONEDNN in plan.methods):
                tied = m is self.lm_head and self.tie_word_embeddings
                m.pack(keep_weight=tied or (plan is not None and plan.needs_dense))
        return plan

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] long; kv_caches[l] [2, Hkv, num_blocks, block_size, D] (a tensor, or
        a QuantizedKVCache when the KV dtype is not the model dtype: see kvtier.model.attention).
        `lora`: the step's adapters and their rows (kvtier.model.lora), None when no row has one
        (only then may the one-call fused decode run: it knows no adapters).
        Returns hidden states [T, hidden] (final norm not applied)."""
        if self.fused_decode is not None and lora is None and meta.decode is not None and not meta.prefills:
            fused = self.fused_decode(self, input_ids, positions, kv_caches, meta)
            if fused is not None:
                return fused
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rope.cos_sin(positions, h.dtype)  # [T, 1, D/2], shared by all layers
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, cos, sin, kv_cache, meta, lora)
        return residual + h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (the sampled rows only) -> float32 logits [N, vocab]."""
        return self.lm_head(self.norm(hidden)).float()
