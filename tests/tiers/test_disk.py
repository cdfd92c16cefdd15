"""DiskTier on a real file system: LRU capacity, warm start, crash leftovers, corruption,
a real disk-full (evicted around, or a real failure), fault injection and the health gate.
No test here depends on how fast the machine is: back-offs run on a ManualClock and injected
delays on a recording sleep."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtier.tiers.base import FaultConfig, FaultInjector, HealthGate
from kvtier.tiers.codec import encode, load_tensor, payload_nbytes_estimate, store_tensor
from kvtier.tiers.disk import DiskTier

from .conftest import FINGERPRINT, OTHER_FINGERPRINT, ManualClock, make_keys

SHAPE = (2, 4, 2, 64)  # a small block: 2 KiB of bf16
FRAME_BYTES = payload_nbytes_estimate(SHAPE, torch.bfloat16)
_FS_BLOCK = os.stat(tempfile.gettempdir()).st_blksize
CHARGED = -(-FRAME_BYTES // _FS_BLOCK) * _FS_BLOCK
"""What one frame costs on the file system (whole blocks): what usage and the capacity count."""


def block(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i), dtype=torch.bfloat16)


def frame(key: bytes, i: int) -> bytes:
    return encode(block(i), fingerprint=FINGERPRINT, key=key)


def files_on_disk(tier: DiskTier) -> dict[str, int]:
    return {p.name: p.stat().st_blocks * 512 for p in tier.dir.glob("*/*") if p.is_file()}


def test_put_get_contains_prefix_and_stats(tmp_path: Path) -> None:
    keys = make_keys(5)
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    for i, key in enumerate(keys[:3]):
        assert store_tensor(tier, key, block(i), fingerprint=FINGERPRINT)
    assert tier.contains_prefix(keys) == 3
    assert tier.contains_prefix(keys[1:]) == 2
    assert tier.contains_prefix(keys[3:]) == 0
    assert torch.equal(load_tensor(tier, keys[2], fingerprint=FINGERPRINT), block(2))
    assert load_tensor(tier, keys[4], fingerprint=FINGERPRINT) is None
    path = tier.dir / keys[0].hex()[:2] / f"{keys[0].hex()}.kv"
    assert path.is_file() and tier.usage_bytes == 3 * CHARGED
    s = tier.stats
    assert (s.puts, s.queries, s.hits, s.lookups, s.lookup_hits) == (3, 2, 1, 11, 5)
    assert s.bytes_written == 3 * FRAME_BYTES and s.bytes_read == FRAME_BYTES
    assert sorted(tier.keys()) == sorted(keys[:3])
    assert tier.purge([keys[0], keys[4]]) == 1 and tier.contains_prefix(keys) == 0
    assert tier.clear() == 2 and tier.usage_bytes == 0 and files_on_disk(tier) == {}
    assert tier.stats.deletes == 3


def test_lru_eviction_keeps_usage_within_capacity(tmp_path: Path) -> None:
    a, b, c, d = make_keys(4)
    tier = DiskTier(tmp_path, 3 * CHARGED, fingerprint=FINGERPRINT)
    for i, key in enumerate((a, b, c)):
        tier.put(key, frame(key, i))
    assert tier.get(a) is not None  # a is now the most recent: b is the LRU entry
    assert tier.put(d, frame(d, 3))
    assert set(tier.keys()) == {a, c, d} and tier.stats.evictions == 1
    assert tier.usage_bytes == 3 * CHARGED == sum(files_on_disk(tier).values())
    # replacing an entry does not count it twice or evict anyone
    assert tier.put(c, frame(c, 2)) and tier.stats.evictions == 1 and len(tier) == 3
    # a payload larger than the whole tier is refused; that is no backend failure
    assert not tier.put(a, b"x" * (3 * CHARGED + 1))
    assert tier.healthy and tier.stats.errors == {"too_large": 1}


def test_warm_start_finds_entries_and_keeps_lru_order(tmp_path: Path) -> None:
    keys = make_keys(3)
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    past = time.time() - 100.0
    for i, key in enumerate(keys):
        tier.put(key, frame(key, i))
        os.utime(tier.dir / key.hex()[:2] / f"{key.hex()}.kv", (past + i, past + i))  # distinct mtimes
    tier.get(keys[0])  # touches keys[0] (mtime now): keys[1] is now the oldest
    tier.close()

    again = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    assert again.contains_prefix(keys) == 3 and again.usage_bytes == 3 * CHARGED
    assert torch.equal(load_tensor(again, keys[2], fingerprint=FINGERPRINT), block(2))
    # a smaller capacity at start evicts in the persisted LRU order
    small = DiskTier(tmp_path, 2 * CHARGED, fingerprint=FINGERPRINT)
    assert set(small.keys()) == {keys[0], keys[2]} and small.stats.evictions == 1
    # another model configuration in the same root sees nothing
    assert DiskTier(tmp_path, 1 << 20, fingerprint=OTHER_FINGERPRINT).contains_prefix(keys) == 0


def test_leftovers_of_a_crash_are_removed_or_rejected(tmp_path: Path) -> None:
    keys = make_keys(3)
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    tier.put(keys[0], frame(keys[0], 0))
    sub = tier.dir / keys[1].hex()[:2]
    sub.mkdir(exist_ok=True)
    tmp_file = sub / f".{keys[1].hex()}.1234.5678.0.tmp"  # a write interrupted before os.replace
    tmp_file.write_bytes(frame(keys[1], 1)[:100])
    partial = sub / f"{keys[1].hex()}.kv"  # a file cut short by something else
    partial.write_bytes(frame(keys[1], 1)[:100])
    (tier.dir / "README").write_text("not an entry")

    again = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    assert not tmp_file.exists() and again.num_removed_tmp_files == 1
    assert again.contains_prefix(keys[:1]) == 1
    assert load_tensor(again, keys[1], fingerprint=FINGERPRINT) is None  # the codec rejects it
    assert not partial.exists() and again.stats.corrupt == 1
    assert set(again.keys()) == {keys[0]}


def test_corrupt_or_foreign_file_is_a_miss_and_is_deleted(tmp_path: Path) -> None:
    a, b = make_keys(2)
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    tier.put(a, frame(a, 1))
    tier.put(b, frame(a, 1))  # a frame stored under the wrong key
    path = tier.dir / a.hex()[:2] / f"{a.hex()}.kv"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert load_tensor(tier, a, fingerprint=FINGERPRINT) is None
    assert load_tensor(tier, b, fingerprint=FINGERPRINT) is None
    assert not path.exists() and tier.contains_prefix([a]) == 0 and tier.contains_prefix([b]) == 0
    assert tier.stats.corrupt == 2 and tier.usage_bytes == 0 and tier.healthy


def test_file_removed_behind_the_index_is_a_plain_miss(tmp_path: Path) -> None:
    (a,) = make_keys(1)
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    tier.put(a, frame(a, 0))
    (tier.dir / a.hex()[:2] / f"{a.hex()}.kv").unlink()
    assert tier.get(a) is None and tier.contains_prefix([a]) == 0 and tier.healthy


# -- disk full: real kernel errors -----------------------------------------------------------------


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, size: str):
    """A real small file system, for a real ENOSPC. Needs root (CAP_SYS_ADMIN); skips otherwise."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; test_disk_full_by_file_size_limit covers EFBIG")
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(path: Path) -> None:
    """Write zeros to `path` until the file system is full."""
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * (64 << 10)
        with contextlib.suppress(OSError):
            while True:
                f.write(chunk)
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 512)


def test_full_file_system_below_capacity_evicts_and_keeps_serving(tmp_path: Path) -> None:
    """An 8 MiB file system under a 64 MiB tier: ENOSPC evicts the oldest entries and lowers the
    effective capacity, and every put still succeeds."""
    with mounted_tmpfs(tmp_path / "fs", "8m") as fs:
        tier = DiskTier(fs, 64 << 20, fingerprint=FINGERPRINT, health=HealthGate(clock=ManualClock()))
        keys = make_keys(100)
        payloads = [key + bytes([i]) * ((256 << 10) - 16) for i, key in enumerate(keys)]
        stored = [tier.put(key, p) for key, p in zip(keys, payloads)]
        assert all(stored) and tier.healthy and tier.stats.skipped == 0
        num_full = tier.stats.errors.get("disk_full", 0)
        assert num_full >= 1 and set(tier.stats.errors) == {"disk_full"}
        assert tier.usage_bytes <= tier.effective_capacity_bytes <= 8 << 20  # what the file system held
        assert tier.capacity_bytes == 64 << 20 and tier.stats.evictions > 60
        for key, p in zip(keys[-20:], payloads[-20:]):  # the newest are served from disk
            assert tier.get(key) == p
        assert tier.get(keys[0]) is None  # the oldest made room
        on_disk = files_on_disk(tier)
        assert on_disk == {f"{k.hex()}.kv": 256 << 10 for k in tier.keys()}
        assert tier.usage_bytes == sum(on_disk.values()) and not list(fs.rglob("*.tmp"))
        # later puts evict before they write: no more disk-full errors
        more = make_keys(30, salt=1)
        assert all([tier.put(key, key * (16 << 10)) for key in more])
        assert tier.stats.errors == {"disk_full": num_full} and tier.healthy
        assert all(tier.get(key) == key * (16 << 10) for key in more[-10:])


def test_disk_full_with_nothing_to_evict_fails_the_put_and_trips_the_gate(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "fs", "1m") as fs:
        clock = ManualClock()
        tier = DiskTier(fs, 64 << 20, fingerprint=FINGERPRINT, health=HealthGate(clock=clock))
        a, b = make_keys(2)
        fill(fs / "someone-elses-file")  # the file system is full of what the tier cannot evict
        assert not tier.put(a, frame(a, 0))
        assert tier.stats.errors == {"disk_full": 1} and not tier.healthy
        assert tier.effective_capacity_bytes == tier.capacity_bytes  # nothing learnt from our usage
        assert not list(fs.rglob("*.tmp"))  # the failed write left no temp file
        assert not tier.put(b, frame(b, 1)) and tier.stats.skipped == 1  # gated, not written
        (fs / "someone-elses-file").unlink()
        clock.advance(0.5)
        assert tier.put(b, frame(b, 1)) and tier.healthy  # the probe
        assert torch.equal(load_tensor(tier, b, fingerprint=FINGERPRINT), block(1))


def test_disk_full_by_file_size_limit(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel fail large writes with EFBIG, without root."""
    (a, b) = make_keys(2)
    tier = DiskTier(tmp_path, 64 << 20, fingerprint=FINGERPRINT, health=HealthGate(clock=ManualClock()))
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old_limit[1]))
        assert tier.put(a, frame(a, 0))
        assert not tier.put(b, b"\0" * (2 << 20))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert tier.stats.errors == {"disk_full": 1} and not tier.healthy
    assert set(files_on_disk(tier)) == {f"{a.hex()}.kv"} and tier.usage_bytes == CHARGED


# -- fault injection and health ----------------------------------------------------------------------


def test_fault_latency_applies_to_every_op_and_bandwidth_to_bytes_moved(tmp_path: Path) -> None:
    (a,) = make_keys(1)
    payload = b"\0" * 500_000  # 50 ms at 10 MB/s
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    slept: list[float] = []
    # an injector with a recording sleep: the delays are asked for, never waited
    tier.faults = FaultInjector(FaultConfig.parse("latency_ms=20,bandwidth_mbps=10"), sleep=slept.append)
    assert tier.put(a, payload)
    assert slept == [pytest.approx(0.02), pytest.approx(0.05)]  # latency, then the transfer
    slept.clear()
    assert tier.contains_prefix([a]) == 1
    assert slept == [pytest.approx(0.02)]  # latency only: no bytes move
    slept.clear()
    assert tier.get(a) == payload
    # latency, then the transfer queued behind the put's on the one simulated link
    assert len(slept) == 2 and slept[0] == pytest.approx(0.02) and 0.05 <= slept[1] <= 0.1 + 1e-9
    tier.faults = None
    slept.clear()
    assert tier.get(a) == payload and slept == []


def test_fault_error_rate_is_seeded_and_counted(tmp_path: Path) -> None:
    keys = make_keys(200)

    def run(seed: int) -> tuple[int, list[bool]]:
        clock = ManualClock()
        tier = DiskTier(
            tmp_path / str(seed),
            1 << 20,
            fingerprint=FINGERPRINT,
            faults=FaultConfig(error_rate=0.3, seed=seed),
            health=HealthGate(clock=clock),
        )
        results = []
        for key in keys:
            clock.advance(60.0)  # past any backoff: every put reaches the fault injector
            results.append(tier.put(key, b"x"))
        assert tier.stats.errors.get("injected", 0) == results.count(False)
        assert tier.stats.skipped == 0 and tier.stats.puts == results.count(True)
        return results.count(False), results

    failed, pattern = run(7)
    assert 30 <= failed <= 90
    assert run(7)[1] == pattern  # same seed, same failures


def test_health_gate_skips_backend_then_probes_once(tmp_path: Path) -> None:
    a, b = make_keys(2)
    clock = ManualClock()
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT, health=HealthGate(clock=clock))
    tier.put(a, frame(a, 0))
    tier.faults = FaultConfig(error_rate=1.0)
    assert not tier.put(b, frame(b, 1)) and not tier.healthy
    assert tier.stats.errors == {"injected": 1}
    tier.faults = None  # the "backend" is fine again, but the gate has not probed yet
    assert tier.get(a) is None and tier.contains_prefix([a]) == 0 and not tier.put(b, frame(b, 1))
    s = tier.stats
    assert s.skipped == 3 and s.queries == 0 and s.lookups == 0 and s.puts == 1
    clock.advance(0.49)
    assert tier.get(a) is None and tier.stats.skipped == 4
    clock.advance(0.01)
    assert tier.get(a) is not None and tier.healthy  # the probe succeeded
    assert tier.put(b, frame(b, 1))


def test_health_gate_backoff_doubles_to_the_cap_and_resets() -> None:
    clock = ManualClock()
    gate = HealthGate(clock=clock)
    assert gate.allow() and gate.healthy
    waits = []
    for _ in range(9):
        gate.record_failure()
        waits.append(gate.retry_in_s)
        assert not gate.allow()
        clock.advance(gate.retry_in_s)
        assert gate.allow()  # the probe
        assert not gate.allow()  # only one probe at a time
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    gate.record_success()
    assert gate.healthy and gate.allow()
    gate.record_failure()
    assert gate.retry_in_s == 0.5


def test_fault_config_parse() -> None:
    cfg = FaultConfig.parse("latency_ms=5,bandwidth_mbps=200,error_rate=0.1,seed=3")
    assert cfg == FaultConfig(latency_s=0.005, bandwidth_bytes_per_s=200e6, error_rate=0.1, seed=3)
    assert FaultConfig.parse("") == FaultConfig() and not FaultConfig.parse("none").active
    with pytest.raises(ValueError, match="latency_ms"):
        FaultConfig.parse("latency=5")
    with pytest.raises(ValueError, match="error_rate"):
        FaultConfig.parse("error_rate=2")


def test_concurrent_workers_keep_the_index_consistent(tmp_path: Path) -> None:
    keys = make_keys(64)
    tier = DiskTier(tmp_path, 16 * CHARGED, fingerprint=FINGERPRINT)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for step in range(150):
                i = (offset * 17 + step * 7) % len(keys)
                if step % 3:
                    tier.put(keys[i], frame(keys[i], i))
                else:
                    out = load_tensor(tier, keys[i], fingerprint=FINGERPRINT)
                    assert out is None or torch.equal(out, block(i))
                    tier.contains_prefix(keys[i : i + 4])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert tier.usage_bytes <= tier.capacity_bytes
    on_disk = files_on_disk(tier)
    assert on_disk == {f"{k.hex()}.kv": CHARGED for k in tier.keys()}
    assert tier.usage_bytes == sum(on_disk.values())
    s = tier.stats
    assert s.corrupt == 0 and s.errors == {} and s.evictions > 0


def test_adopt_indexes_entries_another_process_wrote_to_a_shared_directory(tmp_path: Path) -> None:
    """Two tiers on one directory (a prefill and a decode instance): the reader's index, built at
    its start, does not know the writer's later files until `adopt` finds them; it stops at the
    first key without a file, and the adopted entries read back."""
    keys = make_keys(4)
    reader = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    writer = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    for i in (0, 1, 3):
        assert store_tensor(writer, keys[i], block(i), fingerprint=FINGERPRINT)
    assert reader.contains_prefix(keys) == 0
    assert reader.adopt(keys) == 2  # keys[2] has no file: keys[3] is not reached
    assert reader.contains_prefix(keys) == 2 and reader.usage_bytes == 2 * CHARGED
    assert torch.equal(load_tensor(reader, keys[1], fingerprint=FINGERPRINT), block(1))
    assert reader.adopt(keys) == 0  # already indexed
