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
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and line.rstrip().endswith((".so", ".so.1"))}
    except OSError:
        return None
    for path in sorted(paths):
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
