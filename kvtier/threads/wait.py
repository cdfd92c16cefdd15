"""How libgomp's threads wait at barriers: the environment libgomp reads when torch loads it.

`set_wait_policy` writes OMP_WAIT_POLICY / GOMP_SPINCOUNT from KVTIER_OMP_WAIT; nothing runs it
on import. `apply_wait_policy` is its caller for the entries that start an engine before torch is
imported (the `kvtier` command's `main`, the first access of `kvtier.LLM`, which the engine
process of `kvtier serve` makes too): a bad value is a warning there, and libgomp's default stays.
"""

from __future__ import annotations

import os
import sys
import warnings

WAIT_ENV = "KVTIER_OMP_WAIT"
SPINCOUNT_ENV = "KVTIER_OMP_SPINCOUNT"
DEFAULT_SPINCOUNT = 20000


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


def apply_wait_policy() -> str:
    """`set_wait_policy` for this process (and the processes it starts) at an engine's entry,
    before torch is imported; a bad KVTIER_OMP_WAIT / KVTIER_OMP_SPINCOUNT is a warning and
    libgomp's default stays. Returns what is in force."""
    try:
        return set_wait_policy()
    except ValueError as e:
        warnings.warn(f"kvtier: {e}; using libgomp's default wait policy", stacklevel=2)
        return "libgomp default (bad setting)"


def wait_in_force() -> str:
    """The barrier wait this process's environment asks libgomp for (for the log)."""
    env = os.environ
    if "OMP_WAIT_POLICY" in env:
        return f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}"
    if "GOMP_SPINCOUNT" in env:
        return f"GOMP_SPINCOUNT={env['GOMP_SPINCOUNT']}"
    return "libgomp default"
