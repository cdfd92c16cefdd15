"""Quantized KV cache: dtypes, per-block scales, quantize on write, dequantize on gather.

`kv_cache_dtype` names how every cached token is stored, in the device pool and in every tier:

    name        storage                  bytes/elem   scale
    auto        the model dtype          2 or 4       none
    bfloat16    torch.bfloat16           2            none
    float16     torch.float16            2            none
    float32     torch.float32            4            none
    fp8_e4m3    torch.float8_e4m3fn      1            per (layer, K/V, KV head, block), float32
    fp8_e5m2    torch.float8_e5m2        1            per (layer, K/V, KV head, block), float32
    int8        torch.int8 (symmetric)   1            per (layer, K/V, KV head, block), float32

A quantized layer cache is a `QuantizedKVCache`: the pool view `data [2, Hkv, num_blocks,
block_size, D]` in the storage dtype and `scales [2, Hkv, num_blocks]` float32, with
    value = data * scale
Scales are dynamic (no calibration): on write, a token that fits its block's scale is stored as
is; a block whose scale must grow is rewritten whole (its earlier tokens requantized to the new
scale = block amax / qmax); a write at a block's slot 0 starts the block afresh. Static per-layer
scales (a checkpoint's `k_scale` / `v_scale`) replace the dynamic ones and never change.

Reads (attention gathers) dequantize only the gathered blocks. On CPU, gather + convert + scale
run as one `torch.compile`d loop (eager, that is 4-5 passes, and torch's own fp8 conversion is
scalar); `dequantize`, the eager fallback, moves fp8 bits into the target float format with
integer ops (sign-extend, shift, mask), which yields value * 2^-(bias difference) exactly, and
folds 2^(bias difference) into the scale multiply. Every fp8 value, subnormals included, maps
exactly; stored bytes are never NaN or inf because quantize saturates.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2", "int8")

MIN_SCALE = 1e-30
"""Floor of a dynamic scale: an all-zero block must not divide by zero."""
MAX_SCALE = 128.0
"""Ceiling of a scale (|x| up to 128 * qmax is representable): keeps scale * 2^120, the fp8 ->
bfloat16 multiplier, inside float32/bfloat16 range. Larger values saturate."""


@dataclass(frozen=True)
class KVDtype:
    """How the KV cache stores one element."""

    name: str
    """The `kv_cache_dtype` name, resolved ('auto' becomes the model dtype's name)."""
    storage: torch.dtype
    qmax: float | None
    """Largest representable |value| / scale; None when unquantized (no scales)."""

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    @property
    def elem_bytes(self) -> int:
        return self.storage.itemsize


_FLOAT_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_QUANTIZED = {
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
    "int8": (torch.int8, 127.0),
}


def resolve_kv_dtype(kv_cache_dtype: str | torch.dtype, model_dtype: torch.dtype) -> KVDtype:
    """'auto' -> the model dtype; a name of KV_CACHE_DTYPES (or a float torch.dtype) -> its spec."""
    if isinstance(kv_cache_dtype, torch.dtype):
        names = {v: k for k, v in _FLOAT_NAMES.items()}
        if kv_cache_dtype not in names:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}"
            )
        kv_cache_dtype = names[kv_cache_dtype]
    if kv_cache_dtype == "auto":
        kv_cache_dtype = str(model_dtype).removeprefix("torch.")
    if kv_cache_dtype in _FLOAT_NAMES:
        return KVDtype(kv_cache_dtype, _FLOAT_NAMES[kv_cache_dtype], None)
    if kv_cache_dtype in _QUANTIZED:
        storage, qmax = _QUANTIZED[kv_cache_dtype]
        return KVDtype(kv_cache_dtype, storage, qmax)
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")


# -- quantize / dequantize ---------------------------------------------------------------------


def quantize(x: torch.Tensor, scale: torch.Tensor, kv_dtype: KVDtype) -> torch.Tensor:
    """x / scale, saturated to +-qmax, in the storage dtype (int8: rounded to nearest).
    `scale` broadcasts against x (float32)."""
    q = (x.float() / scale).clamp_(-kv_dtype.qmax, kv_dtype.qmax)
    if kv_dtype.storage == torch.int8:
        q = q.round_()
    return q.to(kv_dtype.storage)


# fp8 format -> (mantissa bits, exponent bias); target float -> (int view, mantissa bits, exponent bias)
_FP8_LAYOUT = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}
_FLOAT_LAYOUT = {
    torch.bfloat16: (torch.int16, 7, 127),
    torch.float16: (torch.int16, 10, 15),
    torch.float32: (torch.int32, 23, 127),
}


def _fp8_bit_cast(storage: torch.dtype, out_dtype: torch.dtype) -> tuple[int, int, float]:
    """(left shift, mask, multiplier) such that view(out_dtype)((int(fp8 bits as int8) << shift) & mask)
    * multiplier == the fp8 value. The fp8 exponent/mantissa land in the low bits of the target's
    exponent/mantissa, so the result is the value times 2^-(bias_out - bias_fp8), normals and
    subnormals alike (the target's exponent range covers fp8's)."""
    mant_in, bias_in = _FP8_LAYOUT[storage]
    int_dtype, mant_out, bias_out = _FLOAT_LAYOUT[out_dtype]
    shift = mant_out - mant_in
    bits = int_dtype.itemsize * 8
    mask = (0x7F << shift) | (1 << (bits - 1))  # magnitude bits + the sign bit
    if mask >= 1 << (bits - 1):
        mask -= 1 << bits  # as a signed integer of the view's width
    return shift, mask, 2.0 ** (bias_out - bias_in)


def dequantize(data: torch.Tensor, scale: torch.Tensor, kv_dtype: KVDtype, out_dtype: torch.dtype) -> torch.Tensor:
    """data (storage dtype) * scale -> out_dtype. `scale` [...] float32 broadcasts over data's
    trailing dims after unsqueezing: pass it shaped to broadcast (e.g. [2, Hkv, n, 1, 1])."""
    if data.dtype in _FP8_LAYOUT and out_dtype in _FLOAT_LAYOUT:
        shift, mask, multiplier = _fp8_bit_cast(data.dtype, out_dtype)
        int_dtype = _FLOAT_LAYOUT[out_dtype][0]
        bits = data.view(torch.int8).to(int_dtype)  # sign-extends: bits above 7 copy the sign
        bits.bitwise_left_shift_(shift).bitwise_and_(mask)
        out = bits.view(out_dtype)
        return out.mul_((scale * multiplier).to(out_dtype))
    out = data.to(out_dtype)
    return out.mul_(scale.to(out_dtype))


def dequantize_reference(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 data * scale via torch's own conversions (tests, slow paths)."""
    return data.float() * scale


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as int8 (same bytes): CPU index_copy_ has no float8 kernels."""
    return t.view(torch.int8) if t.dtype in _FP8_LAYOUT else t


# -- the per-layer cache ------------------------------------------------------------------------


@dataclass(slots=True)
class WritePlan:
    """Per step, shared by every layer: which blocks the new tokens touch.

    A quantized write stores tokens that fit their block's scale as they are; a block that must
    grow is rewritten whole: dequantize its earlier tokens, place the new ones, take the block's
    new amax, requantize. A block whose slot 0 is written this step starts afresh (earlier
    content dropped, its other slots zero).
    """

    blocks: torch.Tensor
    """[U] long: distinct blocks written this step (sorted)."""
    token_block: torch.Tensor
    """[T] long: index into `blocks` of each new token's block."""
    token_offset: torch.Tensor
    """[T] long: each new token's slot inside its block."""
    keep: torch.Tensor
    """[U] float32: 0.0 where the block starts afresh (the step writes its slot 0), else 1.0."""
    token_block_ids: torch.Tensor
    """[T] long: each new token's block id."""
    token_keep: torch.Tensor
    """[T] bool: the token's block keeps its earlier content (does not start afresh)."""

    @staticmethod
    def build(slot_mapping: torch.Tensor, block_size: int) -> WritePlan:
        block_of_slot = torch.div(slot_mapping, block_size, rounding_mode="floor")
        blocks, token_block = torch.unique(block_of_slot, sorted=True, return_inverse=True)
        token_offset = slot_mapping - block_of_slot * block_size
        keep = torch.ones(blocks.shape[0], dtype=torch.float32, device=slot_mapping.device)
        keep[token_block[token_offset == 0]] = 0.0
        return WritePlan(blocks, token_block, token_offset, keep, block_of_slot, keep[token_block] > 0)


def _requantize_blocks(
    data: torch.Tensor, scales: torch.Tensor, kv: torch.Tensor, plan_blocks: torch.Tensor,
    keep: torch.Tensor, token_block: torch.Tensor, token_offset: torch.Tensor, qmax: float, rounded: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The touched blocks rewritten with the new tokens: (data [2, Hkv, U, bs, D] in the storage
    dtype, scales [2, Hkv, U]). Branch-free (no host sync); an unchanged scale requantizes earlier
    tokens to exactly the same bytes."""
    old_scale = scales.index_select(2, plan_blocks) * keep  # [2, Hkv, U]
    blocks = data.index_select(2, plan_blocks).to(torch.float32) * old_scale[..., None, None]
    blocks[:, :, token_block, token_offset] = kv.to(torch.float32)  # kv [2, Hkv, T, D]
    new_scale = (blocks.abs().amax(dim=(-1, -2)) / qmax).clamp(MIN_SCALE, MAX_SCALE)
    q = (blocks / new_scale[..., None, None]).clamp(-qmax, qmax)
    if rounded:
        q = q.round()
    return q.to(data.dtype), new_scale


@functools.cache
def _compiled(fn):
    """fn through torch.compile (one fused loop instead of many passes), or None when disabled
    or unavailable. Compiled once per process: seconds, cached on disk by torch.

    Used for the gather + dequantize of attention reads: eager, that is 4-5 passes over the
    gathered blocks (and torch's own fp8 conversion is scalar); fused, one vectorised loop."""
    if os.environ.get(_NO_FUSE_ENV, "") not in ("", "0"):
        return None
    try:
        return torch.compile(fn, dynamic=True)
    except Exception:  # noqa: BLE001 - no compiler backend: eager ops work everywhere
        logger.warning("torch.compile is unavailable; KV quantization runs unfused")
        return None


def _run_fused(fn, *args, eager=None):
    """fn(*args), compiled on CPU when possible, else `eager(*args)` (default fn); a compiler
    failure falls back to eager for good."""
    compiled = _compiled(fn) if args[0].device.type == "cpu" else None
    if compiled is not None:
        try:
            return compiled(*args)
        except Exception:  # a compiler problem must not stop serving
            logger.exception("fused KV quantization failed; using eager ops from now on")
            os.environ[_NO_FUSE_ENV] = "1"
            _compiled.cache_clear()
    return (eager or fn)(*args)


_NO_FUSE_ENV = "KVTIER_NO_FUSED_KV_QUANT"
"""Set to 1 to run KV quantization with eager ops only (no torch.compile)."""


class QuantizedKVCache:
    """One layer's quantized (or only down-cast) paged KV cache: what attention backends receive
    instead of a plain tensor when the KV dtype is not the model dtype.

        data    [2, Hkv, num_blocks, block_size, D]   storage dtype (a view of the runner's pool)
        scales  [2, Hkv, num_blocks] float32          (a view of the runner's kv_scales), or None
    """

    __slots__ = ("data", "scales", "kv_dtype", "static_scales")

    def __init__(self, data: torch.Tensor, scales: torch.Tensor | None, kv_dtype: KVDtype,
                 static_scales: tuple[float, float] | None = None) -> None:
        self.data = data
        self.scales = scales
        self.kv_dtype = kv_dtype
        self.static_scales = static_scales
        """(K scale, V scale) of this layer from the checkpoint; None = dynamic per-block scales."""

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, plan: WritePlan | None) -> None:
        """Store k, v [T, Hkv, D] at `slot_mapping` [T]. Dynamic scales: tokens that fit their
        block's scale are stored as they are, blocks that must grow are rewritten whole (see
        WritePlan), so every token of a block shares the block's scale."""
        two, num_kv_heads, num_blocks, block_size, head_dim = self.data.shape
        flat = _raw(self.data).view(2, num_kv_heads, num_blocks * block_size, head_dim)
        kv = torch.stack((k, v)).transpose(1, 2)  # [2, Hkv, T, D]
        if self.scales is None:
            flat.index_copy_(2, slot_mapping, kv.to(self.data.dtype))
            return
        if self.static_scales is not None:
            scale = self.scales[:, :, :1, None]  # constant over blocks: [2, Hkv, 1, 1]
            flat.index_copy_(2, slot_mapping, _raw(quantize(kv, scale, self.kv_dtype)))
            return
        assert plan is not None
        # Most decode tokens fit their block's scale: quantize just them. Blocks that start afresh
        # or whose scale must grow are rewritten whole. Per block, the choice depends only on that
        # block's tokens, never on the rest of the batch.
        block_scale = self.scales.index_select(2, plan.token_block_ids)  # [2, Hkv, T]
        fits = kv.abs().amax(-1).float().le(block_scale * self.kv_dtype.qmax).all(0).all(0)  # [T]
        fits &= plan.token_keep
        if bool(fits.all()):
            flat.index_copy_(2, slot_mapping, _raw(quantize(kv, block_scale[..., None], self.kv_dtype)))
            return
        rewrite = torch.zeros_like(plan.keep, dtype=torch.bool)
        rewrite[plan.token_block[~fits]] = True  # [U]
        in_rewrite = rewrite[plan.token_block]  # [T]
        fast = ~in_rewrite
        if bool(fast.any()):
            quantized = quantize(kv[:, :, fast], block_scale[:, :, fast, None], self.kv_dtype)
            flat.index_copy_(2, slot_mapping[fast], _raw(quantized))
        sub = rewrite.nonzero().squeeze(1)  # [R] into plan.blocks
        sub_index = torch.cumsum(rewrite, 0) - 1  # plan block index -> rewrite index
        blocks = plan.blocks.index_select(0, sub)
        data, scales = _requantize_blocks(
            self.data, self.scales, kv[:, :, in_rewrite], blocks, plan.keep.index_select(0, sub),
            sub_index[plan.token_block[in_rewrite]], plan.token_offset[in_rewrite], self.kv_dtype.qmax,
            self.kv_dtype.storage == torch.int8,
        )
        _raw(self.data).index_copy_(2, blocks, _raw(data))
        self.scales.index_copy_(2, blocks, scales)

    def gather(self, block_ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Blocks `block_ids` [n] of K and V, dequantized: [2, Hkv, n, block_size, D] in out_dtype."""
        if self.scales is None:
            return self.data.index_select(2, block_ids).to(out_dtype)
        return _run_fused(_gather_dequantize, self.data, self.scales, block_ids, out_dtype,
                          eager=self._gather_eager)

    def _gather_eager(self, data: torch.Tensor, scales: torch.Tensor, block_ids: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
        scale = scales.index_select(2, block_ids)[..., None, None]
        return dequantize(data.index_select(2, block_ids), scale, self.kv_dtype, out_dtype)


def _gather_dequantize(data: torch.Tensor, scales: torch.Tensor, block_ids: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """gather + convert + scale, written for torch.compile to fuse into one loop."""
    x = data.index_select(2, block_ids).to(torch.float32)
    scale = scales.index_select(2, block_ids)[..., None, None]
    return (x * scale).to(out_dtype)
