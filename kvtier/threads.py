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

The wait policy is read by libgomp when torch is imported: `kvtier` sets it on its own import
(`set_wait_policy`) if torch is not loaded yet. A program that imports torch before kvtier (vLLM
loading kvtier's connector) keeps its own policy, and so do the processes it starts.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

BIND_ENV = "KVTIER_CPU_THREADS_BIND"
NUM_THREADS_ENV = "KVTIER_NUM_THREADS"
RESERVED_ENV = "KVTIER_RESERVED_CPUS"
WAIT_ENV = "KVTIER_OMP_WAIT"
SPINCOUNT_ENV = "KVTIER_OMP_SPINCOUNT"
DEFAULT_SPINCOUNT = 20000
SMALL_MACHINE_CPUS = 4

_ORIGINAL_CPUS: frozenset[int] = (
    frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(range(os.cpu_count() or 1))
)
"""The affinity mask the process started with (before any pinning)."""


def set_wait_policy(environ: dict[str, str] | None = None) -> str:
    """Set libgomp's barrier waiting from KVTIER_OMP_WAIT unless OMP_WAIT_POLICY or
    GOMP_SPINCOUNT is already set; must run before torch is imported. Returns what is in force."""
    env = os.environ if environ is None else environ
    if environ is None and "torch" in sys.modules:
        # too late for this process's libgomp, and the program that loaded torch (vLLM with
        # kvtier's connector, say) owns its threads and its children's: leave both alone
        return "torch already loaded: unchanged"
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return f"user: OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY', '')} GOMP_SPINCOUNT={env.get('GOMP_SPINCOUNT', '')}"
    mode = env.get(WAIT_ENV, "bounded").strip().lower() or "bounded"
    if mode == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif mode == "bounded":
        count = env.get(SPINCOUNT_ENV, str(DEFAULT_SPINCOUNT))
        if not count.isdigit():
            raise ValueError(f"{SPINCOUNT_ENV} must be a non-negative integer, got {count!r}")
        env["GOMP_SPINCOUNT"] = count
    elif mode != "active":
        raise ValueError(f"{WAIT_ENV} must be bounded, passive or active, got {mode!r}")
    return mode


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


def _siblings(cpu: int) -> list[int]:
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
        return parse_cpu_list(text.strip())
    except (OSError, ValueError):
        return [cpu]


def _numa_nodes() -> dict[int, list[int]]:
    nodes: dict[int, list[int]] = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            nodes[int(node.name[4:])] = parse_cpu_list((node / "cpulist").read_text().strip())
        except (OSError, ValueError):
            continue
    return nodes


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
    if num_threads is None and env.get(NUM_THREADS_ENV):
        try:
            num_threads = int(env[NUM_THREADS_ENV])
        except ValueError:
            raise ValueError(f"{NUM_THREADS_ENV} must be an integer, got {env[NUM_THREADS_ENV]!r}") from None
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"the number of compute threads must be >= 1, got {num_threads}")
    if reserved is None and env.get(RESERVED_ENV):
        try:
            reserved = int(env[RESERVED_ENV])
        except ValueError:
            raise ValueError(f"{RESERVED_ENV} must be an integer, got {env[RESERVED_ENV]!r}") from None
    cpus = sorted(usable if usable is not None else _ORIGINAL_CPUS)
    limit = cgroup_cpu_limit() if quota is False else quota
    budget = len(cpus) if limit is None else max(1, min(len(cpus), math.ceil(limit - 1e-9)))
    everything = tuple(cpus)

    if bind == "nobind":
        n = num_threads or budget
        return ThreadPlan(n, (), everything, "nobind")
    if bind != "auto":
        listed = parse_cpu_list(bind)
        outside = [c for c in listed if c not in cpus]
        if outside:
            raise ValueError(
                f"CPU {outside[0]} of {BIND_ENV}/--cpu-threads-bind={bind!r} is not usable by "
                f"this process (usable: {','.join(map(str, cpus))})"
            )
        if num_threads is not None and num_threads > len(listed):
            raise ValueError(
                f"{num_threads} compute threads need {num_threads} CPUs; the list {bind!r} has {len(listed)}"
            )
        compute = tuple(listed[: num_threads or len(listed)])
        rest = tuple(c for c in cpus if c not in compute)
        return ThreadPlan(len(compute), compute, rest or everything, "list")

    if budget <= SMALL_MACHINE_CPUS:
        compute = tuple(cpus[:budget])
        if num_threads is not None:
            compute = compute[:num_threads]
        return ThreadPlan(len(compute), compute, everything, "auto: small machine, every CPU computes")
    nodes, siblings = topology if topology is not None else (_numa_nodes(), {c: _siblings(c) for c in cpus})
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
    io = tuple(c for c in cpus if c not in cores) or everything
    return ThreadPlan(len(cores), tuple(cores), io, f"auto: physical cores of one NUMA node, {keep} reserved")


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
        logger.info("compute threads: %s; barrier wait: %s", plan.describe(), _wait_in_force())
    return plan


def _wait_in_force() -> str:
    env = os.environ
    if "OMP_WAIT_POLICY" in env:
        return f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}"
    if "GOMP_SPINCOUNT" in env:
        return f"GOMP_SPINCOUNT={env['GOMP_SPINCOUNT']}"
    return "libgomp default"


_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


_gomp: ctypes.CDLL | None = None


def _libgomp() -> ctypes.CDLL | None:
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
    lib = _libgomp()
    if lib is None:
        logger.warning("could not find the OpenMP runtime; compute threads are not pinned")
        return False
    if pin_team(plan.compute_cpus, lib) is None:
        return False
    _bound_threads.add(me)
    return True


def pin_team(
    cpus: tuple[int, ...], lib: ctypes.CDLL | None = None, num_threads: int | None = None
) -> dict[int, int] | None:
    """Pin the calling thread's team of len(cpus) threads, thread i to cpus[i]; returns
    {cpu: native thread id}, or None when that failed (logged). With `num_threads`, a team of
    that many threads each free to run on any of `cpus` (the kernel places them); the answer
    then maps team index -> thread id."""
    lib = lib or _libgomp()
    if lib is None:
        logger.warning("could not find the OpenMP runtime; compute threads are not pinned")
        return None
    errors: list[BaseException] = []
    tids: dict[int, int] = {}

    def pin(_: int | None) -> None:
        i = lib.omp_get_thread_num()
        try:
            if num_threads is None:
                os.sched_setaffinity(0, {cpus[i % len(cpus)]})  # 0: the calling thread (Linux)
                tids[cpus[i % len(cpus)]] = threading.get_native_id()
            else:
                os.sched_setaffinity(0, set(cpus))
                tids[i] = threading.get_native_id()
        except OSError as e:
            errors.append(e)

    cb = _FN(pin)
    lib.GOMP_parallel(cb, None, num_threads or len(cpus), 0)
    if errors:
        logger.warning("pinning compute threads failed (%s); they run unpinned", errors[0])
        return None
    return tids


def release_current_thread() -> None:
    """The calling thread stops being a compute thread (it built the engine, another thread
    steps it): it moves to the helper CPUs; its team, if it makes one, is re-pinned on demand."""
    _bound_threads.discard(threading.get_ident())
    on_helper_thread()


def io_cpus() -> tuple[int, ...]:
    """Where helper threads should run: the plan's spare CPUs, or every usable one."""
    plan = _plan
    return plan.io_cpus if plan is not None else tuple(sorted(_ORIGINAL_CPUS))


def on_helper_thread() -> None:
    """Run at the start of a helper thread (a ThreadPoolExecutor initializer): move it off the
    compute CPUs it may have inherited from the thread that created it."""
    try:
        os.sched_setaffinity(0, set(io_cpus()))
    except (OSError, AttributeError):
        pass


ADAPTIVE_ENV = "KVTIER_ADAPTIVE_THREADS"
DYNAMIC_ROWS_ENV = "KVTIER_DYNAMIC_ROWS"


_SWITCH_ON = ("1", "true", "yes", "on")
_SWITCH_OFF = ("0", "false", "no", "off")


def env_switch(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """An on/off environment variable, on when unset or empty: 1/true/yes/on or 0/false/no/off
    (any case); any other value is a ValueError that names the variable, never a silent default."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if value in _SWITCH_OFF:
        return False
    if value == "" or value in _SWITCH_ON:
        return True
    raise ValueError(f"{name} must be one of 1/true/yes/on or 0/false/no/off, got {raw!r}")


_dynamic_rows = False


def dynamic_rows_active() -> bool:
    """Whether big GEMMs should run in row blocks under a dynamic schedule (`run_dynamic`) this
    step: set by AdaptiveTeam for big steps while other processes take compute CPUs."""
    return _dynamic_rows


def set_dynamic_rows(on: bool) -> None:
    global _dynamic_rows
    _dynamic_rows = on


def run_dynamic(num_blocks: int, body: Callable[[int], None], num_threads: int | None = None) -> bool:
    """Run body(0) ... body(num_blocks - 1) on the calling thread's (pinned) OpenMP team, each
    thread taking the next block when it finishes its last (a dynamic schedule), so a thread
    whose CPU another process shares does fewer blocks instead of holding the others at a
    barrier. `body` runs inside the parallel region: the torch and oneDNN ops it calls see that
    and run on their own thread. Returns False, having run nothing, when the OpenMP runtime
    cannot be reached; re-raises the first exception a block raised."""
    lib = _libgomp()
    if lib is None:
        return False
    if num_blocks <= 0:
        return True
    plan = _plan
    n = num_threads or (len(plan.compute_cpus) if plan is not None and plan.compute_cpus else 0)
    n = n or max(1, os.cpu_count() or 1)
    blocks = iter(range(num_blocks))  # next() on a range iterator is atomic under the GIL
    errors: list[BaseException] = []

    def work(_: int | None) -> None:
        try:
            for i in blocks:
                if errors:
                    return
                body(i)
        except BaseException as e:  # noqa: BLE001 - a ctypes callback must not raise
            errors.append(e)

    cb = _FN(work)
    lib.GOMP_parallel(cb, None, min(n, num_blocks), 0)
    if errors:
        raise errors[0]
    return True


class AdaptiveTeam:
    """Shrinks the compute team when other processes take compute CPUs, and grows it back.

    Every so often (below) it reads the compute CPUs' busy time (/proc/stat) and subtracts this
    process's compute threads' time (/proc/self/task): what is left is other processes', in
    CPUs' worth. When that reaches `threshold` of a CPU (m CPUs taken), small steps (decode:
    many short parallel regions, each ending in a barrier that would wait a whole time slice for
    a preempted thread) run on n - m threads that the kernel places among the compute CPUs, so
    they end up on the free ones; steps of `big_step_tokens` or more (prefill: long regions,
    where even a shared core helps) keep the whole pinned team, and their big GEMMs run in row
    blocks that the threads take as they finish (`run_dynamic`), so the thread on a free CPU does
    more of them than the one sharing its CPU, where oneDNN's static split would make it wait
    for that one (`KVTIER_DYNAMIC_ROWS=0` keeps oneDNN's split). Without contention, or with one
    compute CPU, it does nothing. `KVTIER_ADAPTIVE_THREADS=0` switches it off.

    Call `before_step(num_tokens)` on the thread that steps the engine, before the forward. With
    `start_sampler()` (the engine's way) a helper thread reads the CPUs every 50 ms, idle or not,
    each reading over the last 150 ms: so the first step after an idle spell sees the load of
    now, not of the whole spell, and a burst that has ended (a benchmark client that built its
    requests on the same machine, then sent them) stops counting within about 0.2 s. Without the
    sampler, `before_step` reads itself, at most every `interval_s`, over the time since its last
    reading.
    """

    def __init__(
        self,
        plan: ThreadPlan,
        interval_s: float = 0.25,
        threshold: float = 0.3,
        big_step_tokens: int = 512,
        *,
        clock: Callable[[], float] | None = None,
        cpu_busy: Callable[[tuple[int, ...]], dict[int, int]] | None = None,
        thread_ticks: Callable[[int], int] | None = None,
        pin: Callable[[tuple[int, ...], int | None], dict[int, int] | None] | None = None,
    ) -> None:
        """The keyword-only arguments replace the clock, the /proc readers and the pinning
        (tests drive the policy with them)."""
        import time

        self.plan = plan
        self.interval_s = interval_s
        self.threshold = threshold
        self.big_step_tokens = big_step_tokens
        self._clock = clock or time.monotonic
        self._cpu_busy = cpu_busy or _cpu_busy_ticks
        self._thread_ticks = thread_ticks or _thread_ticks
        self._pin_team = pin or _pin_and_size
        self.enabled = len(plan.compute_cpus) >= 2 and env_switch(ADAPTIVE_ENV) and Path("/proc/stat").is_file()
        self.dynamic_rows = env_switch(DYNAMIC_ROWS_ENV)
        """Whether big steps under contention run their big GEMMs in row blocks on a dynamic
        schedule (kvtier.model.linear), rather than oneDNN's static split of the team."""
        self.cpus_taken = 0
        """Compute CPUs' worth of other processes' work (as of the last reading)."""
        self.num_shrinks = 0
        """Times the team shrank (for the log and the benchmarks)."""
        self.num_samples = 0
        """Readings of the CPUs taken so far."""
        self._mode: tuple[str, int] = ("pinned", len(plan.compute_cpus))
        self._tids: set[int] = set()
        self._readings: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=16)
        self._window_s = interval_s
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    @property
    def num_threads(self) -> int:
        """Threads of the team in force."""
        return self._mode[1]

    def before_step(self, num_tokens: int) -> None:
        if not self.enabled:
            set_dynamic_rows(False)
            return
        if not self._tids and not self._apply(self._mode):  # learn the team's thread ids
            return
        if self._sampler is None:
            now = self._clock()
            if not self._readings or now - self._readings[-1][0] >= self.interval_s:
                self._sample(now)
        n = len(self.plan.compute_cpus)
        want = ("pinned", n)
        if self.cpus_taken and num_tokens < self.big_step_tokens:
            want = ("spread", max(1, n - self.cpus_taken))
        set_dynamic_rows(self.dynamic_rows and bool(self.cpus_taken) and num_tokens >= self.big_step_tokens)
        if want != self._mode:
            if want[1] < self._mode[1]:
                self.num_shrinks += 1
            self._apply(want)

    def _apply(self, mode: tuple[str, int]) -> bool:
        tids = self._pin_team(self.plan.compute_cpus, None if mode[0] == "pinned" else mode[1])
        if tids is None:
            self.enabled = False
            return False
        with self._lock:
            self._tids.update(tids.values())
        self._mode = mode
        return True

    def start_sampler(self, period_s: float = 0.05, window_s: float = 0.15) -> None:
        """Read the CPUs every `period_s` on a helper thread (daemon; `stop_sampler` ends it);
        each reading is the load over the last `window_s`."""
        if not self.enabled or self._sampler is not None:
            return
        self._window_s = window_s
        self._stop.clear()
        self._sampler = threading.Thread(
            target=_sample_loop,
            args=(weakref.ref(self), self._stop, period_s),
            name="kvtier-cpu-sampler",
            daemon=True,
        )
        self._sampler.start()

    def stop_sampler(self) -> None:
        thread, self._sampler = self._sampler, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=5)

    def _sample(self, now: float) -> None:
        with self._lock:
            tids = tuple(self._tids)
        if not tids:  # the stepping thread has not made its team yet
            return
        busy = sum(self._cpu_busy(self.plan.compute_cpus).values())
        ours = sum(self._thread_ticks(t) for t in tids)
        self.num_samples += 1
        # The load over the last `_window_s`: from the newest reading at least that old (or the
        # oldest kept). The sampler reads more often than its window, so that a burst that has
        # ended stops counting within a window (the ticks are 10 ms: shorter windows are noise).
        base = self._readings[0] if self._readings else None
        for r in reversed(self._readings):
            if now - r[0] >= self._window_s:
                base = r
                break
        self._readings.append((now, busy, ours))
        if base is not None:
            t0, busy0, ours0 = base
            window = (now - t0) * self._hz
            if window > 0:
                others = max(0.0, (busy - busy0) - (ours - ours0)) / window
                taken = min(len(self.plan.compute_cpus) - 1, int(others + 1 - self.threshold))
                if taken != self.cpus_taken:
                    logger.info(
                        "other processes use %.1f of the compute CPUs; small steps run on %d threads",
                        others,
                        len(self.plan.compute_cpus) - taken,
                    )
                self.cpus_taken = taken


def _sample_loop(ref: weakref.ReferenceType[AdaptiveTeam], stop: threading.Event, period_s: float) -> None:
    """AdaptiveTeam's sampler thread; it ends with `stop` or when the team is gone (an engine
    dropped without close() leaves no thread behind)."""
    on_helper_thread()
    while not stop.wait(period_s):
        team = ref()
        if team is None:
            return
        try:
            team._sample(team._clock())
        except Exception:  # a failed reading must not end the sampling
            logger.exception("reading the compute CPUs' load failed")
        del team


def _pin_and_size(cpus: tuple[int, ...], spread: int | None) -> dict[int, int] | None:
    import torch

    torch.set_num_threads(spread or len(cpus))
    return pin_team(cpus, num_threads=spread)


def _cpu_busy_ticks(cpus: tuple[int, ...]) -> dict[int, int]:
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


def _thread_ticks(tid: int) -> int:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[11]) + int(rest[12])  # utime, stime
    except (OSError, ValueError, IndexError):
        return 0
