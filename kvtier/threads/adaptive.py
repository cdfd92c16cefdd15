"""The adaptive compute team: shrinks the team for small steps while other processes take
compute CPUs and grows it back, with the helper thread that samples the CPUs' load."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from kvtier.threads import load
from kvtier.threads.binding import on_helper_thread
from kvtier.threads.dynamic import set_dynamic_rows
from kvtier.threads.env import env_switch
from kvtier.threads.omp import pin_team
from kvtier.threads.plan import ThreadPlan

logger = logging.getLogger(__name__)

ADAPTIVE_ENV = "KVTIER_ADAPTIVE_THREADS"
DYNAMIC_ROWS_ENV = "KVTIER_DYNAMIC_ROWS"


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
        self.plan = plan
        self.interval_s = interval_s
        self.threshold = threshold
        self.big_step_tokens = big_step_tokens
        self._clock = clock or time.monotonic
        self._cpu_busy = cpu_busy or load.cpu_busy_ticks
        self._thread_ticks = thread_ticks or load.thread_ticks
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
