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
    return 2 * n ** 3 / best / 1e9


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
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem_gib, 1),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version()}


def measure() -> dict:
    return {**describe(), "bf16_matmul_gflops": round(matmul_gflops("bfloat16"), 1),
            "fp32_matmul_gflops": round(matmul_gflops("float32"), 1),
            "memcpy_gbps": round(memcpy_gbps(), 2)}


if __name__ == "__main__":
    print(json.dumps(measure()))
