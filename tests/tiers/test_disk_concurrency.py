"""DiskTier under concurrency, on a real directory: no file-system call runs under the index
lock (so `contains_prefix`, the scheduler's per-step lookup, never waits on the disk), and
racing put/get/delete/eviction of the same keys keep every read whole and the index equal to
the files. Stalls are made with the tier's `before_io` seam and threading.Event, never timed.
Also: HostTier calls out (eviction callbacks, purge predicates) without its lock."""

from __future__ import annotations

import hashlib
import os
import random
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostEntry, HostTier

from .conftest import FINGERPRINT, make_keys

STALL_GUARD_S = 30.0
"""How long a stalled operation waits to be released before it goes on anyway: a guard against
hanging a broken build, never a measurement (the tests assert with events)."""


def charged(nbytes: int) -> int:
    """What a file of `nbytes` costs on the file system (whole blocks): what the cap counts."""
    block = os.stat(tempfile.gettempdir()).st_blksize
    return -(-nbytes // block) * block


def files_on_disk(tier: DiskTier) -> dict[str, int]:
    return {p.name: p.stat().st_blocks * 512 for p in tier.dir.glob("*/*") if p.is_file()}


def assert_index_matches_files(tier: DiskTier) -> None:
    """Every indexed key has a file of the indexed size, no other frame or temp file exists, and
    a tier rebuilt from the files finds the same entries."""
    index = tier.entry_sizes()
    on_disk = files_on_disk(tier)
    assert on_disk == {f"{k.hex()}.kv": size for k, size in index.items()}
    assert tier.usage_bytes == sum(index.values()) <= tier.capacity_bytes
    rebuilt = DiskTier(tier.dir.parent, tier.capacity_bytes, fingerprint=FINGERPRINT)
    assert set(rebuilt.keys()) == set(index) and rebuilt.usage_bytes == tier.usage_bytes


# -- no file I/O under the index lock --------------------------------------------------------------

_FS_EVENTS = {
    "open",
    "os.remove",
    "os.rename",
    "os.mkdir",
    "os.rmdir",
    "os.utime",
    "os.chmod",
    "os.scandir",
    "os.listdir",
    "os.truncate",
}
_watched: list[DiskTier] = []
_fs_calls: list[tuple[str, bool]] = []


def _audit(event: str, args: tuple) -> None:
    if _watched and event in _FS_EVENTS:
        _fs_calls.append((event, _watched[0]._lock.locked()))


_audit_installed = False


def watch_file_system_calls(tier: DiskTier) -> list[tuple[str, bool]]:
    """Record (audit event, index lock held?) for every file-system call from now on (one thread)."""
    global _audit_installed
    if not _audit_installed:
        sys.addaudithook(_audit)  # cannot be removed: a no-op while nothing is watched
        _audit_installed = True
    _fs_calls.clear()
    _watched[:] = [tier]
    return _fs_calls


def test_no_file_system_call_runs_under_the_index_lock(tmp_path: Path) -> None:
    keys = make_keys(8)
    tier = DiskTier(tmp_path, 4 * charged(1000), fingerprint=FINGERPRINT)
    calls = watch_file_system_calls(tier)
    try:
        for key in keys[:6]:  # the last two evict
            assert tier.put(key, key * 62 + b"\0" * 8)
        assert tier.put(keys[5], keys[5] * 62 + b"\1" * 8)  # a replace
        assert tier.get(keys[5]) is not None and tier.get(keys[0]) is None
        (tier.dir / keys[4].hex()[:2] / f"{keys[4].hex()}.kv").unlink()  # behind the index
        assert tier.get(keys[4]) is None and tier.contains_prefix(keys[4:5]) == 0
        assert tier.delete(keys[3]) and tier.contains_prefix(keys[2:3]) == 1
        tier.record_owner("c" * 32, keys[1:3])  # the manifest append, too
        assert tier.owner_keys("c" * 32) == keys[1:3]
        assert tier.clear() == 2
    finally:
        _watched.clear()
    events = {event for event, _ in calls}
    assert {"open", "os.rename", "os.remove", "os.utime"} <= events
    assert [event for event, locked in calls if locked] == []


class Stall:
    """A `before_io` hook that holds the first `op` on `key` until released."""

    def __init__(self, op: str, key: bytes) -> None:
        self.op, self.key = op, key
        self.inside, self.release, self.left = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, op: str, key: bytes) -> None:
        if op == self.op and key == self.key and not self.inside.is_set():
            self.inside.set()
            self.release.wait(timeout=STALL_GUARD_S)
            self.left.set()


def frame_of(key: bytes, tag: int) -> bytes:
    return key * 62 + bytes([tag]) * 8  # 1000 bytes


@pytest.mark.parametrize("op", ["write", "replace", "unlink-delete", "unlink-evict", "read"])
def test_contains_prefix_answers_while_a_file_operation_is_stuck(tmp_path: Path, op: str) -> None:
    a, b, c, d = make_keys(4)
    tier = DiskTier(tmp_path, 3 * charged(1000), fingerprint=FINGERPRINT)
    for key in (a, b, c):
        tier.put(key, frame_of(key, 0))
    io_op, key, action = {
        "write": ("write", d, lambda: tier.put(d, frame_of(d, 0))),  # evicts a, then writes d
        "replace": ("replace", d, lambda: tier.put(d, frame_of(d, 0))),
        "unlink-delete": ("unlink", b, lambda: tier.delete(b)),
        "unlink-evict": ("unlink", a, lambda: tier.put(d, frame_of(d, 0))),
        "read": ("read", a, lambda: tier.get(a)),
    }[op]
    stall = Stall(io_op, key)
    tier.before_io = stall
    worker = threading.Thread(target=action)
    worker.start()
    try:
        assert stall.inside.wait(timeout=STALL_GUARD_S), f"no {io_op} of that key reached the seam"
        # the worker is inside its file operation; the index answers without waiting for it
        assert tier.contains_prefix([c]) == 1 and tier.get(c) == frame_of(c, 0)
        assert not stall.left.is_set()  # it answered before the stuck operation finished
    finally:
        stall.release.set()
        worker.join()
    assert tier.contains_prefix([c]) == 1
    assert_index_matches_files(tier)


def test_an_evicted_keys_unlink_spares_a_newer_file_of_that_key(tmp_path: Path) -> None:
    a, b, c = make_keys(3)
    tier = DiskTier(tmp_path, 2 * charged(1000), fingerprint=FINGERPRINT)
    tier.put(a, frame_of(a, 0))
    tier.put(b, frame_of(b, 0))
    stall = Stall("unlink", a)  # the eviction of a, before its file is removed
    tier.before_io = stall
    evictor = threading.Thread(target=lambda: tier.put(c, frame_of(c, 0)))  # a is the LRU entry
    evictor.start()
    try:
        assert stall.inside.wait(timeout=STALL_GUARD_S)
        assert tier.contains_prefix([a]) == 0  # out of the index, its old file still there
        assert tier.put(a, frame_of(a, 1))  # meanwhile a newer frame of a arrives (evicting b)
        assert not stall.left.is_set()  # ... and is stored while the old file's unlink waits
    finally:
        stall.release.set()
        evictor.join()
    assert tier.get(a) == frame_of(a, 1)  # the stale unlink did not remove the newer file
    assert tier.get(c) == frame_of(c, 0) and tier.contains_prefix([b]) == 0
    assert_index_matches_files(tier)


# -- racing threads ---------------------------------------------------------------------------------


def self_checking_frame(key: bytes, version: int) -> bytes:
    """A frame that names its key and version, of a length that varies with the version, and
    ends in a digest of the rest: a torn or mixed read cannot pass for a whole frame."""
    body = key + version.to_bytes(8, "big") + bytes([version % 251]) * (300 + (version * 37) % 1700)
    return body + hashlib.sha256(body).digest()


def version_of(key: bytes, data: bytes) -> int:
    body, digest = data[:-32], data[-32:]
    assert hashlib.sha256(body).digest() == digest and body[:16] == key, "a torn or foreign frame"
    return int.from_bytes(body[16:24], "big")


def run_threads(target: Callable[[int], None], num_threads: int) -> None:
    errors: list[BaseException] = []

    def wrapped(t: int) -> None:
        try:
            target(t)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: more interleavings per run
    try:
        threads = [threading.Thread(target=wrapped, args=(t,)) for t in range(num_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old_interval)
    if errors:
        raise errors[0]


def test_racing_puts_gets_deletes_of_the_same_keys(tmp_path: Path) -> None:
    """Any thread puts, reads, deletes and looks up any key (capacity for about half of them)."""
    keys = make_keys(16)
    tier = DiskTier(tmp_path, 8 * charged(1200), fingerprint=FINGERPRINT)
    frames_put: dict[bytes, set[bytes]] = {k: set() for k in keys}
    versions = iter(range(1, 1 << 30))  # next() is atomic under the GIL

    def worker(t: int) -> None:
        rng = random.Random(t)
        for _ in range(400):
            key, r = rng.choice(keys), rng.random()
            if r < 0.45:
                data = self_checking_frame(key, next(versions))
                frames_put[key].add(data)  # before the put: a reader may see it at once
                assert tier.put(key, data)
            elif r < 0.75:
                out = tier.get(key)
                assert out is None or out in frames_put[key]
                if out is not None:
                    version_of(key, out)
            elif r < 0.85:
                tier.delete(key)
            else:
                i = keys.index(key)
                assert 0 <= tier.contains_prefix(keys[i : i + 4]) <= 4

    run_threads(worker, 4)
    s = tier.stats
    assert s.errors == {} and s.evictions > 0 and s.deletes > 0
    for key in tier.keys():
        assert tier.get(key) in frames_put[key]
    assert_index_matches_files(tier)


def test_reads_never_go_back_in_time_with_one_writer_per_key(tmp_path: Path) -> None:
    """Each key has one writing thread; every thread reads and deletes every key. A get returns a
    miss or a version at least as new as the last put that completed before it started, and no
    newer than the last put that started before it ended; at the end each key holds its last
    frame or nothing."""
    num_threads = 4
    keys = make_keys(16)
    tier = DiskTier(tmp_path, 10 * charged(1200), fingerprint=FINGERPRINT)
    started = {k: 0 for k in keys}  # newest version whose put began
    completed = {k: 0 for k in keys}  # newest version whose put returned
    last_frame: dict[bytes, bytes] = {}

    def worker(t: int) -> None:
        rng = random.Random(100 + t)
        mine = keys[t::num_threads]
        version = 0
        for _ in range(400):
            r = rng.random()
            if r < 0.4:
                key = rng.choice(mine)
                version += 1
                data = self_checking_frame(key, version)
                started[key] = version
                assert tier.put(key, data)
                completed[key] = version
                last_frame[key] = data
            elif r < 0.9:
                key = rng.choice(keys)
                floor = completed[key]
                out = tier.get(key)
                ceiling = started[key]
                if out is not None:
                    assert floor <= version_of(key, out) <= ceiling, (floor, ceiling)
            else:
                tier.delete(rng.choice(keys))

    run_threads(worker, num_threads)
    for key in keys:
        assert tier.get(key) in (None, last_frame.get(key))
    assert tier.stats.errors == {}
    assert_index_matches_files(tier)


# -- host tier ----------------------------------------------------------------------------------------


def test_host_tier_calls_out_without_its_lock() -> None:
    """Eviction callbacks (write-back demotion) and purge predicates may be slow or call back
    into the tier: they run with its lock free."""
    calls: list[tuple[str, bool]] = []
    host = HostTier(3, on_evict=lambda k, v: calls.append(("on_evict", host._lock.locked())))
    keys = make_keys(5)
    for i, key in enumerate(keys):
        assert host.put(key, HostEntry(i, None, 0.0, (0, 0)), 1)

    def predicate(entry: HostEntry) -> bool:
        locked = host._lock.locked()
        calls.append(("predicate", locked))
        if not locked:  # (with the lock held, calling back in would deadlock)
            assert host.contains_prefix(keys[2:3]) == 1
        return entry.kv == 3

    assert host.purge_where(predicate) == 1
    assert [name for name, _ in calls] == ["on_evict", "on_evict", "predicate", "predicate", "predicate"]
    assert [locked for _, locked in calls] == [False] * 5
    assert list(host.keys()) == [keys[2], keys[4]]
