"""kvtier.threads: the compute-thread plan, the wait policy, real pinning (in a subprocess, so
that this process's threads keep their CPUs) and the adaptive team's policy (driven by
injected /proc readings and clock)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from kvtier import threads
from kvtier.threads import AdaptiveTeam, ThreadPlan, parse_cpu_list, plan_threads, set_wait_policy


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list(" 5 ") == [5]
    for bad in ("", "a", "3-1", "0,0", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_small_machine_computes_on_every_cpu(monkeypatch):
    for k in (threads.BIND_ENV, threads.NUM_THREADS_ENV, threads.RESERVED_ENV):
        monkeypatch.delenv(k, raising=False)
    plan = plan_threads(usable=frozenset({0, 1}), quota=None)
    assert plan.compute_cpus == (0, 1) and plan.num_threads == 2 and plan.io_cpus == (0, 1)
    assert plan_threads(num_threads=1, usable=frozenset({0, 1}), quota=None).compute_cpus == (0,)


def test_cgroup_quota_caps_the_team(monkeypatch):
    monkeypatch.delenv(threads.BIND_ENV, raising=False)
    plan = plan_threads(usable=frozenset(range(64)), quota=2.0)
    assert plan.num_threads == 2 and plan.compute_cpus == (0, 1)


def test_server_machine_uses_physical_cores_of_one_node(monkeypatch):
    for k in (threads.BIND_ENV, threads.NUM_THREADS_ENV, threads.RESERVED_ENV):
        monkeypatch.delenv(k, raising=False)
    # 2 nodes x 8 cores x 2 hyperthreads: cpu c and c + 16 are siblings; node 0 = 0-7,16-23
    nodes = {0: [*range(8), *range(16, 24)], 1: [*range(8, 16), *range(24, 32)]}
    siblings = {c: sorted({c % 16, c % 16 + 16}) for c in range(32)}
    plan = plan_threads(usable=frozenset(range(32)), quota=None, topology=(nodes, siblings))
    assert plan.compute_cpus == tuple(range(8))
    assert set(plan.io_cpus) == set(range(8, 32))  # helpers: siblings and the other node
    # one node, no SMT: one core reserved for the helpers
    one = plan_threads(
        usable=frozenset(range(16)), quota=None, topology=({0: list(range(16))}, {c: [c] for c in range(16)})
    )
    assert one.compute_cpus == tuple(range(15)) and one.io_cpus == (15,)
    assert (
        plan_threads(
            reserved=4,
            usable=frozenset(range(16)),
            quota=None,
            topology=({0: list(range(16))}, {c: [c] for c in range(16)}),
        ).num_threads
        == 12
    )


def test_cpu_list_and_nobind(monkeypatch):
    monkeypatch.delenv(threads.NUM_THREADS_ENV, raising=False)
    plan = plan_threads("1", usable=frozenset({0, 1}), quota=None)
    assert plan.compute_cpus == (1,) and plan.io_cpus == (0,)
    with pytest.raises(ValueError, match="not usable"):
        plan_threads("0-5", usable=frozenset({0, 1}), quota=None)
    with pytest.raises(ValueError, match="need 3 CPUs"):
        plan_threads("0-1", num_threads=3, usable=frozenset({0, 1}), quota=None)
    nobind = plan_threads("nobind", usable=frozenset({0, 1}), quota=None)
    assert nobind.compute_cpus == () and nobind.num_threads == 2
    monkeypatch.setenv(threads.BIND_ENV, "0")
    assert plan_threads(usable=frozenset({0, 1}), quota=None).compute_cpus == (0,)


def test_wait_policy():
    env: dict[str, str] = {}
    assert set_wait_policy(env) == "bounded" and env == {"GOMP_SPINCOUNT": str(threads.DEFAULT_SPINCOUNT)}
    env = {threads.WAIT_ENV: "passive"}
    set_wait_policy(env)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env
    env = {"OMP_WAIT_POLICY": "ACTIVE", threads.WAIT_ENV: "passive"}
    assert set_wait_policy(env).startswith("user") and env["OMP_WAIT_POLICY"] == "ACTIVE"
    with pytest.raises(ValueError):
        set_wait_policy({threads.WAIT_ENV: "sometimes"})
    with pytest.raises(ValueError):
        set_wait_policy({threads.SPINCOUNT_ENV: "many"})
    import torch  # noqa: F401 - loaded: the process's libgomp is configured, leave it be

    before = dict(os.environ)
    assert set_wait_policy().startswith("torch already loaded") and dict(os.environ) == before


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any barrier-wait setting (so kvtier would choose one), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", threads.WAIT_ENV)}
    env.pop(threads.SPINCOUNT_ENV, None)
    return {**env, **extra}


@pytest.mark.parametrize("module", ["kvtier", "kvtier.kvcache", "kvtier.threads", "kvtier.heap", "kvtier.cli.main"])
def test_importing_kvtier_changes_no_environment_variable(module):
    script = f"import os; before = dict(os.environ); import {module}; assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_clean_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr


def _libgomp_read(stderr: str) -> dict[str, str]:
    """What libgomp read at load (its OMP_DISPLAY_ENV=VERBOSE report)."""
    out = {}
    for line in stderr.splitlines():
        key, sep, value = line.strip().partition(" = ")
        if sep and key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
            out[key] = value.strip("'")
    return out


_CLI_SCRIPT = """
from kvtier.cli.main import main
try:
    main(["--help"])  # the `kvtier` command's entry; --help exits before any subcommand runs
except SystemExit:
    pass
import torch  # a subcommand building an engine loads torch (and its libgomp) after main began
"""


@pytest.mark.parametrize(
    ("wait", "spincount"), [(None, str(threads.DEFAULT_SPINCOUNT)), ("passive", "0"), ("sometimes", None)]
)
def test_the_cli_sets_the_wait_policy_that_libgomp_reads(wait, spincount):
    extra = {"OMP_DISPLAY_ENV": "VERBOSE"} | ({threads.WAIT_ENV: wait} if wait else {})
    plain = subprocess.run(
        [sys.executable, "-c", "import torch"], capture_output=True, text=True, env=_clean_env(**extra), timeout=120
    )
    default = _libgomp_read(plain.stderr)["GOMP_SPINCOUNT"]  # libgomp's own, nothing set
    proc = subprocess.run(
        [sys.executable, "-c", _CLI_SCRIPT], capture_output=True, text=True, env=_clean_env(**extra), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    read = _libgomp_read(proc.stderr)
    if spincount is None:  # a bad KVTIER_OMP_WAIT: a warning that names it, libgomp's default kept
        assert f"{threads.WAIT_ENV} must be bounded, passive or active" in proc.stderr
        assert read["GOMP_SPINCOUNT"] == default
    else:
        assert read["GOMP_SPINCOUNT"] == spincount != default


def test_the_engine_process_sets_the_wait_policy_before_torch_loads(tmp_path):
    """`python -m kvtier.server.engine_proc` started without `kvtier serve`'s environment: it builds
    its engine with `from kvtier import LLM`, which sets the policy before torch loads (the engine
    here fails on a missing model, after torch loaded)."""
    import json

    settings = {
        "to_engine": f"ipc://{tmp_path}/to",
        "from_engine": f"ipc://{tmp_path}/from",
        "model": str(tmp_path / "no-model"),
        "engine_kwargs": {},
        "log_level": "CRITICAL",
    }
    log = tmp_path / "stderr"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.server.engine_proc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
            env=_clean_env(OMP_DISPLAY_ENV="VERBOSE"),
        )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(settings) + "\n")
    proc.stdin.flush()  # stdin stays open: its EOF would tell the engine that the server is gone
    try:
        assert proc.wait(timeout=120) == 1  # the missing model
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait()
    stderr = log.read_text()
    assert _libgomp_read(stderr)["GOMP_SPINCOUNT"] == str(threads.DEFAULT_SPINCOUNT), stderr


_PIN_SCRIPT = r"""
import json, os, threading
import kvtier
from kvtier import threads
import torch
out = {}
def run():
    plan = threads.configure()
    x = torch.randn(256, 256)
    for _ in range(3):
        x = torch.tanh(x @ x)
    tids = threads.pin_team(plan.compute_cpus)
    out["plan"] = list(plan.compute_cpus)
    out["team"] = {str(cpu): sorted(os.sched_getaffinity(tid)) for cpu, tid in tids.items()}
    out["me"] = sorted(os.sched_getaffinity(0))
    out["threads"] = torch.get_num_threads()
t = threading.Thread(target=run); t.start(); t.join()
print(json.dumps(out))
"""


def test_compute_threads_are_pinned_one_per_cpu():
    usable = sorted(os.sched_getaffinity(0))
    env = {**os.environ, threads.BIND_ENV: ",".join(map(str, usable[:2]))}
    env.pop(threads.NUM_THREADS_ENV, None)
    proc = subprocess.run([sys.executable, "-c", _PIN_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["plan"] == usable[:2] and out["threads"] == len(usable[:2])
    assert out["me"] == [usable[0]]  # the stepping thread is team thread 0
    assert out["team"] == {str(c): [c] for c in usable[:2]}


def test_helper_threads_leave_the_compute_cpus(monkeypatch):
    from kvtier.threads import binding

    monkeypatch.setattr(binding, "_plan", ThreadPlan(1, (0,), (0, 1), "test"))
    assert threads.io_cpus() == (0, 1)


_HELPER_TEAM_SCRIPT = r"""
import json, os, threading, time
from concurrent.futures import ThreadPoolExecutor
import torch
from kvtier import threads
torch.set_num_threads(2)
big, src = torch.empty(4_000_000), torch.ones(4_000_000)
big.copy_(src)  # the main thread's team exists
def tasks():
    return len(os.listdir("/proc/self/task"))
def copy_and_count():
    big.copy_(src)  # parallel where this thread may make a team
    return tasks()
base = tasks()
out = {}
for name, init in (("helper", threads.on_helper_thread), ("plain", None)):
    deadline = time.monotonic() + 10
    while tasks() != base and time.monotonic() < deadline:  # the last pool's threads are gone
        time.sleep(0.01)
    with ThreadPoolExecutor(1, initializer=init) as pool:
        out[name] = pool.submit(copy_and_count).result() - base
deadline = time.monotonic() + 10
while tasks() != base and time.monotonic() < deadline:
    time.sleep(0.01)
def build():
    big.copy_(src)  # loading a model opens parallel regions: a team on this thread
    return tasks() - base
out["during_build"] = threads.build_off_thread(build)
deadline = time.monotonic() + 10
while tasks() != base and time.monotonic() < deadline:
    time.sleep(0.01)
out["after_build"] = tasks() - base
out["main_threads"] = torch.get_num_threads()
later = {}
t = threading.Thread(target=lambda: later.update(n=torch.get_num_threads())); t.start(); t.join()
out["later_thread_threads"] = later["n"]
print(json.dumps(out))
"""


def test_helper_threads_make_no_openmp_team_of_their_own():
    """A torch op on a helper thread (a tier copy) runs on that thread alone: a team of its own
    beside the compute team would make libgomp cut every barrier's spin (threads outnumber the
    CPUs), which cost vLLM's decode with kvtier's connector 15-40% on 2 cores. torch's own
    thread count, for the compute thread and threads started later, stays as it was."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(
        [sys.executable, "-c", _HELPER_TEAM_SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["plain"] == 2  # the pool thread and its team's second thread: what the test detects
    assert out["helper"] == 1  # the pool thread alone
    assert out["main_threads"] == 2 and out["later_thread_threads"] == 2
    # an engine built off thread: its team (builder + 1) goes when the building thread ends
    assert out["during_build"] == 2 and out["after_build"] == 0


def test_build_off_thread_returns_the_result_and_reraises_the_error():
    from kvtier.threads import binding

    seen = []

    def build():
        seen.append(threading.get_ident())
        return "engine"

    assert threads.build_off_thread(build) == "engine"
    assert seen[0] != threading.get_ident() and seen[0] not in binding._bound_threads

    def fail():
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        threads.build_off_thread(fail)


class _Machine:
    """Injected /proc readings (per-CPU busy ticks, per-thread ticks) and clock, advanced by hand."""

    def __init__(self) -> None:
        self.t = 0.0
        self.busy = {0: 0, 1: 0}
        self.thread = {100: 0, 101: 0}
        self.teams: list[tuple[tuple[int, ...], int | None]] = []

    def pin(self, cpus, spread):
        self.teams.append((cpus, spread))
        return {i: 100 + i for i in range(spread or len(cpus))}

    def advance(self, seconds, ours, others):
        """`ours`: {thread id: fraction of a CPU}; `others`: CPUs' worth of other processes."""
        self.t += seconds
        for tid, frac in ours.items():
            self.thread[tid] += int(100 * seconds * frac)
        self.busy[0] += int(100 * seconds * (sum(ours.values()) + others))


def test_adaptive_team_shrinks_for_small_steps_while_a_cpu_is_taken_and_grows_back():
    m = _Machine()
    plan = ThreadPlan(2, (0, 1), (0, 1), "test")
    team = AdaptiveTeam(
        plan,
        interval_s=0.25,
        clock=lambda: m.t,
        cpu_busy=lambda cpus: dict(m.busy),
        thread_ticks=lambda tid: m.thread[tid],
        pin=m.pin,
    )
    team._hz = 100
    team.before_step(16)  # first reading: learns the team (pinned, one thread per CPU)
    assert m.teams == [((0, 1), None)] and team.cpus_taken == 0
    m.advance(0.5, ours={100: 1.0, 101: 1.0}, others=0.0)
    team.before_step(16)
    assert team.cpus_taken == 0 and team.num_threads == 2
    m.advance(0.5, ours={100: 0.6, 101: 0.6}, others=0.8)  # a neighbour takes most of a CPU
    team.before_step(16)
    assert team.cpus_taken == 1 and m.teams[-1] == ((0, 1), 1) and team.num_shrinks == 1
    assert not threads.dynamic_rows_active()
    team.before_step(2048)  # a prefill chunk keeps the whole pinned team, its GEMMs in dynamic row blocks
    assert m.teams[-1] == ((0, 1), None) and team.num_threads == 2
    assert threads.dynamic_rows_active()
    team.before_step(16)
    assert m.teams[-1] == ((0, 1), 1) and not threads.dynamic_rows_active()
    team.dynamic_rows = False  # KVTIER_DYNAMIC_ROWS=0
    team.before_step(2048)
    assert not threads.dynamic_rows_active()
    team.dynamic_rows = True
    m.advance(0.5, ours={100: 1.0}, others=0.1)  # the neighbour left (noise below the threshold)
    team.before_step(16)
    assert team.cpus_taken == 0 and m.teams[-1] == ((0, 1), None)
    team.before_step(2048)  # no contention: oneDNN's own split
    assert not threads.dynamic_rows_active()


def _team_on(m: _Machine, lock, interval_s: float) -> AdaptiveTeam:
    def locked(f):
        def g(*a):
            with lock:
                return f(*a)

        return g

    team = AdaptiveTeam(
        ThreadPlan(2, (0, 1), (0, 1), "test"),
        interval_s=interval_s,
        clock=locked(lambda: m.t),
        cpu_busy=locked(lambda cpus: dict(m.busy)),
        thread_ticks=locked(lambda tid: m.thread[tid]),
        pin=m.pin,
    )
    team._hz = 100
    return team


def _wait_for_samples(team: AdaptiveTeam, n: int) -> None:
    import time

    deadline = time.monotonic() + 30  # waits for the sampler thread; not a timing bound
    while team.num_samples < n:
        assert time.monotonic() < deadline, "the sampler thread took no readings"
        time.sleep(0.005)


@pytest.mark.parametrize("sampler", [False, True])
def test_first_step_after_an_idle_spell_sees_the_last_interval_with_the_sampler(sampler):
    """A neighbour busy on one CPU while the engine idled, gone before the next step (vLLM's
    benchmark client starting up, say). Without the sampler thread the step's reading covers the
    whole spell and the step takes the contended paths; with it, the reading is the last
    interval's, and the step runs as on a quiet machine."""
    import threading

    m, lock = _Machine(), threading.Lock()
    team = _team_on(m, lock, interval_s=0.25 if not sampler else 0.01)
    if sampler:
        team.start_sampler()
    try:
        team.before_step(16)  # learns the team; without the sampler, the first reading
        _wait_for_samples(team, 1)
        with lock:
            m.advance(5.0, ours={}, others=1.0)  # idle, the neighbour busy on a CPU
        if sampler:
            _wait_for_samples(team, team.num_samples + 2)
            assert team.cpus_taken == 1  # while it runs, the sampler sees it
        with lock:
            m.advance(0.25, ours={}, others=0.0)  # the neighbour ends; requests arrive
        if sampler:
            _wait_for_samples(team, team.num_samples + 2)
        team.before_step(896)
        if sampler:
            assert team.cpus_taken == 0 and not threads.dynamic_rows_active() and team.num_threads == 2
        else:
            assert team.cpus_taken == 1 and threads.dynamic_rows_active()  # what the sampler fixes
    finally:
        team.stop_sampler()
        threads.set_dynamic_rows(False)


def test_sampler_thread_ends_with_its_team():
    import gc
    import threading

    m, lock = _Machine(), threading.Lock()
    team = _team_on(m, lock, interval_s=0.01)
    team.start_sampler()
    thread = team._sampler
    assert thread is not None and thread.is_alive()
    del team
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_run_dynamic_runs_every_block_once_on_the_team_and_reraises():
    import threading

    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def body(i: int) -> None:
        with lock:
            seen.append((i, threading.get_native_id()))

    assert threads.run_dynamic(37, body, num_threads=2)
    assert sorted(i for i, _ in seen) == list(range(37))
    assert threads.run_dynamic(0, body, num_threads=2)  # nothing to do

    def bad(i: int) -> None:
        if i == 3:
            raise ValueError("block 3")

    with pytest.raises(ValueError, match="block 3"):
        threads.run_dynamic(8, bad, num_threads=2)


def test_adaptive_team_is_off_for_one_cpu_or_by_env(monkeypatch):
    assert not AdaptiveTeam(ThreadPlan(1, (0,), (0,), "test")).enabled
    monkeypatch.setenv(threads.ADAPTIVE_ENV, "0")
    assert not AdaptiveTeam(ThreadPlan(2, (0, 1), (0, 1), "test")).enabled


def test_env_switch_accepts_the_usual_spellings_and_rejects_the_rest():
    name = threads.DYNAMIC_ROWS_ENV
    assert threads.env_switch(name, {})  # unset: on
    assert threads.env_switch(name, {name: ""})
    for on in ("1", "true", "YES", " on "):
        assert threads.env_switch(name, {name: on})
    for off in ("0", "False", "no", "OFF"):
        assert not threads.env_switch(name, {name: off})
    with pytest.raises(ValueError, match=f"{name} must be one of .*got 'disable'"):
        threads.env_switch(name, {name: "disable"})
