"""The thread plan: how many compute threads, on which CPUs, and where the helper threads go,
chosen from the settings (KVTIER_CPU_THREADS_BIND, KVTIER_NUM_THREADS, KVTIER_RESERVED_CPUS)
and the machine (kvtier.threads.topology). Pure: it reads the machine and pins nothing."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from kvtier.threads.topology import ORIGINAL_CPUS, cgroup_cpu_limit, numa_nodes, parse_cpu_list, thread_siblings

BIND_ENV = "KVTIER_CPU_THREADS_BIND"
NUM_THREADS_ENV = "KVTIER_NUM_THREADS"
RESERVED_ENV = "KVTIER_RESERVED_CPUS"
SMALL_MACHINE_CPUS = 4


@dataclass(frozen=True)
class ThreadPlan:
    """Where compute and helper threads run."""

    num_threads: int
    compute_cpus: tuple[int, ...]
    """One per compute thread, in team order; empty: not pinned."""
    io_cpus: tuple[int, ...]
    """Where helper threads run (all usable CPUs when none are spare)."""
    source: str
    """How the plan was chosen (for the log and the benchmarks)."""

    def describe(self) -> str:
        where = ",".join(map(str, self.compute_cpus)) if self.compute_cpus else "unpinned"
        return (
            f"{self.num_threads} compute threads on {where}; helpers on "
            f"{','.join(map(str, self.io_cpus))} ({self.source})"
        )


def plan_threads(
    bind: str | None = None,
    num_threads: int | None = None,
    reserved: int | None = None,
    usable: frozenset[int] | None = None,
    quota: float | bool | None = False,
    topology: tuple[dict[int, list[int]], dict[int, list[int]]] | None = None,
) -> ThreadPlan:
    """The plan for `bind` (default KVTIER_CPU_THREADS_BIND or auto). The keyword arguments past
    `reserved` describe the machine (tests give them; by default it is read)."""
    env = os.environ
    bind = (bind if bind is not None else env.get(BIND_ENV, "auto")).strip() or "auto"
    if num_threads is None:
        num_threads = _int_env(NUM_THREADS_ENV)
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"the number of compute threads must be >= 1, got {num_threads}")
    if reserved is None:
        reserved = _int_env(RESERVED_ENV)
    cpus = sorted(usable if usable is not None else ORIGINAL_CPUS)
    limit = cgroup_cpu_limit() if quota is False else quota
    budget = len(cpus) if limit is None else max(1, min(len(cpus), math.ceil(limit - 1e-9)))

    if bind == "nobind":
        return ThreadPlan(num_threads or budget, (), tuple(cpus), "nobind")
    if bind != "auto":
        return _listed_plan(bind, num_threads, cpus)
    if budget <= SMALL_MACHINE_CPUS:
        compute = tuple(cpus[:budget])[:num_threads]  # [:None]: all of them
        return ThreadPlan(len(compute), compute, tuple(cpus), "auto: small machine, every CPU computes")
    if topology is None:
        topology = (numa_nodes(), {c: thread_siblings(c) for c in cpus})
    return _auto_plan(cpus, budget, num_threads, reserved, *topology)


def _int_env(name: str) -> int | None:
    """An integer environment variable; None when unset or empty."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _listed_plan(bind: str, num_threads: int | None, cpus: list[int]) -> ThreadPlan:
    """A CPU list (`0-3,8`): compute on its first `num_threads` CPUs (all by default), in its order."""
    listed = parse_cpu_list(bind)
    outside = [c for c in listed if c not in cpus]
    if outside:
        raise ValueError(
            f"CPU {outside[0]} of {BIND_ENV}/--cpu-threads-bind={bind!r} is not usable by "
            f"this process (usable: {','.join(map(str, cpus))})"
        )
    if num_threads is not None and num_threads > len(listed):
        raise ValueError(f"{num_threads} compute threads need {num_threads} CPUs; the list {bind!r} has {len(listed)}")
    compute = tuple(listed[: num_threads or len(listed)])
    rest = tuple(c for c in cpus if c not in compute)
    return ThreadPlan(len(compute), compute, rest or tuple(cpus), "list")


def _auto_plan(
    cpus: list[int],
    budget: int,
    num_threads: int | None,
    reserved: int | None,
    nodes: dict[int, list[int]],
    siblings: dict[int, list[int]],
) -> ThreadPlan:
    """auto on a machine of more than SMALL_MACHINE_CPUS: one compute thread per physical core
    (the lowest usable CPU of its SMT siblings) of the NUMA node with the most of them, less the
    cores reserved for helpers (`reserved`; default none when other CPUs are spare, else 1 per 16)."""
    usable_set = set(cpus)
    best: list[int] = []
    for node_cpus in nodes.values() or [cpus]:
        mine = [c for c in node_cpus if c in usable_set]
        physical = [c for c in mine if min(s for s in siblings.get(c, [c]) if s in usable_set) == c]
        if len(physical) > len(best):
            best = physical
    best = best or cpus
    spare = [c for c in cpus if c not in best]
    keep = reserved if reserved is not None else (0 if spare else max(1, len(best) // 16))
    cores = best[: max(1, min(len(best) - keep, budget))] if keep < len(best) else best[:1]
    if num_threads is not None:
        cores = cores[:num_threads]
    io = tuple(c for c in cpus if c not in cores) or tuple(cpus)
    return ThreadPlan(len(cores), tuple(cores), io, f"auto: physical cores of one NUMA node, {keep} reserved")
