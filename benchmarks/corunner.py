"""A co-runner: another process that keeps CPU cores busy, for the contended benchmarks.

    python benchmarks/corunner.py --cores 1                # until interrupted
    python benchmarks/corunner.py --cores 1 --seconds 60
    python benchmarks/corunner.py --cores 1 --cpu 1        # pinned to CPU 1

Each busy core is one process spinning in pure Python (no syscalls, no memory traffic to speak
of), unpinned unless `--cpu` is given, so the kernel's scheduler places it as it would a
neighbour's job. A child process inherits the CPU affinity of the thread that starts it, and an
offline kvtier engine pins its compute thread (the caller's) to one CPU, so the co-runner (and any
peer a benchmark starts, with `preexec_fn=unpin`) first widens its affinity to every CPU again. The benchmarks use `running(cores)` around each measured engine:

    with corunner.running(1):
        ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator


def unpin() -> None:
    """Let the calling process run on every CPU it may use (the kernel intersects the mask with
    its cpuset): undoes the one-CPU affinity inherited from a pinned compute thread."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (OSError, AttributeError):
        pass


def spin(seconds: float | None, cpu: int | None) -> None:
    try:  # end with the benchmark that started it, also when that one is killed (Linux)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    else:
        unpin()
    end = None if seconds is None else time.monotonic() + seconds
    x = 0
    while end is None or time.monotonic() < end:
        for _ in range(100_000):
            x += 1


@contextlib.contextmanager
def running(cores: int, cpus: list[int] | None = None) -> Iterator[list[subprocess.Popen]]:
    """`cores` busy processes while the block runs (none for 0)."""
    procs = []
    try:
        for i in range(cores):
            cmd = [sys.executable, os.path.abspath(__file__), "--cores", "1", "--child"]
            if cpus:
                cmd += ["--cpu", str(cpus[i % len(cpus)])]
            procs.append(subprocess.Popen(cmd))
        time.sleep(0.5 if procs else 0)  # let them reach their loops
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cores", type=int, default=1, help="busy processes (default 1)")
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long (default: never)")
    ap.add_argument("--cpu", type=int, default=None, help="pin to this CPU (default: unpinned)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.child or args.cores == 1:
        try:
            spin(args.seconds, args.cpu)
        except KeyboardInterrupt:
            pass
        return
    with running(args.cores, [args.cpu] if args.cpu is not None else None) as procs:
        try:
            if args.seconds is None:
                for p in procs:
                    p.wait()
            else:
                time.sleep(args.seconds)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
