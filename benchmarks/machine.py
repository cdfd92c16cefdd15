"""Machine limits measured in the same run as the engines: bf16/fp32 matmul peak, memcpy."""

from __future__ import annotations

import json
import os
import platform
import time


def matmul_gflops(dtype_name: str, n: int = 2048, repeats: int = 8) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def memcpy_gbps(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    import torch

    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return num_bytes / best / 1e9


def describe() -> dict:
    import torch

    cpu = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem_gib, 1),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def has_fast_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX-512 BF16 or AMX). Without it torch emulates
    bf16 matmul at ~1% of fp32 speed (0.8 vs 89.5 GFLOP/s seen on an AVX2-only EPYC)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def measure() -> dict:
    out = {
        **describe(),
        "fp32_matmul_gflops": round(matmul_gflops("float32"), 1),
        "memcpy_gbps": round(memcpy_gbps(), 2),
        "avx512": any(f.startswith("avx512") for f in cpu_flags()),
        "fast_bf16": has_fast_bf16(),
        "loadavg": os.getloadavg(),
    }
    if out["fast_bf16"]:  # minutes per matmul where it is emulated
        out["bf16_matmul_gflops"] = round(matmul_gflops("bfloat16"), 1)
    return out


if __name__ == "__main__":
    print(json.dumps(measure()))
