"""Projections of a bfloat16 model on CPU, and which GEMM each batch size runs on.

A bfloat16 projection y = x W^T (+ b) can multiply several ways on a CPU, and which is fastest
depends on the CPU and on the number of rows of x:

* `onednn`: oneDNN's bf16 GEMM on a weight packed once at load (bf16 dot products, float32
  accumulation). Without packing (`pack_weights=False`), `dense`: F.linear on the plain weight.
* `native_fma` / `native_dp`: kvtier's small-batch kernel (kvt_linear_bf16, csrc/gemm.c). It
  reads the dense weight in place and streams it from memory at close to the machine's read
  bandwidth, which is what a decode step needs (every weight once, a few rows of x): `native_dp`
  multiplies with vdpbf16ps, `native_fma` widens the bf16 weights in registers and uses float32
  FMAs (for CPUs whose FMA units outrun their bf16 dot products: Intel without AMX).
* `fp32`: the weight and x widened to float32 per call, MKL's sgemm, the output rounded to
  bfloat16: for large batches (prefill chunks) on CPUs whose float32 GEMM is faster than their
  bf16 GEMM; the widening is small beside the GEMM there.

All of them multiply exact bf16 products and accumulate in float32, then round once, so they
agree to the rounding of the sums' order (tests/model/test_linear_paths.py).

Which one a machine wants is a property of its CPU, not of kvtier: `measure_plan` times each
available method on the model's own largest projection at a few batch sizes, once per process
when the model loads, and `GemmPlan` maps a row count to the fastest (a method keeps the sizes
above it unless another is WIN_MARGIN faster there; the first size starts from the baseline,
`onednn` or `dense`). Only the weight copies the plan uses
are kept: the packed one for `onednn`, the dense one for the others. KVTIER_GEMM_PLAN overrides
the measurement (e.g. `native_fma` or `1:native_fma,512:fp32`).
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvtier import threads
from kvtier.model import native

logger = logging.getLogger(__name__)

PACK_BATCH_HINT = 16
"""oneDNN picks the packed weight format for this many rows; any row count works."""

PLAN_ENV = "KVTIER_GEMM_PLAN"
"""Overrides the measurement: `METHOD` (every batch size) or `ROWS:METHOD,ROWS:METHOD,...`."""

ONEDNN, DENSE, NATIVE_FMA, NATIVE_DP, FP32 = "onednn", "dense", "native_fma", "native_dp", "fp32"
METHODS = (ONEDNN, DENSE, NATIVE_FMA, NATIVE_DP, FP32)
_NATIVE_VARIANT = {NATIVE_DP: 0, NATIVE_FMA: 1}  # KVT_GEMM_DPBF16, KVT_GEMM_FMA of csrc/gemm.c

CANDIDATE_ROWS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048)
"""Batch sizes the measurement times (rows of the projection's input); the last one's method serves
every larger batch, so it is a prefill chunk's size. A size's method serves every batch up to the
next size, so the grid must be fine where methods cross: without 1024, a 512-row near tie (oneDNN
1.07 ms, the native kernel 1.19) left the native kernel on every step of 512-2047 rows, where
oneDNN is 1.4x faster at 1024 rows on a Zen 5 (a serving wave of 8 x 128 new tokens)."""

WIN_MARGIN = 1.10
"""A size takes another method than the size below it (the baseline for the first) only when that
one is this much faster: a near tie keeps the plan as it was, so noise does not fragment it."""

CALIBRATION_FLOP_BUDGET = 0.6e9
CALIBRATION_WEIGHT_ELEMENTS = 1 << 21
CALIBRATION_MIN_COLUMNS = 1024
"""Most FLOPs one timed GEMM may cost, and most weight elements it may read: a large projection
is cut to fewer output rows (the speed per FLOP and per weight byte does not depend on N at
these sizes), so the measurement stays short however large the model. Never below
CALIBRATION_MIN_COLUMNS rows (or the projection's own), where the per-call widening of x would
weigh more in the float32 path than in any real projection."""


@dataclass(frozen=True)
class GemmPlan:
    """Which method multiplies a batch of a given number of rows: `steps[i] = (from_rows, method)`,
    ascending, the first from 1 row."""

    steps: tuple[tuple[int, str], ...]
    _starts: list[int] = field(init=False, repr=False, compare=False)
    """The steps' first rows, for bisect (set by __post_init__)."""

    def __post_init__(self) -> None:
        rows = [r for r, _ in self.steps]
        if not self.steps or rows[0] != 1 or rows != sorted(set(rows)):
            raise ValueError(f"a GEMM plan starts at 1 row and ascends: {self.steps}")
        bad = [m for _, m in self.steps if m not in METHODS]
        if bad:
            raise ValueError(f"unknown GEMM method(s) {bad}; use {', '.join(METHODS)}")
        object.__setattr__(self, "_starts", rows)

    def method(self, rows: int) -> str:
        return self.steps[bisect.bisect_right(self._starts, rows) - 1][1]

    @property
    def methods(self) -> set[str]:
        return {m for _, m in self.steps}

    @property
    def needs_dense(self) -> bool:
        """Whether a method of the plan reads the dense weight (all but `onednn`)."""
        return bool(self.methods - {ONEDNN})

    def describe(self) -> str:
        return ",".join(f"{r}:{m}" for r, m in self.steps)

    @classmethod
    def parse(cls, text: str) -> GemmPlan:
        """`METHOD` or `ROWS:METHOD,...` (see PLAN_ENV)."""
        text = text.strip().lower()
        if ":" not in text:
            return cls(((1, text),))
        steps = []
        for part in text.split(","):
            rows, _, method = part.partition(":")
            try:
                steps.append((int(rows), method.strip()))
            except ValueError:
                raise ValueError(f"{PLAN_ENV}={text!r}: expected ROWS:METHOD entries") from None
        return cls(tuple(steps))


class Linear(nn.Linear):
    """nn.Linear with the CPU methods of the module docstring, chosen per call by `plan` (None:
    the packed weight if there is one, else F.linear)."""

    packed_weight: torch.Tensor | None = None
    plan: GemmPlan | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan is not None:
            method = self.plan.method(x.shape[0])
            if method == FP32:
                return linear_fp32(x, self.weight, self.bias)
            if method in _NATIVE_VARIANT:
                out = linear_native(x, self.weight, self.bias, _NATIVE_VARIANT[method])
                if out is not None:
                    return out
        if self.packed_weight is not None:
            if x.dim() == 2 and x.shape[0] >= DYNAMIC_MIN_ROWS and threads.dynamic_rows_active():
                out = linear_packed_dynamic(x, self.packed_weight, self.bias, self.out_features)
                if out is not None:
                    return out
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def pack(self, *, keep_weight: bool) -> None:
        """Pack the weight for oneDNN; drop the dense copy unless `keep_weight` (a tied weight, or
        one another method of the plan reads)."""
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_BATCH_HINT)
        if not keep_weight:
            self.register_parameter("weight", None)  # what `self.weight = None` does


DYNAMIC_MIN_ROWS = 512
DYNAMIC_BLOCK_ROWS = 128
"""With `kvtier.threads.dynamic_rows_active()` (a big step while another process takes a compute
CPU), packed GEMMs of DYNAMIC_MIN_ROWS rows or more run as blocks of DYNAMIC_BLOCK_ROWS rows, one
single-threaded oneDNN call each, that the compute threads take as they finish. Measured on a
2-core Zen 5 with one core busy, the four projections of a layer at 2,048 rows: 62 ms as one
2-thread call, 50 ms in 128-row blocks (256: 54, 512: 55); without contention blocks cost about
10% (the weight is read once per block), so they are only used under contention."""


def linear_packed_dynamic(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor | None:
    """x @ W^T (+ bias) on oneDNN's packed weight, in row blocks under a dynamic schedule
    (`kvtier.threads.run_dynamic`); None when the OpenMP runtime cannot be reached. Each block is
    the same oneDNN GEMM on fewer rows, so the rows come out as one call would give them. For
    inference only: None too where autograd would record the product (it is not recorded across
    threads)."""
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    rows = x.shape[0]
    out = torch.empty((rows, out_features), dtype=x.dtype)
    starts = range(0, rows, DYNAMIC_BLOCK_ROWS)

    inference = torch.is_inference_mode_enabled()  # thread-local: the team's other threads enter it too

    def block(i: int) -> None:
        s = slice(starts[i], starts[i] + DYNAMIC_BLOCK_ROWS)
        with torch.inference_mode(inference), torch.no_grad():
            out[s] = torch.ops.mkldnn._linear_pointwise(x[s], packed, bias, "none", [], "")

    return out if threads.run_dynamic(len(starts), block) else None


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias computed in float32, rounded to x's dtype."""
    out = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
    return out.to(x.dtype)


def linear_native(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, variant: int
) -> torch.Tensor | None:
    """kvt_linear_bf16 (csrc/gemm.c) on 2-D bf16 x with unit column stride; None where it does not
    apply (no kernel here, another dtype or layout, K % 32 or N % 4 not 0)."""
    lib = native.linear_lib()
    if (
        lib is None
        or x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or x.dim() != 2
        or x.stride(1) != 1
        or not weight.is_contiguous()
        or x.device.type != "cpu"
    ):
        return None
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=torch.bfloat16)
    rc = lib.kvt_linear_bf16(
        x.data_ptr(),
        rows,
        x.stride(0),
        weight.data_ptr(),
        n,
        k,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        n,
        variant,
    )
    return out if rc == 0 else None


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


def plan_override(environ: dict[str, str] | None = None) -> GemmPlan | None:
    """The plan KVTIER_GEMM_PLAN gives, or None when it is unset."""
    raw = (os.environ if environ is None else environ).get(PLAN_ENV, "").strip()
    if not raw:
        return None
    try:
        return GemmPlan.parse(raw)
    except ValueError as e:
        raise ValueError(f"{PLAN_ENV}={raw!r}: {e}") from None


def available_methods(*, packed: bool) -> list[str]:
    """Methods this process can run for bf16 on CPU; the baseline (`onednn` if `packed`, else
    `dense`) first."""
    methods = [ONEDNN if packed else DENSE]
    if native.linear_lib() is not None:
        methods += [NATIVE_FMA, NATIVE_DP]
    return methods + [FP32]


def measure_plan(
    in_features: int,
    out_features: int,
    methods: list[str],
    *,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[GemmPlan, dict[int, dict[str, float]]]:
    """Time `methods` (the baseline first) on a [out_features, in_features] bf16 projection at each
    of CANDIDATE_ROWS; returns the plan (`choose_plan`) and the least seconds of the repeats per method and size. Repeats are
    interleaved, so a burst of load hits every method alike, and the minimum is what the method
    costs when nothing interferes."""
    timings: dict[int, dict[str, float]] = {}
    gen = torch.Generator().manual_seed(0)
    for rows in CANDIDATE_ROWS:
        n = min(
            out_features,
            max(
                CALIBRATION_MIN_COLUMNS,
                min(
                    int(CALIBRATION_FLOP_BUDGET / (2 * rows * in_features)), CALIBRATION_WEIGHT_ELEMENTS // in_features
                ),
            ),
        )
        n -= n % 4
        layer = Linear(in_features, n, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n, in_features, generator=gen) * 0.02)
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        if ONEDNN in methods:
            layer.pack(keep_weight=True)
        runs: dict[str, list[float]] = {m: [] for m in methods}
        for method in methods:  # first calls pay one-time setup
            layer.plan = GemmPlan(((1, method),))
            layer(x)
        for _ in range(repeats if rows * n * in_features <= CALIBRATION_FLOP_BUDGET else 3):
            for method in methods:
                layer.plan = GemmPlan(((1, method),))
                t = clock()
                layer(x)
                runs[method].append(clock() - t)
        timings[rows] = {m: min(ts) for m, ts in runs.items()}
    return choose_plan(timings, methods[0]), timings


def choose_plan(timings: dict[int, dict[str, float]], baseline: str, margin: float = WIN_MARGIN) -> GemmPlan:
    """Per measured size the fastest method, where it beats the method of the size below (the
    baseline for the first) by `margin`, else that one; merged into steps. Where the method changes
    between two measured sizes, the step starts where the two methods' relative speed crosses,
    interpolated between the sizes (just above the lower size where the new method was already as
    fast there), not at the upper size: the batches in between are nearer the new method's."""
    steps: list[tuple[int, str]] = []
    current = baseline
    below: int | None = None
    for rows in sorted(timings):
        t = timings[rows]
        best = min(t, key=t.__getitem__)
        start = rows
        if t[best] * margin <= t[current]:
            if below is not None and best != current:
                start = _crossover(below, rows, timings[below], t, current, best)
            current = best
        if not steps or steps[-1][1] != current:
            steps.append((1 if not steps else start, current))
        below = rows
    return GemmPlan(tuple(steps))


def _crossover(a: int, b: int, ta: dict[str, float], tb: dict[str, float], old: str, new: str) -> int:
    """First row count from which `new` is expected to beat `old`, between measured sizes a < b:
    the zero of old/new - 1, interpolated linearly in rows (a ratio, since the calibration layer's
    width may differ between sizes)."""
    ra, rb = ta[old] / ta[new] - 1.0, tb[old] / tb[new] - 1.0
    if ra >= 0 or rb <= ra:
        return a + 1
    cross = a + (b - a) * (-ra) / (rb - ra)
    return min(b, max(a + 1, math.ceil(cross)))


@torch.inference_mode()
def plan_for(linears: list[Linear], dtype: torch.dtype, device: torch.device, *, packed: bool) -> GemmPlan | None:
    """The GEMM plan for these projections: KVTIER_GEMM_PLAN, else measured on the largest of them
    (once per shape and process; pass the decoder's projections, whose shapes the time goes to,
    and apply the plan to the lm_head too); None off CPU or outside bfloat16."""
    if not linears or device.type != "cpu" or dtype != torch.bfloat16:
        return None
    plan = plan_override()
    if plan is not None:
        if ONEDNN in plan.methods and not packed:
            raise ValueError(
                f"{PLAN_ENV}={plan.describe()}: onednn needs packed weights (pack_weights=True "
                f"and a oneDNN that packs bfloat16 here)"
            )
        return plan
    biggest = max(linears, key=lambda m: m.in_features * m.out_features)
    plan, timings = _measure_cached(biggest.in_features, biggest.out_features, tuple(available_methods(packed=packed)))
    logger.info(
        "bfloat16 projections: GEMM plan %s (least ms per GEMM by rows: %s)",
        plan.describe(),
        {r: {m: round(s * 1e3, 3) for m, s in t.items()} for r, t in timings.items()},
    )
    if plan.method(1) == FP32:
        logger.warning(
            "bfloat16 matmuls on this CPU are slower than float32 even for single rows "
            "(no fast bf16 dot products): --dtype float32 will likely run faster"
        )
    return plan


@functools.cache
def _measure_cached(
    in_features: int, out_features: int, methods: tuple[str, ...]
) -> tuple[GemmPlan, dict[int, dict[str, float]]]:
    """One measurement per projection shape and process (tests build many runners of one model)."""
    return measure_plan(in_features, out_features, list(methods))
