"""The quantized-weight kernel (kvtier/model/csrc/quant_gemm.c) on SmolLM2-135M's projection shapes,
against torch's dense float32 `F.linear` on the same values; prints JSON.

    python benchmarks/quant_gemm.py [--rows 1 4 8 16 64 128 512] [--repeat 50]

For each shape (N out x K in) and batch of rows M: microseconds per call of the native kernel
(`int16`: x meets the interleaved quantized weights as int16 blocks), of torch's dense float32
`F.linear` on the dequantized weight (`dense_f32`), and of dequantizing then `F.linear`
(`dequant_gemm`: what QuantLinear does above KERNEL_MAX_ROWS rows); min and median of `repeat` calls,
all interleaved so that load from other processes hits all alike; the effective weight bandwidth
(weight bytes / min time) and the kernel's largest error relative to the dense GEMM's largest output.
A decode step of M sequences calls every projection once with M rows, so these are the parts of
a step's time; `decode_16` of benchmarks/llama_cpp.py is the whole.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe

from kvtier.model import native
from kvtier.model.quant_linear import Q4, Q8, QuantLinear, QuantWeight

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
    width = k if fmt == Q8 else k // 2
    hi = 256
    q = torch.randint(0, hi, (n, width), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).to(torch.float16)
    m = None if fmt == Q8 else (torch.rand(n, k // 32, generator=gen) * -0.05).to(torch.float16)
    return QuantWeight(fmt, q, d, m, n, k)


def time_us(fns: dict[str, object], repeat: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()  # type: ignore[operator]
            times[name].append((time.perf_counter() - t) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 128, 512])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    if native.quant_linear_lib() is None:
        print(json.dumps({"skipped": "the native quantized kernel does not build or run on this machine"}))
        return
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    results: dict[str, object] = {"machine": describe(), "threads": torch.get_num_threads(), "shapes": {}}
    for name, (n, k, fmt) in SHAPES.items():
        weight = random_weight(n, k, fmt, gen)
        layer = QuantLinear(weight, dtype=torch.float32)
        dense = weight.dequantize(torch.float32)
        per_rows = {}
        for m in args.rows:
            x = torch.randn(m, k)
            ref = F.linear(x, dense)
            got = layer._kernel(x)
            assert got is not None
            errors = {"int16": float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))}
            fns = {
                "dense_f32": lambda x=x, dense=dense: F.linear(x, dense),
                "dequant_gemm": lambda x=x, layer=layer: F.linear(x, layer.weight_q.dequantize(x.dtype)),
                "int16": lambda x=x, layer=layer: layer._kernel(x),
            }
            times = time_us(fns, args.repeat)
            best = {key: min(v) for key, v in times.items()}
            per_rows[m] = {
                "us": {key: round(v, 1) for key, v in best.items()},
                "median_us": {key: round(statistics.median(v), 1) for key, v in times.items()},
                "weight_gb_s": {mode: round(weight.nbytes / best[mode] / 1e3, 1) for mode in MODES},
                "max_rel_err": errors,
            }
        results["shapes"][name] = {"n": n, "k": k, "fmt": fmt, "rows": per_rows}  # type: ignore[index]
    shapes = results["shapes"]
    results["decode_step_projections_ms"] = {  # 30 layers' projections and the lm_head, least times
        mode: {
            m: round(
                sum(s["rows"][m]["us"][mode] * (1 if nm == "lm_head" else 30) for nm, s in shapes.items()) / 1e3, 2
            )  # type: ignore[union-attr,index]
            for m in args.rows
        }
        for mode in ("dense_f32", "dequant_gemm", *MODES)
    }
    # a whole step's projections with 30 layers of distinct weights (97 MB, more than the L3 cache):
    # the weights stream from memory, as in a decode step, not from cache as in the loop above
    layers = [
        [
            QuantLinear(random_weight(n, k, fmt, gen), dtype=torch.float32)
            for name, (n, k, fmt) in SHAPES.items()
            if name != "lm_head"
        ]
        for _ in range(30)
    ]
    n, k, fmt = SHAPES["lm_head"]
    head = QuantLinear(random_weight(n, k, fmt, gen), dtype=torch.float32)
    step_bytes = sum(layer.nbytes for group in layers for layer in group) + head.nbytes

    def step(x: torch.Tensor) -> None:
        for group in layers:
            for layer in group:
                layer._kernel(
                    x[:, : layer.in_features]
                    if layer.in_features <= x.shape[1]
                    else x.repeat(1, 3)[:, : layer.in_features]
                )
        head._kernel(x[:, : head.in_features])

    results["step_weight_mb"] = round(step_bytes / 1e6, 1)
    results["step_ms"] = {}
    for m in args.rows:
        x = torch.randn(m, 1536)
        fns = {"int16": lambda x=x: step(x)}
        times = time_us(fns, max(3, args.repeat // 10))
        results["step_ms"][m] = {
            mode: {
                "min": round(min(v) / 1e3, 2),
                "median": round(statistics.median(v) / 1e3, 2),
                "weight_gb_s": round(step_bytes / min(v) / 1e3, 1),
            }
            for mode, v in times.items()
        }
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
