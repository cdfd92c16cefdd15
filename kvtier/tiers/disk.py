"""DiskTier: one file per block on a local filesystem, LRU within a byte capacity.

    root_dir/
      <fingerprint hex>/            one model configuration; capacity applies per directory
        <first 2 hex of key>/       256 fan-out directories keep each one small
          <key hex>.kv              one codec frame
          .<key hex>.<unique>.tmp   a write in flight (removed at start if a crash left it)

Writes go to a temp file in the target directory, then os.replace: a reader or a crash sees
the old entry or the new one, never half of one. The in-memory index (key -> size, in LRU
order) is rebuilt from the files at start, ordered by mtime; a hit touches the file's mtime, so
the LRU order survives a restart (a warm start). The index is the truth for `contains_prefix`;
a file that vanished under it (another process, an operator) is a miss and leaves the index.
One process should own a directory at a time: two processes on one directory do not corrupt
entries (the codec checks every frame), but each one evicts by its own index only.

`ttl_s` is ignored: disk entries live until evicted or deleted.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterable

from kvtier.tiers.base import FaultConfig, HealthGate, Tier

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class DiskTier(Tier):
    def __init__(self, root_dir: str | os.PathLike, capacity_bytes: int, *, fingerprint: bytes,
                 faults: FaultConfig | None = None, fsync: bool = False,
                 health: HealthGate | None = None, name: str = "disk") -> None:
        """`capacity_bytes` bounds the frames' total size (file-system block rounding aside).
        `fsync=True` makes a completed put survive power loss, at a large cost per write."""
        super().__init__(name, faults=faults, health=health)
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if len(fingerprint) != 16:
            raise ValueError(f"fingerprint must be 16 bytes, got {len(fingerprint)}")
        self.fingerprint = bytes(fingerprint)
        self.dir = Path(root_dir) / self.fingerprint.hex()
        self._capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> frame bytes, LRU first
        self._usage_bytes = 0
        self._tmp_ids = itertools.count()
        self.num_removed_tmp_files = 0
        """Leftover temp files removed at start."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()
        self._evict_to(self._capacity_bytes)

    # -- paths and index ---------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        hx = key.hex()
        return self.dir / hx[:2] / (hx + _SUFFIX)

    def _rebuild_index(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for sub in self.dir.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            with os.scandir(sub) as it:
                for entry in it:
                    name = entry.name
                    if name.endswith(_TMP_SUFFIX):  # a write a crash interrupted
                        self._unlink_quietly(entry.path)
                        self.num_removed_tmp_files += 1
                        continue
                    if not name.endswith(_SUFFIX) or not entry.is_file():
                        continue
                    try:
                        key = bytes.fromhex(name[:-len(_SUFFIX)])
                        st = entry.stat()
                    except (ValueError, OSError):
                        continue  # not ours, or gone
                    if key.hex()[:2] != sub.name:
                        continue
                    found.append((st.st_mtime, key, st.st_size))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._usage_bytes += size

    # -- ownership manifests (purge by tenant) ---------------------------------------------------
    def _owner_path(self, owner_id: str) -> Path:
        return self.dir / "owners" / f"{owner_id}.keys"

    def record_owner(self, owner_id: str, keys: list[bytes]) -> None:
        """Remember that `keys` belong to `owner_id` (an append-only manifest per owner)."""
        if not keys:
            return
        try:
            path = self._owner_path(owner_id)
            path.parent.mkdir(exist_ok=True)
            now = time.time()
            with self._lock, open(path, "a") as f:
                f.write("".join(f"{k.hex()} {now:.3f}\n" for k in keys))
        except OSError as exc:
            self._fail("record_owner", exc)

    def owner_keys(self, owner_id: str, written_before: float | None = None) -> list[bytes]:
        """The owner's keys (those last written before `written_before`, a time.time(), if given)."""
        try:
            text = self._owner_path(owner_id).read_text()
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._fail("owner_keys", exc)
            return []
        latest: dict[bytes, float] = {}
        for line in text.splitlines():
            parts = line.split()
            try:
                key = bytes.fromhex(parts[0])
                t = float(parts[1]) if len(parts) > 1 else 0.0
            except (ValueError, IndexError):
                continue
            if len(key) == 16:
                latest[key] = max(t, latest.get(key, 0.0))
        if written_before is None:
            return list(latest)
        return [k for k, t in latest.items() if t < written_before]

    def expire_owner(self, owner_id: str, ttl_s: float) -> int:
        """Delete the owner's entries written more than `ttl_s` ago; returns how many."""
        old = self.owner_keys(owner_id, written_before=time.time() - ttl_s)
        return self.purge(old)

    def contains_count(self, keys: list[bytes]) -> int:
        """How many of `keys` are stored now (in any order)."""
        with self._lock:
            return sum(1 for k in keys if k in self._index)

    def forget_owner(self, owner_id: str) -> None:
        self._unlink_quietly(self._owner_path(owner_id))

    @staticmethod
    def _unlink_quietly(path: str | Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _forget(self, key: bytes) -> None:
        """Drop a key whose file is gone (lock held)."""
        size = self._index.pop(key, None)
        if size is not None:
            self._usage_bytes -= size

    def _evict_to(self, target_bytes: int) -> None:
        """Evict LRU entries until usage <= target (lock held, or during __init__)."""
        while self._usage_bytes > target_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._usage_bytes -= size
            self._unlink_quietly(self._path(key))
            self._count(evictions=1)

    # -- backend -------------------------------------------------------------------------------------
    def _error_kind(self, exc: BaseException) -> str:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
            return "disk_full"
        return super()._error_kind(exc)

    def _contains_prefix(self, keys: list[bytes]) -> int:
        index = self._index
        with self._lock:
            for i, key in enumerate(keys):
                if key not in index:
                    return i
        return len(keys)

    def _get(self, key: bytes) -> bytes | None:
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            with self._lock:
                if not path.exists():  # not re-put meanwhile (puts replace under the lock)
                    self._forget(key)
            return None
        try:
            size = os.fstat(fd).st_size
            data = os.read(fd, size)
            while len(data) < size:  # short reads: large files, some file systems
                chunk = os.read(fd, size - len(data))
                if not chunk:
                    break
                data += chunk
            try:
                os.utime(fd)  # LRU order for the next start
            except OSError:
                pass  # a read-only mount still serves reads
        finally:
            os.close(fd)
        return data

    def _put(self, key: bytes, payload: bytes, ttl_s: float | None) -> bool:
        size = len(payload)
        if size > self._capacity_bytes:
            self._count_error("too_large")
            return False
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f".{path.stem}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_ids)}{_TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view):]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                self._forget(key)  # a replaced entry frees its bytes first
                self._evict_to(self._capacity_bytes - size)
                os.replace(tmp, path)
                self._index[key] = size
                self._usage_bytes += size
        except BaseException:
            self._unlink_quietly(tmp)
            raise
        if self.fsync:
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        return True

    def _delete(self, key: bytes) -> bool:
        with self._lock:
            existed = key in self._index
            self._forget(key)
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass
        return existed

    def _keys(self) -> Iterable[bytes]:
        with self._lock:
            return list(self._index)

    def _clear(self) -> int:
        with self._lock:
            keys = list(self._index)
            for key in keys:
                self._forget(key)
                self._unlink_quietly(self._path(key))
        return len(keys)

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def usage_bytes(self) -> int:
        """Exact: the sum of the frames' sizes in the index."""
        return self._usage_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    def __len__(self) -> int:
        return len(self._index)
