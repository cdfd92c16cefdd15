"""Compute threads: how many, on which CPUs, and how they wait.

A CPU engine's speed is its OpenMP team's: torch's ops, MKL's matmuls and kvtier's native
kernels (kvtier/model/csrc) all run on one libgomp thread pool, and each op ends in a barrier.
Left alone, that team is unpinned and spin-waits at every barrier, which is right on an idle
machine and ruinous on a shared one: when another process takes a core the scheduler stacks
two team threads on the other, and each burns its time slice spinning for the one it displaced.
kvtier therefore, like vLLM's `VLLM_CPU_OMP_THREADS_BIND`:

* pins one compute thread per CPU of its compute set (`bind_compute_threads`, run on the thread
  that steps the engine, since libgomp keeps one pool per calling thread);
* waits at barriers by spinning for a bounded time and then sleeping (`GOMP_SPINCOUNT`), so a
  thread whose partner was preempted gives its core back instead of spinning for a whole slice;
* keeps its own helper threads (tier I/O, admin work, the request log, the HTTP server process)
  off the compute CPUs where there are CPUs to spare (`io_cpus`, `on_helper_thread`).

Settings (environment variables; `kvtier serve --cpu-threads-bind/--num-threads` set the first
two for the engine process):

    KVTIER_CPU_THREADS_BIND  auto (default) | nobind | a CPU list such as 0-3,8
        auto, up to 4 usable CPUs: compute on all of them, helpers float.
        auto, more CPUs: one compute thread per physical core (SMT siblings left out) of the
        NUMA node with the most usable cores, minus the reserved cores, which the helpers get.
        nobind: no pinning; torch's default team (or KVTIER_NUM_THREADS).
    KVTIER_NUM_THREADS       compute threads (default: one per CPU of the compute set; with a
                             CPU list, threads beyond its length are refused)
    KVTIER_RESERVED_CPUS     CPUs kept for helpers under auto (default 0 up to 4 usable CPUs,
                             else 1 per 16, at least 1)
    KVTIER_OMP_WAIT          bounded (default) | passive | active: barrier waiting. bounded sets
                             GOMP_SPINCOUNT=KVTIER_OMP_SPINCOUNT (default 20000: a short
                             spin); passive sleeps at once (OMP_WAIT_POLICY=PASSIVE);
                             active is libgomp's own default. An OMP_WAIT_POLICY or
                             GOMP_SPINCOUNT already set wins over all three.

"Usable" CPUs are this process's affinity mask, capped by a cgroup CPU quota (cpu.max), so a
container limited to 2 CPUs of a 64-core host gets 2 compute threads.

The wait policy is read by libgomp when torch is imported, so it is set (`apply_wait_policy`, in
kvtier.threads.wait) by the entries that start an engine, before they import torch: the `kvtier`
command's `main` (its child processes, `kvtier serve`'s engine process among them, inherit it)
and the first access of `kvtier.LLM` (the offline API; the engine process builds its engine so
too). Importing kvtier or any of its modules changes no environment variable. A program that
imports torch before kvtier (vLLM loading kvtier's connector) keeps its own policy, and so do
the processes it starts.

One module per concern: topology (the machine's CPUs), plan (the thread plan), omp (libgomp:
parallel regions, pinning a team), binding (this process's plan in force, compute and helper
threads), dynamic (row blocks on a dynamic schedule), adaptive (the adaptive team and its load
sampler; load: the /proc readings), wait (barrier waiting), env (on/off switches). The names
below are the package's interface; module state (the plan in force, the dynamic-rows flag)
lives in its module.
"""

from __future__ import annotations

from kvtier.threads.adaptive import ADAPTIVE_ENV, DYNAMIC_ROWS_ENV, AdaptiveTeam
from kvtier.threads.binding import (
    bind_compute_threads,
    build_off_thread,
    configure,
    current_plan,
    io_cpus,
    on_helper_thread,
    release_current_thread,
)
from kvtier.threads.dynamic import dynamic_rows_active, run_dynamic, set_dynamic_rows
from kvtier.threads.env import env_switch
from kvtier.threads.omp import pin_team
from kvtier.threads.plan import BIND_ENV, NUM_THREADS_ENV, RESERVED_ENV, SMALL_MACHINE_CPUS, ThreadPlan, plan_threads
from kvtier.threads.topology import cgroup_cpu_limit, parse_cpu_list
from kvtier.threads.wait import (
    DEFAULT_SPINCOUNT,
    SPINCOUNT_ENV,
    WAIT_ENV,
    apply_wait_policy,
    set_wait_policy,
    wait_in_force,
)

__all__ = [
    "ADAPTIVE_ENV",
    "BIND_ENV",
    "DEFAULT_SPINCOUNT",
    "DYNAMIC_ROWS_ENV",
    "NUM_THREADS_ENV",
    "RESERVED_ENV",
    "SMALL_MACHINE_CPUS",
    "SPINCOUNT_ENV",
    "WAIT_ENV",
    "AdaptiveTeam",
    "ThreadPlan",
    "apply_wait_policy",
    "bind_compute_threads",
    "build_off_thread",
    "cgroup_cpu_limit",
    "configure",
    "current_plan",
    "dynamic_rows_active",
    "env_switch",
    "io_cpus",
    "on_helper_thread",
    "parse_cpu_list",
    "pin_team",
    "plan_threads",
    "release_current_thread",
    "run_dynamic",
    "set_dynamic_rows",
    "set_wait_policy",
    "wait_in_force",
]
