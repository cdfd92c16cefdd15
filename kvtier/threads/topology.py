"""The machine's CPUs as this process may use them: its starting affinity mask, the cgroup CPU
quota, SMT siblings and NUMA nodes (read from /proc and /sys), and the CPU-list syntax."""

from __future__ import annotations

import os
from pathlib import Path

ORIGINAL_CPUS: frozenset[int] = (
    frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(range(os.cpu_count() or 1))
)
"""The affinity mask the process started with (before any pinning)."""


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (order kept, duplicates refused)."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                cpus.extend(range(lo, hi + 1))
            else:
                cpus.append(int(part))
        except ValueError:
            raise ValueError(f"invalid CPU list {text!r} (expected e.g. 0-3,8)") from None
    if not cpus or any(c < 0 for c in cpus) or len(set(cpus)) != len(cpus):
        raise ValueError(f"invalid CPU list {text!r} (expected e.g. 0-3,8, no repeats)")
    return cpus


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the cgroup's quota allows (cgroup v2 cpu.max or v1 cfs files), None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def thread_siblings(cpu: int) -> list[int]:
    """The CPUs sharing `cpu`'s physical core (SMT siblings, itself included)."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
        return parse_cpu_list(text.strip())
    except (OSError, ValueError):
        return [cpu]


def numa_nodes() -> dict[int, list[int]]:
    """The CPUs of each NUMA node (none when /sys does not say)."""
    nodes: dict[int, list[int]] = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            nodes[int(node.name[4:])] = parse_cpu_list((node / "cpulist").read_text().strip())
        except (OSError, ValueError):
            continue
    return nodes
