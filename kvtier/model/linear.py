"""Projections of a bfloat16 model on CPU, and which GEMM each batch size runs on.

A bfloat16 projection can multiply two ways on a CPU:

* **packed bfloat16** (oneDNN, weight reordered once at load): bf16 dot products with float32
  accumulation. It reads half the bytes of float32, so it wins wherever the weights' memory
  traffic dominates: decode-sized batches, everywhere.
* **float32 over the upcast weight**: the weight and the input are widened to float32 per call
  and multiplied by MKL's sgemm, then the output is rounded to bfloat16. The products of bf16
  values are exact in float32 and both paths accumulate in float32, so the two agree to the
  rounding of the sums' order. It wins on CPUs whose bf16 dot products run no faster than
  float32 FMAs (Intel without AMX: one vdpbf16ps port against two FMA ports) once the batch is
  large enough that the upcast (about a millisecond per weight) is small beside the GEMM; and
  on CPUs without AVX512-BF16, where oneDNN emulates bf16, everywhere.

Which one a machine wants is a property of its CPU, not of kvtier: `measure_wide_rows` times
both on the model's own largest projection at a few batch sizes once, when the model loads, and
returns the smallest row count from which float32 is faster at every larger size measured (None:
packed bf16 everywhere). `Linear.wide_min_rows` holds it; prefill chunks of that many tokens or
more take float32, decode steps keep the packed weight. The dense weight is kept beside the
packed one only where float32 serves some batch size.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PACK_BATCH_HINT = 16
"""oneDNN picks the packed weight format for this many rows; any row count works."""

WIDE_ROWS_ENV = "KVTIER_FP32_GEMM_MIN_ROWS"
"""Overrides the measurement: a row count (float32 GEMM from it up), or `never`."""

CANDIDATE_ROWS = (16, 64, 128, 256, 512, 2048)
"""Batch sizes the measurement times (rows of the projection's input)."""

WIN_MARGIN = 1.10
"""float32 must be this much faster (median of repeats) to be chosen: a tie keeps bf16."""

CALIBRATION_FLOP_BUDGET = 1.5e9
"""Most FLOPs one timed GEMM may cost: a large model's projection is cut to fewer output rows
(GEMM speed per FLOP does not depend on N at these sizes), so the measurement stays well under
a second however large the model."""


class Linear(nn.Linear):
    """nn.Linear with two faster CPU paths for bfloat16 (see the module docstring).

    `packed_weight`: a oneDNN-packed copy of the weight (`pack`); skips the weight reorder
    F.linear pays on every call, up to 2x faster per GEMM at decode-sized batches, same bits out.
    `wide_min_rows`: from this many input rows up, the product runs in float32 over the upcast
    dense weight and is rounded back to the input's dtype.
    """

    packed_weight: torch.Tensor | None = None
    wide_min_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide_min_rows is not None and x.shape[0] >= self.wide_min_rows:
            return linear_fp32(x, self.weight, self.bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def pack(self, *, keep_weight: bool) -> None:
        """Pack the weight for oneDNN; drop the dense copy unless `keep_weight` (a tied weight, or
        a weight the float32 path reads)."""
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_BATCH_HINT)
        if not keep_weight:
            self.weight = None


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias computed in float32, rounded to x's dtype."""
    out = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
    return out.to(x.dtype)


def can_pack_linears(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `Linear.pack` works here: CPU, bfloat16, and a oneDNN that packs bf16 on this CPU."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _onednn_bf16_packing_works()


@functools.cache
def _onednn_bf16_packing_works() -> bool:
    try:  # internal ops (used by torch.compile's CPU backend); probe instead of trusting versions
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16), PACK_BATCH_HINT)
        x = torch.ones(2, 8, dtype=torch.bfloat16)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool((out == 8).all())


def wide_rows_override(environ: dict[str, str] | None = None) -> tuple[bool, int | None]:
    """(set, value) of KVTIER_FP32_GEMM_MIN_ROWS: `never` -> (True, None), a count -> (True, n)."""
    raw = (os.environ if environ is None else environ).get(WIDE_ROWS_ENV, "").strip().lower()
    if not raw:
        return False, None
    if raw in ("never", "off", "none"):
        return True, None
    try:
        rows = int(raw)
    except ValueError:
        raise ValueError(f"{WIDE_ROWS_ENV}={raw!r}: expected a row count or 'never'") from None
    if rows < 1:
        raise ValueError(f"{WIDE_ROWS_ENV}={raw!r}: the row count must be at least 1")
    return True, rows


def measure_wide_rows(in_features: int, out_features: int, *, repeats: int = 3,
                      clock=time.perf_counter) -> tuple[int | None, dict[int, tuple[float, float]]]:
    """Time packed bf16 against float32-over-the-upcast-weight on a [out_features, in_features]
    projection at each of CANDIDATE_ROWS; returns (the smallest row count from which float32 wins
    by WIN_MARGIN at every larger size measured, or None; {rows: (bf16 s, fp32 s)} per FLOP-capped
    GEMM). Repeats are interleaved, medians compared, so a burst of load hits both paths alike."""
    timings: dict[int, tuple[float, float]] = {}
    gen = torch.Generator().manual_seed(0)
    for rows in CANDIDATE_ROWS:
        n = max(16, min(out_features, int(CALIBRATION_FLOP_BUDGET / (2 * rows * in_features))))
        weight = (torch.randn(n, in_features, generator=gen) * 0.02).to(torch.bfloat16)
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)

        def bf16(x=x, packed=packed) -> None:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

        def fp32(x=x, weight=weight) -> None:
            linear_fp32(x, weight, None)

        bf16(), fp32()  # first calls pay one-time setup
        a, b = [], []
        for _ in range(repeats):
            for fn, into in ((bf16, a), (fp32, b)):
                t = clock()
                fn()
                into.append(clock() - t)
        timings[rows] = (sorted(a)[len(a) // 2], sorted(b)[len(b) // 2])
    return choose_wide_rows(timings), timings


def choose_wide_rows(timings: dict[int, tuple[float, float]], margin: float = WIN_MARGIN) -> int | None:
    """The smallest measured row count from which float32 beats bf16 by `margin` at it and at
    every larger measured count; None where the largest does not."""
    chosen = None
    for rows in sorted(timings, reverse=True):
        t_bf16, t_fp32 = timings[rows]
        if t_fp32 * margin > t_bf16:
            break
        chosen = rows
    return chosen


@torch.inference_mode()
def wide_rows_for(linears: list[Linear], dtype: torch.dtype, device: torch.device) -> int | None:
    """The `wide_min_rows` for these projections: from KVTIER_FP32_GEMM_MIN_ROWS, else measured on
    the largest of them (once per shape and process); None off CPU or outside bfloat16."""
    if not linears or device.type != "cpu" or dtype != torch.bfloat16 or not _onednn_bf16_packing_works():
        return None
    given, wide = wide_rows_override()
    if given:
        return wide
    biggest = max(linears, key=lambda m: m.in_features * m.out_features)
    wide, timings = _measure_cached(biggest.in_features, biggest.out_features)
    logger.info("bfloat16 projections multiply in float32 from %s rows (median s per GEMM, bf16 vs fp32: %s)",
                wide, {r: (round(a, 5), round(b, 5)) for r, (a, b) in timings.items()})
    if wide is not None and wide <= CANDIDATE_ROWS[0]:
        logger.warning("bfloat16 matmuls on this CPU are slower than float32 even for small batches "
                       "(no fast bf16 dot products): --dtype float32 will likely run faster")
    return wide


@functools.cache
def _measure_cached(in_features: int, out_features: int) -> tuple[int | None, dict[int, tuple[float, float]]]:
    """One measurement per projection shape and process (tests build many runners of one model)."""
    return measure_wide_rows(in_features, out_features)
