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
    int8_rot    int8 of K and V rotated  1            as int8
    int8_tok    int8 of K and V rotated  1            per (layer, K/V, KV head, token), float16
    fp8_e4m3_rot  fp8_e4m3 of K, V rotated  1         as fp8_e4m3

`*_rot`: K and V are rotated by a fixed orthonormal Hadamard matrix along the head dimension
before they are quantized (as QuaRot and SpinQuant do for weights and KV). A real model's keys
have a few outlier channels (rope pairs that carry most of the energy); with one scale per
block those channels set the scale and every other channel is quantized coarsely. The rotation
spreads each channel's energy over all of them, so the block scale fits every channel. Reads
rotate back (gathers), or attend in the rotated basis (the native decode kernel: q is rotated,
the output rotated back), so no kernel changes and no extra bytes.

`int8_tok` also gives every token its own float16 scale (2 bytes per token, K/V and KV head: a
block of 16 tokens x 64 dims holds 1,056 bytes against int8's 1,028, 1.03x). Each token is
quantized once, to its own range: no token is requantized when its block's scale grows, and one
token's large values do not coarsen its neighbours'. kvtier measures where a 1-byte KV's error
comes from with `benchmarks/kv_error_sources.py` (docs/benchmarks.md).

A quantized layer cache is a `QuantizedKVCache`: the pool view `data [2, Hkv, num_blocks,
block_size, D]` in the storage dtype and `scales [2, Hkv, num_blocks]` float32, with
    value = data * scale
Scales are dynamic (no calibration): on write, a token that fits its block's scale is stored as
is; a block whose scale must grow is rewritten whole (its earlier tokens requantized to the new
scale = block amax / qmax); a write at a block's slot 0 starts the block afresh. Static per-layer
scales (a checkpoint's `k_scale` / `v_scale`) replace the dynamic ones and never change.

Reads (attention gathers) dequantize only the gathered blocks, in float32 (value * scale, then
the model dtype). fp8 becomes float32 without a float8 conversion: the byte, sign-extended and
shifted, puts its exponent and mantissa in the low bits of float32's, which is the value times
2^-(bias difference), exactly (subnormals too); the scale multiply restores the power of two.
Stored bytes are never NaN or inf because quantize saturates.

On CPU, writes and gathers of 1-byte dtypes run as native kernels (kvtier/model/csrc/kv_quant.c,
one call per layer) that produce the same bytes as the torch ops here, which serve everywhere
else (another device, no C compiler, `KVTIER_NO_NATIVE=1`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.model import native
from kvtier.model.kv_names import KV_CACHE_DTYPES

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
    rotated: bool = False
    """Keys and values are stored rotated by a fixed orthonormal Hadamard matrix along the head
    dimension (`hadamard`): an outlier channel's energy spreads over every channel, so one scale
    per block fits all of them. Attention reads them back in the rotated basis (see
    QuantizedKVCache.rotation); the same bytes per token as the unrotated dtype."""
    per_token: bool = False
    """One float16 scale per token (and K/V, KV head) instead of one float32 per block: a token is
    quantized once, to its own range, and never requantized when a later token of its block is
    larger."""

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float16 if self.per_token else torch.float32

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
    if kv_cache_dtype == "int8_tok":
        return KVDtype(kv_cache_dtype, torch.int8, 127.0, rotated=True, per_token=True)
    if kv_cache_dtype.endswith("_rot") and kv_cache_dtype.removesuffix("_rot") in _QUANTIZED:
        storage, qmax = _QUANTIZED[kv_cache_dtype.removesuffix("_rot")]
        return KVDtype(kv_cache_dtype, storage, qmax, rotated=True)
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")


def hadamard(dim: int) -> torch.Tensor:
    """An orthonormal, symmetric [dim, dim] float32 matrix with entries of equal magnitude (within
    each block): Sylvester's Hadamard matrix over the largest power of two dividing `dim`,
    repeated on the diagonal. H @ H = I, so rotating by it twice restores a vector."""
    size = dim & -dim  # largest power of two dividing dim
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    h = h / size**0.5
    return torch.block_diag(*([h] * (dim // size)))


# -- quantize / dequantize ---------------------------------------------------------------------


def quantize(x: torch.Tensor, scale: torch.Tensor, kv_dtype: KVDtype) -> torch.Tensor:
    """x / scale, saturated to +-qmax, in the storage dtype (int8: rounded to nearest).
    `scale` broadcasts against x (float32)."""
    qmax = kv_dtype.qmax
    assert qmax is not None, f"{kv_dtype.name} is not quantized"
    q = (x.float() / scale).clamp_(-qmax, qmax)
    if kv_dtype.storage == torch.int8:
        q = q.round_()
    return q.to(kv_dtype.storage)


_FP8_F32_BITS = {
    # fp8 storage -> (left shift, mask, 2^(127 - fp8 exponent bias)): the byte sign-extended to int32
    # and shifted puts the fp8 exponent and mantissa in the low bits of float32's; masked to sign +
    # 7 magnitude bits, it is the fp8 value * 2^-(127 - bias), exactly (subnormals too)
    torch.float8_e4m3fn: (20, 0x87F00000 - (1 << 32), 2.0**120),
    torch.float8_e5m2: (21, 0x8FE00000 - (1 << 32), 2.0**112),
}


def dequantize(data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """data (storage dtype) * scale -> out_dtype, computed in float32: exactly
    `(data.float() * scale).to(out_dtype)`, with fp8 converted by integer ops (vectorised on CPU,
    unlike torch's own fp8 conversion there). `scale` float32 broadcasts against data: pass it
    shaped to (e.g. [2, Hkv, n, 1, 1]). The native gather computes the same bytes."""
    if data.dtype in _FP8_F32_BITS:
        shift, mask, unbias = _FP8_F32_BITS[data.dtype]
        bits = data.view(torch.int8).to(torch.int32).bitwise_left_shift_(shift).bitwise_and_(mask)
        return bits.view(torch.float32).mul_(scale * unbias).to(out_dtype)
    return (data.to(torch.float32) * scale).to(out_dtype)


def dequantize_reference(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 data * scale via torch's own conversions (tests, slow paths)."""
    return data.float() * scale


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as int8 (same bytes): CPU index_copy_ has no float8 kernels."""
    return t.view(torch.int8) if t.dtype in _FP8_F32_BITS else t


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
    data: torch.Tensor,
    scales: torch.Tensor,
    kv: torch.Tensor,
    plan_blocks: torch.Tensor,
    keep: torch.Tensor,
    token_block: torch.Tensor,
    token_offset: torch.Tensor,
    qmax: float,
    rounded: bool,
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


class QuantizedKVCache:
    """One layer's quantized (or only down-cast) paged KV cache: what attention backends receive
    instead of a plain tensor when the KV dtype is not the model dtype.

        data    [2, Hkv, num_blocks, block_size, D]   storage dtype (a view of the runner's pool)
        scales  [2, Hkv, num_blocks] float32          (a view of the runner's kv_scales), or None

    Writes and gathers of 1-byte dtypes on CPU run the native kernels (kvtier.model.native) when
    they are available: one call per layer instead of dozens of small torch ops, the same bytes.
    """

    __slots__ = ("_native_storage", "data", "kv_dtype", "rotation", "scales", "static_scales")

    def __init__(
        self,
        data: torch.Tensor,
        scales: torch.Tensor | None,
        kv_dtype: KVDtype,
        static_scales: tuple[float, float] | None = None,
        rotation: torch.Tensor | None = None,
    ) -> None:
        self.data = data
        self.scales = scales
        self.kv_dtype = kv_dtype
        self.static_scales = static_scales
        """(K scale, V scale) of this layer from the checkpoint; None = dynamic per-block scales."""
        self.rotation = rotation if rotation is not None or not kv_dtype.rotated else _hadamard_cached(data.shape[-1])
        """[D, D] float32 (symmetric, orthonormal) for a rotated dtype, else None: the cache holds
        k @ R and v @ R. `gather` rotates back; a kernel reading the pool directly attends with
        q @ R and rotates its output by R (q . k = (q R) . (k R), sum p v = (sum p v R) R)."""
        self._native_storage = (
            native.KV_STORAGE.get(data.dtype)
            if scales is not None
            and data.dtype in native.SCALED_STORAGE
            and data.device.type == "cpu"
            and data.is_contiguous()
            and scales.is_contiguous()
            and not kv_dtype.per_token
            else None
        )

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: WritePlan | Callable[[], WritePlan] | None = None,
    ) -> None:
        """Store k, v [T, Hkv, D] at `slot_mapping` [T]. Dynamic scales: tokens that fit their
        block's scale are stored as they are, blocks that must grow are rewritten whole (see
        WritePlan), so every token of a block shares the block's scale. `plan`: the step's
        WritePlan, or a function that builds it (the native kernel needs none); None: built here."""
        if self.rotation is not None:
            k, v = rotate(k, self.rotation), rotate(v, self.rotation)
        if self._native_storage is not None and self._write_native(k, v, slot_mapping):
            return
        _two, num_kv_heads, num_blocks, block_size, head_dim = self.data.shape
        flat = _raw(self.data).view(2, num_kv_heads, num_blocks * block_size, head_dim)
        kv = torch.stack((k, v)).transpose(1, 2)  # [2, Hkv, T, D]
        qmax = self.kv_dtype.qmax
        if self.kv_dtype.per_token:  # each token its own scale: quantized once, never rewritten
            assert self.scales is not None and qmax is not None  # per-token dtypes are quantized
            scale = token_scales(kv, qmax)  # [2, Hkv, T] float16
            flat.index_copy_(2, slot_mapping, quantize(kv, scale.float()[..., None], self.kv_dtype))
            self.scales.view(2, num_kv_heads, num_blocks * block_size).index_copy_(2, slot_mapping, scale)
            return
        if self.scales is None:
            flat.index_copy_(2, slot_mapping, kv.to(self.data.dtype))
            return
        assert qmax is not None  # only a quantized dtype has scales
        if self.static_scales is not None:
            scale = self.scales[:, :, :1, None]  # constant over blocks: [2, Hkv, 1, 1]
            flat.index_copy_(2, slot_mapping, _raw(quantize(kv, scale, self.kv_dtype)))
            return
        if plan is None:
            plan = WritePlan.build(slot_mapping, block_size)
        elif not isinstance(plan, WritePlan):
            plan = plan()
        # Most decode tokens fit their block's scale: quantize just them. Blocks that start afresh
        # or whose scale must grow are rewritten whole. Per block, the choice depends only on that
        # block's tokens, never on the rest of the batch.
        block_scale = self.scales.index_select(2, plan.token_block_ids)  # [2, Hkv, T]
        fits = kv.abs().amax(-1).float().le(block_scale * qmax).all(0).all(0)  # [T]
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
            self.data,
            self.scales,
            kv[:, :, in_rewrite],
            blocks,
            plan.keep.index_select(0, sub),
            sub_index[plan.token_block[in_rewrite]],
            plan.token_offset[in_rewrite],
            qmax,
            self.kv_dtype.storage == torch.int8,
        )
        _raw(self.data).index_copy_(2, blocks, _raw(data))
        self.scales.index_copy_(2, blocks, scales)

    def gather(self, block_ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Blocks `block_ids` [n] of K and V, dequantized: [2, Hkv, n, block_size, D] in out_dtype."""
        if self.scales is None:
            return self.data.index_select(2, block_ids).to(out_dtype)
        if self.rotation is not None:  # back from the rotated basis, in float32
            return rotate(self._gather(block_ids, torch.float32), self.rotation).to(out_dtype)
        return self._gather(block_ids, out_dtype)

    def _gather(self, block_ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if self._native_storage is not None and out_dtype in native.FLOAT_KIND:
            out = self._gather_native(block_ids, out_dtype)
            if out is not None:
                return out
        assert self.scales is not None  # gather() reads an unscaled cache itself
        scale = self.scales.index_select(2, block_ids)
        scale = scale.float()[..., None] if self.kv_dtype.per_token else scale[..., None, None]
        return dequantize(self.data.index_select(2, block_ids), scale, out_dtype)

    # -- native kernels (kvtier/model/csrc/kv_quant.c) --------------------------------------

    def _gather_native(self, block_ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
        lib = native.kv_quant_lib()
        if lib is None or block_ids.dtype != torch.long or block_ids.device.type != "cpu":
            return None
        assert self.scales is not None  # _native_storage is set only with scales
        block_ids = block_ids.contiguous()
        _two, heads, num_blocks, block_size, dim = self.data.shape
        out = torch.empty((2, heads, block_ids.numel(), block_size, dim), dtype=out_dtype)
        rc = lib.kvt_gather(
            self.data.data_ptr(),
            self.scales.data_ptr(),
            heads,
            num_blocks,
            block_size * dim,
            self._native_storage,
            block_ids.data_ptr(),
            block_ids.numel(),
            native.FLOAT_KIND[out_dtype],
            out.data_ptr(),
        )
        if rc == native.BAD_INDEX:
            raise IndexError(f"KV gather: a block id is outside 0 .. {num_blocks - 1}")
        return out if rc == 0 else None

    def _write_native(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
        """True when the native kernel stored the tokens; False: use the torch ops."""
        lib = native.kv_quant_lib()
        if (
            lib is None
            or k.dtype != v.dtype
            or k.dtype not in native.FLOAT_KIND
            or slot_mapping.dtype != torch.long
            or k.device.type != "cpu"
            or v.device.type != "cpu"
        ):
            return False
        assert self.scales is not None  # _native_storage is set only with scales
        _two, heads, num_blocks, block_size, dim = self.data.shape
        k, v = _rows_contiguous(k), _rows_contiguous(v)
        slot_mapping = slot_mapping.contiguous()
        rc = lib.kvt_write(
            self.data.data_ptr(),
            self.scales.data_ptr(),
            heads,
            num_blocks,
            block_size,
            dim,
            self._native_storage,
            int(self.static_scales is not None),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            native.FLOAT_KIND[k.dtype],
            slot_mapping.data_ptr(),
            slot_mapping.numel(),
        )
        if rc == native.BAD_INDEX:
            raise IndexError(f"KV write: a slot is outside 0 .. {num_blocks * block_size - 1}")
        return rc == 0


FP16_MIN_SCALE, FP16_MAX_SCALE = 2.0**-14, 2.0**15
"""Per-token float16 scales stay normal (full precision) and finite: a token whose largest |value| is
below 2^-14 * qmax is quantized a little coarser; one above 2^15 * qmax saturates."""


def token_scales(kv: torch.Tensor, qmax: float) -> torch.Tensor:
    """One scale per token: kv [..., T, D] -> float16 [..., T] (|value| max / qmax, clamped)."""
    return (kv.abs().amax(-1).float() / qmax).clamp_(FP16_MIN_SCALE, FP16_MAX_SCALE).to(torch.float16)


@functools.cache
def _hadamard_cached(dim: int) -> torch.Tensor:
    return hadamard(dim)


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ rotation [D, D], in float32."""
    return x.float() @ rotation


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with each token's H x D values contiguous (any stride between tokens)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()
