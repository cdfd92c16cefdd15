"""Dynamic row blocks: whether big GEMMs run in row blocks this step (a flag the adaptive team
sets) and `run_dynamic`, which hands the blocks to the calling thread's OpenMP team one at a
time as its threads finish (a dynamic schedule)."""

from __future__ import annotations

import os
from collections.abc import Callable

from kvtier.threads.binding import current_plan
from kvtier.threads.omp import libgomp, parallel

_dynamic_rows = False


def dynamic_rows_active() -> bool:
    """Whether big GEMMs should run in row blocks under a dynamic schedule (`run_dynamic`) this
    step: set by AdaptiveTeam for big steps while other processes take compute CPUs."""
    return _dynamic_rows


def set_dynamic_rows(on: bool) -> None:
    """Turn the row blocks on or off for the steps that follow (AdaptiveTeam, before each step)."""
    global _dynamic_rows
    _dynamic_rows = on


def run_dynamic(num_blocks: int, body: Callable[[int], None], num_threads: int | None = None) -> bool:
    """Run body(0) ... body(num_blocks - 1) on the calling thread's (pinned) OpenMP team, each
    thread taking the next block when it finishes its last (a dynamic schedule), so a thread
    whose CPU another process shares does fewer blocks instead of holding the others at a
    barrier. `body` runs inside the parallel region: the torch and oneDNN ops it calls see that
    and run on their own thread. Returns False, having run nothing, when the OpenMP runtime
    cannot be reached; re-raises the first exception a block raised."""
    lib = libgomp()
    if lib is None:
        return False
    if num_blocks <= 0:
        return True
    plan = current_plan()
    n = num_threads or (len(plan.compute_cpus) if plan is not None and plan.compute_cpus else 0)
    n = n or max(1, os.cpu_count() or 1)
    blocks = iter(range(num_blocks))  # next() on a range iterator is atomic under the GIL
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for i in blocks:
                if errors:
                    return
                body(i)
        except BaseException as e:  # noqa: BLE001 - a ctypes callback must not raise
            errors.append(e)

    parallel(work, min(n, num_blocks), lib)
    if errors:
        raise errors[0]
    return True
