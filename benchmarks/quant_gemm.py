"""The quantized-weight kernel (kvtier/model/csrc/quant_gemm.c) on SmolLM2-135M's projection shapes,
against torch's dense float32 `F.linear` on the same values; prints JSON.

    python benchmarks/quant_gemm.py [--rows 1 4 8 16 64 128 512] [--repeat 50] [--formats q8 q8s16]

For each shape (N out x K in) and batch of rows M: microseconds per call of the native kernel
(`int16`: x meets the interleaved quantized weights as int16 blocks), of torch's dense float32
`F.linear` on the dequantized weight (`dense_f32`), of the same in bfloat16 (`dense_bf16`, and
`native_bf16`: kvtier's small-batch bf16 kernel, csrc/gemm.c, where the CPU has AVX512-BF16: what
a bfloat16 model's decode step runs), and of dequantizing then `F.linear` (`dequant_gemm`: what
QuantLinear does above KERNEL_MAX_ROWS rows); min and median of `repeat` calls,
all interleaved so that load from other processes hits all alike; the effective weight bandwidth
(weight bytes / min time) and the kernel's largest error relative to the dense GEMM's largest output.
A decode step of M sequences calls every projection once with M rows, so these are the parts of
a step's time; `decode_16` of benchmarks/llama_cpp.py is the whole. Each shape runs in the format
the Q4_1 file holds it in, or with `--formats` in each format listed (`q8s16`: GGUF Q6_K's form,
int8 values with an int8 scale per 16 elements; shapes are then keyed `name:fmt`).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe

from kvtier.model import native
from kvtier.model.linear import linear_native
from kvtier.model.quant_linear import _FMT_CODE, Q4, Q8, QuantLinear, QuantWeight, _q_width

# SmolLM2-135M: hidden 576, 9 + 2 * 3 heads of 64, intermediate 1536, vocab 49152 (the Q4_1 file
# holds the projections as Q4_1 and the tied lm_head as Q8_0)
MODES = ("int16",)  # the native kernel (x as int16 blocks: the only way it meets x)
SHAPES = {
    "qkv_proj": (960, 576, Q4),
    "o_proj": (576, 576, Q4),
    "gate_up_proj": (3072, 576, Q4),
    "down_proj": (576, 1536, Q4),
    "lm_head": (49152, 576, Q8),
}


def random_weight(n: int, k: int, fmt: str, gen: torch.Generator) -> QuantWeight:
    q = torch.randint(0, 256, (n, _q_width(fmt, k)), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).to(torch.float16)
    m = None if fmt != Q4 else (torch.rand(n, k // 32, generator=gen) * -0.05).to(torch.float16)
    return QuantWeight(fmt, q, d, m, n, k)


def time_us(fns: Mapping[str, Callable[[], object]], repeat: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 128, 512])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--formats", nargs="+", choices=sorted(_FMT_CODE), help="run every shape in each of these")
    args = parser.parse_args()
    if native.quant_linear_lib() is None:
        print(json.dumps({"skipped": "the native quantized kernel does not build or run on this machine"}))
        return
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    results: dict[str, object] = {"machine": describe(), "threads": torch.get_num_threads(), "shapes": {}}
    formats: list[str | None] = list(args.formats) if args.formats else [None]
    jobs = [(name, n, k, f or own) for name, (n, k, own) in SHAPES.items() for f in formats]
    for name, n, k, fmt in jobs:
        weight = random_weight(n, k, fmt, gen)
        layer = QuantLinear(weight, dtype=torch.float32)
        dense = weight.dequantize(torch.float32)
        dense_bf16 = dense.to(torch.bfloat16)
        per_rows = {}
        for m in args.rows:
            x = torch.randn(m, k)
            ref = F.linear(x, dense)
            got = layer._kernel(x)
            assert got is not None
            errors = {"int16": float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))}
            x16 = x.to(torch.bfloat16)
            fns = {
                "dense_f32": lambda x=x, dense=dense: F.linear(x, dense),
                "dense_bf16": lambda x=x16, w=dense_bf16: F.linear(x, w),
                "dequant_gemm": lambda x=x, layer=layer: F.linear(x, layer.weight_q.dequantize(x.dtype)),
                "int16": lambda x=x, layer=layer: layer._kernel(x),
            }
            if native.linear_lib() is not None and linear_native(x16, dense_bf16, None, 0) is not None:
                fns["native_bf16"] = lambda x=x16, w=dense_bf16: linear_native(x, w, None, 0)
            times = time_us(fns, args.repeat)
            best = {key: min(v) for key, v in times.items()}
            per_rows[m] = {
                "us": {key: round(v, 1) for key, v in best.items()},
                "median_us": {key: round(statistics.median(v), 1) for key, v in times.items()},
                "weight_gb_s": {mode: round(weight.nbytes / best[mode] / 1e3, 1) for mode in MODES},
                "max_rel_err": errors,
            }
        key = name if args.formats is None else f"{name}:{fmt}"
        results["shapes"][key] = {"n": n, "k": k, "fmt": fmt, "rows": per_rows}  # type: ignore[index]
    shapes: dict = results["shapes"]  # type: ignore[assignment]
    results["decode_step_projections_ms"] = {  # 30 layers' projections and the lm_head, least times
        f"{mode}:{fmt}" if fmt else mode: {
            m: round(
                sum(
                    s["rows"][m]["us"][mode] * (1 if key.startswith("lm_head") else 30)
                    for key, s in shapes.items()
                    if fmt is None or s["fmt"] == fmt
                )
                / 1e3,
                2,
            )
            for m in args.rows
        }
        for fmt in formats
        for mode in ("dense_f32", "dense_bf16", "dequant_gemm", *MODES)
    }
    # a whole step's projections with 30 layers of distinct weights (97 MB, more than the L3 cache):
    # the weights stream from memory, as in a decode step, not from cache as in the loop above
    step_mb: dict[str, float] = {}
    step_ms: dict[str, dict[int, dict]] = {}
    results["step_weight_mb"], results["step_ms"] = step_mb, step_ms
    for step_fmt in formats:
        label = step_fmt or "file"  # the Q4_1 file's formats, or every projection in `step_fmt`
        layers = [
            [
                QuantLinear(random_weight(n, k, step_fmt or own, gen), dtype=torch.float32)
                for name, (n, k, own) in SHAPES.items()
                if name != "lm_head"
            ]
            for _ in range(30)
        ]
        n, k, own = SHAPES["lm_head"]
        head = QuantLinear(random_weight(n, k, step_fmt or own, gen), dtype=torch.float32)
        step_bytes = sum(layer.nbytes for group in layers for layer in group) + head.nbytes

        def step(x: torch.Tensor, layers: list[list[QuantLinear]] = layers, head: QuantLinear = head) -> None:
            for group in layers:
                for layer in group:
                    layer._kernel(
                        x[:, : layer.in_features]
                        if layer.in_features <= x.shape[1]
                        else x.repeat(1, 3)[:, : layer.in_features]
                    )
            head._kernel(x[:, : head.in_features])

        step_mb[label] = round(step_bytes / 1e6, 1)
        step_ms[label] = {}
        for m in args.rows:
            times = time_us({"int16": functools.partial(step, torch.randn(m, 1536))}, max(3, args.repeat // 10))
            step_ms[label][m] = {
                mode: {
                    "min": round(min(v) / 1e3, 2),
                    "median": round(statistics.median(v) / 1e3, 2),
                    "weight_gb_s": round(step_bytes / min(v) / 1e3, 1),
                }
                for mode, v in times.items()
            }
        del layers, head
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
