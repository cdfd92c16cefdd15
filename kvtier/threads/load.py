"""CPU load readings from /proc: busy ticks per CPU and CPU ticks per thread of this process
(what the adaptive team subtracts to see other processes' use of the compute CPUs)."""

from __future__ import annotations


def cpu_busy_ticks(cpus: tuple[int, ...]) -> dict[int, int]:
    """Each of `cpus`' busy time since boot in clock ticks (user, nice, system, irq, softirq; /proc/stat)."""
    want = {f"cpu{c}": c for c in cpus}
    out: dict[int, int] = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in want:
                    v = [int(x) for x in parts[1:9]]
                    out[want[parts[0]]] = v[0] + v[1] + v[2] + v[5] + v[6]  # user nice system irq softirq
    except (OSError, ValueError):
        return {}
    return out


def thread_ticks(tid: int) -> int:
    """CPU time (user + system, clock ticks) of this process's thread `tid` (/proc/self/task)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[11]) + int(rest[12])  # utime, stime
    except (OSError, ValueError, IndexError):
        return 0
