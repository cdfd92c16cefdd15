"""Projections whose weights stay quantized: GGUF files served from their quantized form, and 8-bit
weight-only quantization of a float checkpoint (`quantization="int8"`, vLLM's flag name).

A decode step reads every weight of the model once, so its time is the weights' bytes over the
memory bandwidth: SmolLM2-135M's Q4_1 file is 97 MB, the same model dequantized to bfloat16 270 MB.
`QuantWeight` keeps a weight [N, K] in blocks of 32 elements of a row, each with a float16 scale d
and, for affine formats, a float16 offset m (W = d q + m), in one of three formats:

* `q8`: q int8, one byte per element. GGUF Q8_0 as it is; Q5_0, Q5_1 and Q5_K unpacked to one
  byte (exact); `quantize_int8` of a float weight (symmetric, d = max|w| / 127 per block).
* `q4`: q 0..15, two per byte in GGUF's nibble order. Q4_0 (m = -8 d) and Q4_1 as they are, Q4_K
  with each 32-element sub-block's scale and min folded into d and m (rounded to float16: a
  relative error under 2^-11 on the scale, far below the 4-bit step).
* `q8s16`: `q8` with one more int8 scale s per 16-element half of a block (W = (d s) q + m; 34
  bytes a block, the two scales after the 32 values, and d: 36 bytes per 32 elements). GGUF Q6_K
  unpacked to one byte (q = its 6-bit value - 32, d its super-block's float16 scale repeated per
  block, s its int8 16-element scales): exact, as d s is exact in float32, so W holds the float32
  values of GGUF's own dequantization bit for bit (nothing is rounded to float16, unlike Q4_K's
  folded scales). 1.37x the bytes of Q6_K (288 per 256 elements against 210), 0.28x float32.

Float tensors are not repacked: those projections stay dense in the model dtype. Parts of one
fused projection (q|k|v, gate|up) in different formats are joined as `q8s16` where one of them is
(q8 and q4 parts with s = 1, keeping their d and m), else as `q8` (q4 unpacks to q8 exactly):
either way exactly.

`QuantLinear` holds its weight interleaved (`QuantWeight.interleave`): each row's blocks in groups of
8 whose elements are reordered so that the kernel's integer multiply-adds leave one block per vector
lane (the layout is described in csrc/quant_gemm.c). It multiplies up to `KERNEL_MAX_ROWS` rows with
the native kernel on the quantized bytes, x meeting them as int16 per block of 32 (exact integer
products), and more rows (a prefill chunk) by dequantizing the weight into a scratch tensor of the
input's dtype and running a dense GEMM. Without the native library (no AVX2/FMA/F16C, no compiler,
KVTIER_NO_NATIVE=1) both use torch ops on the dequantized weight, with the same float32 values of W.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.model import native

BLOCK = 32
HALF = BLOCK // 2
Q8, Q4, Q8S16 = "q8", "q4", "q8s16"
_FMT_CODE = {Q8: 0, Q4: 1, Q8S16: 2}  # KVT_Q8, KVT_Q4, KVT_Q8S16 of csrc/quant_gemm.c
_S16_BLOCK = BLOCK + 2
"""q8s16 bytes per block: its 32 int8 values, then the int8 scales of elements 0..15 and 16..31."""
_X_KIND = {torch.float32: 0, torch.bfloat16: 1}

ACTIVATIONS_ENV = "KVTIER_QUANT_ACTIVATIONS"
"""Earlier versions chose here how the decode kernel met x (float, int8 or int16). x now always meets
the weights as int16 per block of 32 (a relative step of 3e-5, exact integer products; what the
three cost and gained is in docs/benchmarks.md): any other value is refused when a model loads."""

GROUP = 8
"""Blocks per interleaved group (GROUP of csrc/quant_gemm.c)."""

_ELEM_TO_POS = torch.tensor([(i // 2) * 16 + 2 * j + (i % 2) for j in range(GROUP) for i in range(BLOCK)])
"""Element 32 j + i of a group (block j) -> its position in the interleaved order."""
_POS_TO_ELEM = torch.argsort(_ELEM_TO_POS)

KERNEL_MAX_ROWS = 128
"""Batches of up to this many rows run the native kernel on the quantized bytes; larger ones
dequantize and run a dense GEMM. On SmolLM2's shapes (2-vCPU EPYC, AVX-512) the kernel is ahead of
dequantize + GEMM up to 128 rows (by 4.7x at 16, 1.3x at 128) and about even at 512
(`benchmarks/quant_gemm.py`)."""

QUANTIZATIONS = ("int8",)
"""Weight-only quantizations of a float checkpoint at load (`quantization=`)."""

GGUF_REPACKED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
"""GGUF tensor types served quantized (every block type kvtier.model.gguf reads); others (float
tensors) are loaded in the model dtype."""


def _q_width(fmt: str, k: int) -> int:
    """Bytes of q per row of k elements."""
    return k if fmt == Q8 else k // 2 if fmt == Q4 else k // BLOCK * _S16_BLOCK


@dataclasses.dataclass
class QuantWeight:
    """A weight [n, k] in blocks of 32 (see the module docstring)."""

    fmt: str
    q: torch.Tensor  # uint8 [n, k] (q8, int8 values), [n, k / 2] (q4) or [n, 34 k / 32] (q8s16, with s)
    d: torch.Tensor  # float16 [n, k / 32]
    m: torch.Tensor | None  # float16 [n, k / 32], or None (symmetric)
    n: int
    k: int
    interleaved: bool = False
    """Whole groups of 8 blocks in the kernel's interleaved order (see `interleave`); else GGUF order."""

    def __post_init__(self) -> None:
        if self.fmt not in _FMT_CODE:
            raise ValueError(f"unknown quantized weight layout {self.fmt!r}")
        if self.k % BLOCK:
            raise ValueError(f"a quantized weight needs in_features divisible by {BLOCK}, got {self.k}")
        want = {"q": (self.n, _q_width(self.fmt, self.k)), "d": (self.n, self.k // BLOCK)}
        if self.m is not None:
            want["m"] = (self.n, self.k // BLOCK)
        for name, shape in want.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"quantized weight {name} has shape {got}, expected {shape}")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    @property
    def _grouped(self) -> int:
        """Elements of a row in whole groups of GROUP blocks (interleaved when `interleaved`)."""
        return self.k // (GROUP * BLOCK) * GROUP * BLOCK

    def _ints(self) -> torch.Tensor:
        """The q values [n, k] in element order: int8 (q8, q8s16) or uint8 0..15 (q4)."""
        g = self._grouped if self.interleaved else 0
        if self.fmt == Q8S16:
            return self._s16_parts()[0]
        if self.fmt == Q8:
            q = self.q.view(torch.int8)
            if g == 0:
                return q
            head = q[:, :g].reshape(self.n, -1, GROUP * BLOCK)[..., _ELEM_TO_POS].reshape(self.n, g)
            return torch.cat((head, q[:, g:]), dim=1)
        tail = self.q[:, g // 2 :].reshape(self.n, -1, BLOCK // 2)
        tail = torch.cat((tail & 0x0F, tail >> 4), dim=-1).reshape(self.n, -1)
        if g == 0:
            return tail
        head = self.q[:, : g // 2].reshape(self.n, -1, GROUP * BLOCK // 2)
        head = torch.cat((head & 0x0F, head >> 4), dim=-1)[..., _ELEM_TO_POS].reshape(self.n, g)
        return torch.cat((head, tail), dim=1)

    def _s16_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A q8s16 weight's values (int8 [n, k], element order) and half-block scales (int8
        [n, k / 32, 2]: elements 0..15, 16..31 of each block)."""
        n, g = self.n, self._grouped if self.interleaved else 0
        q = self.q.view(torch.int8)
        head_bytes = g // BLOCK * _S16_BLOCK
        tail = q[:, head_bytes:].reshape(n, -1, _S16_BLOCK)
        ints, s = tail[..., :BLOCK].reshape(n, -1), tail[..., BLOCK:]
        if g == 0:
            return ints, s
        head = q[:, :head_bytes].reshape(n, -1, GROUP * _S16_BLOCK)
        head_ints = head[..., : GROUP * BLOCK][..., _ELEM_TO_POS].reshape(n, g)
        # a group's 16 scales: the 8 blocks' first halves, then their second halves
        head_s = head[..., GROUP * BLOCK :].reshape(n, -1, 2, GROUP).transpose(-1, -2).reshape(n, -1, 2)
        return torch.cat((head_ints, ints), dim=1), torch.cat((head_s, s), dim=1)

    @staticmethod
    def _s16_pack(ints: torch.Tensor, s: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """q of a q8s16 weight from `_s16_parts`' two tensors, in GGUF order or interleaved."""
        n, k = ints.shape
        g = k // (GROUP * BLOCK) * GROUP * BLOCK if interleaved else 0
        tail = torch.cat((ints[:, g:].reshape(n, -1, BLOCK), s[:, g // BLOCK :]), dim=-1).reshape(n, -1)
        if g:
            head = ints[:, :g].reshape(n, -1, GROUP * BLOCK)[..., _POS_TO_ELEM]
            head_s = s[:, : g // BLOCK].reshape(n, -1, GROUP, 2).transpose(-1, -2).reshape(n, -1, 2 * GROUP)
            tail = torch.cat((torch.cat((head, head_s), dim=-1).reshape(n, -1), tail), dim=1)
        return tail.view(torch.uint8).contiguous()

    def values(self) -> torch.Tensor:
        """The q values [n, k] as float32 (unscaled by d and s), in element order."""
        return self._ints().float()

    def interleave(self) -> QuantWeight:
        """The same values with whole groups of 8 blocks in the kernel's order (csrc/quant_gemm.c):
        position p = 16 t + 2 j + e of a group holds element 2 t + e of block j; q4 keeps positions
        0..127 of a group in the low nibbles of its 128 bytes and 128..255 in the high ones; q8s16
        follows a group's 256 values with the scales of its 8 blocks' first halves, then of their
        second halves."""
        g = self._grouped
        if self.interleaved or g == 0:
            return dataclasses.replace(self, interleaved=True)
        if self.fmt == Q8S16:  # q8's order, then each group's scales (csrc/quant_gemm.c)
            return dataclasses.replace(self, q=self._s16_pack(*self._s16_parts(), interleaved=True), interleaved=True)
        ints = self._ints()
        head = ints[:, :g].reshape(self.n, -1, GROUP * BLOCK)[..., _POS_TO_ELEM]
        if self.fmt == Q8:
            q = torch.cat((head.reshape(self.n, g).view(torch.uint8), self.q[:, g:]), dim=1)
        else:
            half = GROUP * BLOCK // 2
            packed = head[..., :half] | (head[..., half:] << 4)
            q = torch.cat((packed.reshape(self.n, g // 2), self.q[:, g // 2 :]), dim=1)
        return dataclasses.replace(self, q=q.contiguous(), interleaved=True)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [n, k] in `dtype` (float32 math: d q + m, then cast), with the native kernel where it runs."""
        out = _native_dequantize(self, dtype)
        if out is not None:
            return out
        if self.fmt == Q8S16:
            ints, s = self._s16_parts()
            scale = (self.d.float().unsqueeze(-1) * s.float()).unsqueeze(-1)  # d s: exact in float32
            w = (ints.float().reshape(self.n, -1, 2, HALF) * scale).reshape(self.n, -1, BLOCK)
        else:
            w = self.values().reshape(self.n, -1, BLOCK) * self.d.float().unsqueeze(-1)
        if self.m is not None:
            w = w + self.m.float().unsqueeze(-1)
        return w.reshape(self.n, self.k).to(dtype)

    def as_q8(self) -> QuantWeight:
        """The same values in the q8 format (exact), in the same layout; not for q8s16 (`as_q8s16`
        holds every format)."""
        if self.fmt == Q8:
            return self
        if self.fmt == Q8S16:
            raise ValueError("a q8s16 weight has 16-element scales: it joins others as q8s16, not q8")
        q = self._ints().to(torch.int8).view(torch.uint8).contiguous()
        canonical = QuantWeight(Q8, q, self.d, self.m, self.n, self.k)
        return canonical.interleave() if self.interleaved else canonical

    def as_q8s16(self) -> QuantWeight:
        """The same values in the q8s16 format (s = 1: exact), in the same layout."""
        if self.fmt == Q8S16:
            return self
        ints = self._ints().to(torch.int8)
        s = torch.ones((self.n, self.k // BLOCK, 2), dtype=torch.int8)
        q = self._s16_pack(ints, s, self.interleaved)
        return QuantWeight(Q8S16, q, self.d, self.m, self.n, self.k, self.interleaved)

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The weight rows `index` (a permutation or selection of output features)."""
        m = self.m[index] if self.m is not None else None
        return QuantWeight(
            self.fmt, self.q[index].contiguous(), self.d[index].contiguous(), m, len(index), self.k, self.interleaved
        )

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack weights of the same in_features along the output rows (a fused projection)."""
        if len({p.k for p in parts}) != 1:
            raise ValueError("fused quantized weights need the same in_features")
        if len({p.interleaved for p in parts}) != 1:
            raise ValueError("fused quantized weights need the same layout")
        fmts = {p.fmt for p in parts}
        if len(fmts) > 1:  # one format that holds every part's values exactly
            parts = [p.as_q8s16() if Q8S16 in fmts else p.as_q8() for p in parts]
        ms = None
        if any(p.m is not None for p in parts):
            ms = torch.cat([p.m if p.m is not None else torch.zeros_like(p.d) for p in parts])
        return QuantWeight(
            parts[0].fmt,
            torch.cat([p.q for p in parts]).contiguous(),
            torch.cat([p.d for p in parts]).contiguous(),
            ms.contiguous() if ms is not None else None,
            sum(p.n for p in parts),
            parts[0].k,
            parts[0].interleaved,
        )


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric 8-bit weight-only quantization, per block of 32 of a row: d = max|w| / 127 (as
    float16), q = round(w / d)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"int8 weight quantization needs in_features divisible by {BLOCK}, got {k}")
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = (w.abs().amax(dim=-1) / 127.0).to(torch.float16)
    scale = d.float().unsqueeze(-1)
    q = torch.where(scale > 0, torch.round(w / scale.clamp_min(1e-30)), torch.zeros_like(w)).clamp_(-127, 127)
    return QuantWeight(Q8, q.to(torch.int8).view(torch.uint8).reshape(n, k), d.contiguous(), None, n, k)


def from_gguf(type_name: str, blocks: torch.Tensor, n: int, k: int) -> QuantWeight:
    """A GGUF tensor's raw blocks ([num_blocks, block_bytes] uint8, rows of k elements in order)
    repacked (type_name in GGUF_REPACKED)."""
    nb = k // BLOCK

    def f16(b: torch.Tensor, at: int) -> torch.Tensor:
        return b[:, at : at + 2].contiguous().view(torch.float16).reshape(-1)

    if type_name == "Q8_0":
        return QuantWeight(Q8, blocks[:, 2:].reshape(n, k).contiguous(), f16(blocks, 0).reshape(n, nb), None, n, k)
    if type_name == "Q4_0":
        d = f16(blocks, 0).reshape(n, nb)
        m = (d.float() * -8.0).to(torch.float16)
        return QuantWeight(Q4, blocks[:, 2:].reshape(n, k // 2).contiguous(), d.contiguous(), m, n, k)
    if type_name == "Q4_1":
        q = blocks[:, 4:].reshape(n, k // 2).contiguous()
        return QuantWeight(
            Q4, q, f16(blocks, 0).reshape(n, nb).contiguous(), f16(blocks, 2).reshape(n, nb).contiguous(), n, k
        )
    if type_name in ("Q5_0", "Q5_1"):
        from kvtier.model.gguf import _high_bits, _nibbles

        skip = 2 if type_name == "Q5_0" else 4
        values = _nibbles(blocks[:, skip + 4 :]) | (_high_bits(blocks[:, skip : skip + 4]) << 4)  # 0..31
        d = f16(blocks, 0).reshape(n, nb)
        if type_name == "Q5_0":
            q = (values.to(torch.int16) - 16).to(torch.int8)
            return QuantWeight(Q8, q.view(torch.uint8).reshape(n, k).contiguous(), d.contiguous(), None, n, k)
        q = values.to(torch.int8).view(torch.uint8).reshape(n, k).contiguous()
        return QuantWeight(Q8, q, d.contiguous(), f16(blocks, 2).reshape(n, nb).contiguous(), n, k)
    if type_name in ("Q4_K", "Q5_K"):
        from kvtier.model.gguf import _k_scales, _sub_nibbles

        sc, mn = _k_scales(blocks[:, 4:16])  # [S, 8] each
        d = (f16(blocks, 0).float().unsqueeze(-1) * sc).to(torch.float16).reshape(n, nb)
        m = (-(f16(blocks, 2).float().unsqueeze(-1) * mn)).to(torch.float16).reshape(n, nb)
        if type_name == "Q4_K":
            values = _sub_nibbles(blocks[:, 16:])  # [S, 8, 32], 0..15 in element order
            packed = values[..., :16] | (values[..., 16:] << 4)
            return QuantWeight(Q4, packed.reshape(n, k // 2).contiguous(), d.contiguous(), m.contiguous(), n, k)
        qh = blocks[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
        values = _sub_nibbles(blocks[:, 48:]) | ((qh & 1) << 4)
        q = values.to(torch.int8).view(torch.uint8).reshape(n, k).contiguous()
        return QuantWeight(Q8, q, d.contiguous(), m.contiguous(), n, k)
    if type_name == "Q6_K":
        from kvtier.model.gguf import _q6_k_values

        ints = _q6_k_values(blocks).reshape(n, k)  # q - 32, in element order
        # the 16 scales of a super-block are those of elements 16 i .. 16 i + 15: block j's halves are 2 j, 2 j + 1
        s = blocks[:, 192:208].contiguous().view(torch.int8).reshape(n, nb, 2)
        d = f16(blocks, 208).repeat_interleave(GROUP).reshape(n, nb)  # one super-block: 8 blocks of 32
        return QuantWeight(Q8S16, QuantWeight._s16_pack(ints, s, False), d.contiguous(), None, n, k)
    raise ValueError(f"GGUF type {type_name} is not repacked (served dense)")


def _native_dequantize(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor | None:
    lib = native.quant_linear_lib()
    if lib is None or dtype not in _X_KIND or not w.interleaved:  # the kernel reads the interleaved layout
        return None
    out = torch.empty((w.n, w.k), dtype=dtype)
    rc = lib.kvt_quant_dequant(
        w.q.data_ptr(),
        _FMT_CODE[w.fmt],
        w.d.data_ptr(),
        w.m.data_ptr() if w.m is not None else None,
        w.n,
        w.k,
        out.data_ptr(),
        _X_KIND[dtype],
    )
    return out if rc == 0 else None


class QuantLinear(nn.Module):
    """y = x W^T (+ b) on a `QuantWeight` (see the module docstring)."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bias: nn.Parameter | None

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None, *, dtype: torch.dtype) -> None:
        super().__init__()
        activations = os.environ.get(ACTIVATIONS_ENV, "int16")
        if activations != "int16":  # checked when a model loads, not at its first step
            raise ValueError(
                f"{ACTIVATIONS_ENV}={activations!r}: the quantized-weight kernel meets x as int16 blocks "
                "only (exact integer products; float and int8 were removed: int16 was faster than both and "
                "as accurate as float); for float32 x serve dense weights (quantization='none')"
            )
        weight = weight.interleave()
        self.in_features, self.out_features = weight.k, weight.n
        self.fmt = weight.fmt
        self.register_buffer("q", weight.q)  # interleaved
        self.register_buffer("d", weight.d)
        self.register_buffer("m", weight.m)
        self.bias = nn.Parameter(bias.to(dtype), requires_grad=False) if bias is not None else None
        self._bias_f32: torch.Tensor | None = None
        self._args: tuple | None = None
        """The kernel's weight arguments (pointers and sizes), set on the first call."""

    @property
    def weight_q(self) -> QuantWeight:
        return QuantWeight(self.fmt, self.q, self.d, self.m, self.out_features, self.in_features, interleaved=True)

    @property
    def nbytes(self) -> int:
        return self.weight_q.nbytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= KERNEL_MAX_ROWS:
            out = self._kernel(x)
            if out is not None:
                return out
        shape = x.shape
        out = F.linear(x.reshape(-1, shape[-1]), self.weight_q.dequantize(x.dtype), self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        lib = native.quant_linear_lib()
        if lib is None or x.dtype not in _X_KIND or x.device.type != "cpu" or x.stride(-1) != 1:
            return None
        if self._args is None or self._args[0] != self.q.data_ptr():  # first call, or the buffers moved
            if self.bias is not None:
                self._bias_f32 = self.bias.detach().float().contiguous()
            self._args = (
                self.q.data_ptr(),
                _FMT_CODE[self.fmt],
                self.d.data_ptr(),
                self.m.data_ptr() if self.m is not None else None,
                self.out_features,
                self.in_features,
                self._bias_f32.data_ptr() if self._bias_f32 is not None else None,
            )
        rows = x.shape[0]
        out = torch.empty((rows, self.out_features), dtype=x.dtype)
        rc = lib.kvt_quant_linear(
            x.data_ptr(),
            rows,
            x.stride(0),
            _X_KIND[x.dtype],
            *self._args,
            out.data_ptr(),
            self.out_features,
        )
        return out if rc == 0 else None
