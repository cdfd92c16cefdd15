"""kvtier.heap: freed activations stay with the process (no page faults to touch them again).
Each case runs in a subprocess, since the thresholds are process-wide, in an environment of its
own: glibc's malloc settings (MALLOC_*_, GLIBC_TUNABLES), a preloaded allocator and
KVTIER_RETAIN_HEAP are left out of it, and it turns transparent huge pages off for itself (a
huge page is one fault for 512 pages), so that what the caller's environment or the machine's
THP mode sets changes nothing."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import heap

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import ctypes, json, resource, sys
PR_SET_THP_DISABLE = 41
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0)  # best effort (Linux >= 3.15)
from kvtier import heap
ok = heap.retain_freed_memory() if sys.argv[1] == "retain" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(5):  # a 64 MiB activation, allocated, written and freed each step
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(64 << 20)
    ctypes.memset(p, 1, 64 << 20)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"ok": ok, "faults": faults}))
"""


def _controlled_env() -> dict[str, str]:
    """os.environ without what changes the C heap's behaviour (or kvtier.heap's), kvtier importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD", heap.RETAIN_ENV)
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def _run(mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120, env=_controlled_env()
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


CALLER_ENVS = {
    "as-is": {},
    "arena-max": {"MALLOC_ARENA_MAX": "1"},
    "tunables": {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0:glibc.malloc.hugetlb=1"},
    "env-thresholds": {"MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_TOP_PAD_": "200000000", heap.RETAIN_ENV: "0"},
}
"""Caller environments the cases must not depend on (the last two failed them when the
subprocess inherited the caller's environment)."""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
@pytest.mark.parametrize("caller_env", CALLER_ENVS.values(), ids=CALLER_ENVS.keys())
def test_freed_activations_are_reused_without_page_faults(caller_env, monkeypatch):
    for name, value in caller_env.items():
        monkeypatch.setenv(name, value)
    pages = (64 << 20) // 4096
    default = _run("default")
    assert not default["ok"] and min(default["faults"][1:]) > pages // 2  # mapped anew each time
    kept = _run("retain")
    assert kept["ok"] and max(kept["faults"][1:]) < pages // 20  # the same pages again


def test_env_turns_it_off(monkeypatch):
    monkeypatch.setattr(heap, "_done", False)
    assert not heap.retain_freed_memory({heap.RETAIN_ENV: "0"})
    assert not heap._done
