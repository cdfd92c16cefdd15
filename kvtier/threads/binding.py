"""This process's thread plan in force: `configure` chooses it once and sizes torch's team, each
stepping thread's OpenMP team is pinned to the compute CPUs on demand, and helper threads move
to the helper CPUs (`on_helper_thread`)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.threads.omp import libgomp, pin_team, serial_thread
from kvtier.threads.plan import ThreadPlan, plan_threads
from kvtier.threads.topology import ORIGINAL_CPUS
from kvtier.threads.wait import wait_in_force

logger = logging.getLogger(__name__)

T = TypeVar("T")

_lock = threading.Lock()
_plan: ThreadPlan | None = None
_bound_threads: set[int] = set()


def current_plan() -> ThreadPlan | None:
    """The plan `configure` applied (None before)."""
    return _plan


def configure(bind: str | None = None, num_threads: int | None = None) -> ThreadPlan:
    """Choose the plan (once per process; a later call with other settings replaces it), set
    torch's thread count and pin the calling thread's team. Returns the plan."""
    global _plan
    import torch

    plan = plan_threads(bind, num_threads)
    with _lock:
        changed = plan != _plan
        _plan = plan
        if changed:
            _bound_threads.clear()
    if torch.get_num_threads() != plan.num_threads:
        torch.set_num_threads(plan.num_threads)
    bind_compute_threads()
    if changed:
        logger.info("compute threads: %s; barrier wait: %s", plan.describe(), wait_in_force())
    return plan


def bind_compute_threads() -> bool:
    """Pin the calling thread's OpenMP team, thread i to compute CPU i (the caller is thread
    0). A no-op without a pinned plan or when this thread's team is already bound; False when
    the OpenMP runtime could not be reached (the team then runs unpinned)."""
    plan = _plan
    if plan is None or not plan.compute_cpus:
        return True
    me = threading.get_ident()
    if me in _bound_threads:
        return True
    lib = libgomp()
    if lib is None:
        logger.warning("could not find the OpenMP runtime; compute threads are not pinned")
        return False
    if pin_team(plan.compute_cpus, lib) is None:
        return False
    _bound_threads.add(me)
    return True


def release_current_thread() -> None:
    """The calling thread stops being a compute thread (it built the engine, another thread
    steps it): it moves to the helper CPUs; its team, if it makes one, is re-pinned on demand."""
    _bound_threads.discard(threading.get_ident())
    on_helper_thread()


def build_off_thread(factory: Callable[[], T]) -> T:
    """`factory()` (an engine's construction) run on a thread that ends when it returns; its
    result, or its exception re-raised here. For an engine another thread will step (the
    in-process server, a Ray Serve replica): loading the model opens parallel regions, and the
    OpenMP team they leave on the building thread lives as long as that thread. Beside the
    stepping thread's team it makes libgomp's threads outnumber the CPUs, which cuts every
    barrier's spin short (`omp.serial_thread`): 13-31% slower decode steps measured on 2 cores.
    A thread that ends takes its team with it."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = factory()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            box["error"] = e
        finally:
            release_current_thread()  # its id may be reused by the thread that steps

    t = threading.Thread(target=run, name="kvtier-build", daemon=True)  # Ctrl-C while loading exits
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def io_cpus() -> tuple[int, ...]:
    """Where helper threads should run: the plan's spare CPUs, or every usable one."""
    plan = _plan
    return plan.io_cpus if plan is not None else tuple(sorted(ORIGINAL_CPUS))


def on_helper_thread() -> None:
    """Run at the start of a helper thread (a ThreadPoolExecutor initializer): move it off the
    compute CPUs it may have inherited from the thread that created it, and keep the torch ops
    it runs (tier copies) on itself, so that it never makes an OpenMP team of its own beside
    the compute team (`kvtier.threads.omp.serial_thread` says why that matters)."""
    try:
        os.sched_setaffinity(0, set(io_cpus()))
    except (OSError, AttributeError):
        pass
    serial_thread()
