"""The per-layer elementwise ops of a bfloat16 decoder as fused native kernels (csrc/layer_ops.c).

Each function returns None where its kernel does not apply (no kernel here, another dtype or
device, a size it does not take); the caller then runs its torch ops. They serve bfloat16; the
`_f32` ones serve float32 models whose weights stay quantized (their projections already sum in
another order than transformers'); other float32 models keep the torch ops, whose results match
transformers' bit for bit.
"""

from __future__ import annotations

import torch

from kvtier.model import native


def _lib(*tensors: torch.Tensor):
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        return None
    return native.layer_ops_lib()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """RMSNorm of `x` [rows, hidden] (rows with unit column stride), or of `residual + x` when a
    residual is given, which then becomes that sum in place. Returns the normed rows."""
    lib = _lib(x, weight) if residual is None or residual.dtype == torch.bfloat16 else None
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous():
        return None
    rows, hidden = x.shape
    if residual is not None and (not residual.is_contiguous() or residual.shape != x.shape):
        return None
    out = torch.empty((rows, hidden), dtype=torch.bfloat16)
    rc = lib.kvt_add_rms_norm_bf16(
        x.data_ptr(),
        x.stride(0),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        hidden,
        eps,
    )
    return out if rc == 0 else None


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate x [tokens, heads, dim] (heads contiguous within a token's row) in place by cos, sin
    [tokens, 1, dim / 2] (contiguous), as kvtier.model.llama.apply_rope; False if not done."""
    lib = _lib(x, cos, sin)
    if (
        lib is None
        or x.dim() != 3
        or x.stride(2) != 1
        or x.stride(1) != x.shape[2]
        or not cos.is_contiguous()
        or not sin.is_contiguous()
    ):
        return False
    tokens, heads, dim = x.shape
    return lib.kvt_rope_bf16(x.data_ptr(), tokens, heads, dim, x.stride(0), cos.data_ptr(), sin.data_ptr()) == 0


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor | None:
    """silu(gate) * up for gate_up = [gate | up] [rows, 2 * intermediate] (contiguous)."""
    lib = _lib(gate_up)
    if lib is None or gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] != 2 * intermediate:
        return None
    rows = gate_up.shape[0]
    out = torch.empty((rows, intermediate), dtype=torch.bfloat16)
    rc = lib.kvt_silu_mul_bf16(gate_up.data_ptr(), rows, intermediate, out.data_ptr())
    return out if rc == 0 else None


# -- float32, for models whose projections already sum in another order (quantized weights) ----


def _lib_f32(*tensors: torch.Tensor):
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    return native.layer_ops_f32_lib()


def add_rms_norm_f32(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """`add_rms_norm` for float32 (csrc/layer_ops_f32.c)."""
    lib = _lib_f32(x, weight) if residual is None or residual.dtype == torch.float32 else None
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous():
        return None
    rows, hidden = x.shape
    if residual is not None and (not residual.is_contiguous() or residual.shape != x.shape):
        return None
    out = torch.empty((rows, hidden), dtype=torch.float32)
    rc = lib.kvt_add_rms_norm_f32(
        x.data_ptr(),
        x.stride(0),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        hidden,
        eps,
    )
    return out if rc == 0 else None


def rope_f32_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """`rope_` for float32 (csrc/layer_ops_f32.c)."""
    lib = _lib_f32(x, cos, sin)
    if (
        lib is None
        or x.dim() != 3
        or x.stride(2) != 1
        or x.stride(1) != x.shape[2]
        or not cos.is_contiguous()
        or not sin.is_contiguous()
    ):
        return False
    tokens, heads, dim = x.shape
    return lib.kvt_rope_f32(x.data_ptr(), tokens, heads, dim, x.stride(0), cos.data_ptr(), sin.data_ptr()) == 0


def silu_mul_f32(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor | None:
    """`silu_mul` for float32 (csrc/layer_ops_f32.c)."""
    lib = _lib_f32(gate_up)
    if lib is None or gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] != 2 * intermediate:
        return None
    rows = gate_up.shape[0]
    out = torch.empty((rows, intermediate), dtype=torch.float32)
    rc = lib.kvt_silu_mul_f32(gate_up.data_ptr(), rows, intermediate, out.data_ptr())
    return out if rc == 0 else None
