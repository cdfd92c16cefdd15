"""DiskTier: one file per block on a local filesystem, LRU within a byte capacity.

    root_dir/
      <fingerprint hex>/            one model configuration; capacity applies per directory
        <first 2 hex of key>/       256 fan-out directories keep each one small
          <key hex>.kv              one codec frame
          .<key hex>.<unique>.tmp   a write in flight (removed at start if a crash left it)
        owners/                     per-tenant key manifests (purge by tenant)

Writes go to a temp file in the target directory, then os.replace: a reader or a crash sees
the old entry or the new one, never half of one. The in-memory index (key -> size, in LRU
order) is rebuilt from the files at start, ordered by mtime; a hit touches the file's mtime, so
the LRU order survives a restart (a warm start). The index is the truth for `contains_prefix`;
a file that vanished under it (another process, an operator) is a miss and leaves the index.
One process should own a directory at a time: two processes on one directory do not corrupt
entries (the codec checks every frame), but each one evicts by its own index only.

Locking: `_lock` guards the index only and is never held during a file-system call, so
`contains_prefix` (the scheduler's per-step lookup) never waits on the disk. The file
operations on one key (rename into place, unlink) take that key's stripe of `_key_locks`,
together with the index update that goes with them:

    put:    lock: choose LRU victims, reserve size ─> unlink victims ─> write temp file
            ─> key lock: os.replace, lock: index[key] = size
    delete: key lock: (lock: drop from index), unlink
    victim: key lock: (lock: still out of the index?) unlink   (else a newer put owns the file)

So under a key's lock "in the index" and "file exists" agree, a victim's unlink never removes
a file a newer put installed, and a reader sees a whole old frame, a whole new one, or a miss.

Privacy: the directories the tier creates are 0700 and its files 0600, whatever the umask; an
existing fingerprint or fan-out directory open to group or others is tightened when this user
owns it, and refused (PermissionError) when another user does. Frames are stored as given:
without a key directory (`--kv-key-dir`) they are plaintext, only checksummed.

A full file system (ENOSPC, EDQUOT) below `capacity_bytes`: the put evicts LRU entries to make
room, retries once, and `effective_capacity_bytes` drops to what the file system held, so later
puts evict before they write (until a restart). Only a disk full with nothing left to evict
fails the put and trips the health gate.

`ttl_s` is ignored: disk entries live until evicted or deleted.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from kvtier.tiers.base import Tier
from kvtier.tiers.faults import FaultConfig
from kvtier.tiers.health import HealthGate
from kvtier.tiers.lru import ByteLRU

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
logger = logging.getLogger(__name__)

_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
"""A full file system or quota: eviction can make room (EFBIG, a per-file limit, it cannot)."""
_ENOSPC_MARGIN_BYTES = 64 << 10
"""Room freed beyond the payload after ENOSPC: file-system blocks and metadata."""
_NUM_KEY_LOCKS = 64


def _check_private_dir(path: Path, what: str = "disk cache directory") -> None:
    """Tighten a directory open to group/others to 0700 when we own it; refuse another user's
    (never chmod it behind its owner's back). `what` names the directory in the error."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory; choose another {what}")
    if (st.st_mode & 0o077) == 0:
        return
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"{path} is owned by uid {st.st_uid} and open to other users (mode "
            f"{stat.S_IMODE(st.st_mode):o}); files of user data must be private: run `chmod 700 {path}` "
            f"as its owner, or choose another {what}"
        )
    os.chmod(path, 0o700)


def _make_private_dir(path: Path, what: str = "disk cache directory") -> None:
    """Create `path` 0700 (exactly: mkdir's mode passes through the umask), or check an existing one."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        _check_private_dir(path, what)
    else:
        os.chmod(path, 0o700)


make_private_dir = _make_private_dir
"""Public name: every directory of user data (disk tier, --kv-key-dir) is made and checked here."""


def entry_path(directory: str | os.PathLike, key: bytes) -> Path:
    """Where the entry of `key` lives under one fingerprint's directory (root_dir/<fp hex>): the
    layout of the module docstring, also for readers in other processes (the vLLM connector's
    scheduler side checks entries by their files)."""
    hx = key.hex()
    return Path(directory) / hx[:2] / (hx + _SUFFIX)


class DiskTier(Tier):
    """Codec frames in files under `root_dir/<fingerprint hex>/`, least recently used first out
    once their sizes pass `capacity_bytes` (the layout and the locking: the module doc).

    Stores: one file per block, an in-memory index of key -> frame size in LRU order (rebuilt
    from the files at start), and per-tenant key manifests (`record_owner`).

    Thread-safety: every method may be called from any thread. `_lock` guards the index, the
    usage and the reservations and is never held during a file-system call, so
    `contains_prefix`, `contains_count` and `entry_sizes` never wait on the disk; `get`, `put`,
    `delete`, `clear` and the manifest methods do file I/O and may block on it (and on
    injected faults). One key's file operations are ordered by its stripe of `_key_locks`;
    manifest appends by `_manifest_lock`.

    Failures: as every Tier (base.py): an OSError is counted by kind ("io", "disk_full"),
    trips the health gate, and the operation degrades to a miss or a dropped write; a full
    file system with entries left to evict is handled by evicting (module doc). The manifest
    methods count their errors the same way and answer [] / nothing."""

    def __init__(
        self,
        root_dir: str | os.PathLike,
        capacity_bytes: int,
        *,
        fingerprint: bytes,
        faults: FaultConfig | None = None,
        fsync: bool = False,
        health: HealthGate | None = None,
        name: str = "disk",
    ) -> None:
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
        self._effective_capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        self._lock = threading.Lock()
        """Guards the index, usage and reservations; never held during a file-system call."""
        self._manifest_lock = threading.Lock()
        """Serialises appends to the owner manifests (no index state behind it)."""
        self._key_locks = [threading.Lock() for _ in range(_NUM_KEY_LOCKS)]
        """Stripes that order one key's rename/unlink with its index update (see the module doc)."""
        self._index: ByteLRU[bytes, None] = ByteLRU()  # key -> frame bytes, LRU first
        self._reserved_bytes = 0  # puts between choosing their victims and entering the index
        self._tmp_ids = itertools.count()
        self.num_removed_tmp_files = 0
        """Leftover temp files removed at start."""
        self.before_io: Callable[[str, bytes], None] | None = None
        """Test seam: called as before_io(op, key) right before a file operation on an entry (op:
        "read", "write", "replace", "unlink"), never with `_lock` held; for an evicted or cleared
        entry's "unlink", before its key lock is taken. None in production."""
        root = Path(root_dir)
        if not root.is_dir():
            root.parent.mkdir(parents=True, exist_ok=True)
            _make_private_dir(root)
        _make_private_dir(self.dir)
        _make_private_dir(self.dir / "owners")
        self._fs_block_bytes = max(512, os.stat(self.dir).st_blksize or 4096)
        """The file system's allocation unit, to reserve room before a write (see charged_bytes)."""
        self._manifest_errors: dict[str, int] = {}
        """Owner-manifest lines or reads that could not be used, per cause (see owner_keys)."""
        self._rebuild_index()
        with self._lock:
            victims = self._take_victims(self._capacity_bytes, keep=None)
        self._remove_files(victims, evicted=True)

    # -- paths and index ---------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return entry_path(self.dir, key)

    def _key_lock(self, key: bytes) -> threading.Lock:
        return self._key_locks[hash(key) % _NUM_KEY_LOCKS]

    def _before_io(self, op: str, key: bytes) -> None:
        hook = self.before_io
        if hook is not None:
            hook(op, key)

    def _rebuild_index(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        euid = os.geteuid()
        for sub in self.dir.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            _check_private_dir(sub)
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
                        key = bytes.fromhex(name[: -len(_SUFFIX)])
                        st = entry.stat()
                        if st.st_mode & 0o077 and st.st_uid == euid:  # written before files were 0600
                            os.chmod(entry.path, 0o600)
                    except (ValueError, OSError):
                        continue  # not ours, or gone
                    if key.hex()[:2] != sub.name:
                        continue
                    found.append((st.st_mtime, key, st.st_blocks * 512 or self.charged_bytes(st.st_size)))
        found.sort()
        for _, key, size in found:
            self._index.insert(key, None, size)

    # -- ownership manifests (purge by tenant) ---------------------------------------------------
    def _owner_path(self, owner_id: str) -> Path:
        return self.dir / "owners" / f"{owner_id}.keys"

    def record_owner(self, owner_id: str, keys: list[bytes]) -> None:
        """Remember that `keys` belong to `owner_id` (an append-only manifest per owner)."""
        if not keys:
            return
        line = "".join(f"{k.hex()} {time.time():.3f}\n" for k in keys).encode()
        try:
            path = self._owner_path(owner_id)
            if not path.parent.is_dir():  # removed under us: recreate it private
                _make_private_dir(path.parent)
            # its own lock, not the index lock: contains_prefix never waits for this append
            with self._manifest_lock:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.fchmod(fd, 0o600)  # the mode of os.open passes through the umask
                    view = memoryview(line)
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
        except OSError as exc:
            self._fail("record_owner", exc)

    def owner_keys(self, owner_id: str, written_before: float | None = None) -> list[bytes]:
        """The owner's keys (those last written before `written_before`, a time.time(), if given)."""
        try:
            text = self._owner_path(owner_id).read_bytes().decode("utf-8", errors="replace")
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
                if parts:  # a torn or damaged line: its block is missed by a purge, so say so
                    self._manifest_error("unparsable_line", owner_id)
                continue
            if len(key) == 16:
                latest[key] = max(t, latest.get(key, 0.0))
            else:
                self._manifest_error("bad_key_length", owner_id)
        if written_before is None:
            return list(latest)
        return [k for k, t in latest.items() if t < written_before]

    def _manifest_error(self, cause: str, owner_id: str) -> None:
        """Count an owner-manifest entry that could not be read (`manifest_errors`), with a
        warning the first time each cause is seen."""
        with self._manifest_lock:
            first = cause not in self._manifest_errors
            self._manifest_errors[cause] = self._manifest_errors.get(cause, 0) + 1
        self._count_error(f"owner_manifest_{cause}")
        if first:
            logger.warning(
                "disk tier %s: an owner manifest (%s) has an entry that cannot be read (%s); that "
                "block is not found by a purge or TTL of its tenant (each is counted in "
                "kvtier:tier_errors_total)",
                self.dir,
                owner_id,
                cause,
            )

    @property
    def manifest_errors(self) -> dict[str, int]:
        """{cause: count} of owner-manifest entries that could not be read."""
        with self._manifest_lock:
            return dict(self._manifest_errors)

    def expire_owner(self, owner_id: str, ttl_s: float, now: float | None = None) -> int:
        """Delete the owner's entries written more than `ttl_s` before `now` (a time.time();
        default the current one); returns how many."""
        old = self.owner_keys(owner_id, written_before=(time.time() if now is None else now) - ttl_s)
        return self.purge(old)

    def contains_count(self, keys: list[bytes]) -> int:
        """How many of `keys` are stored now (in any order)."""
        with self._lock:
            return self._index.count_present(keys)

    def entry_sizes(self, keys: Iterable[bytes] | None = None) -> dict[bytes, int]:
        """{key: frame bytes} of the entries stored now among `keys`, in the order of `keys`
        (None: every entry, least recent first). The index's view: no file is touched."""
        with self._lock:
            if keys is None:
                return {e.key: e.nbytes for e in self._index.entries()}
            found = (self._index.peek(k) for k in keys)
            return {e.key: e.nbytes for e in found if e is not None}

    def adopt(self, keys: list[bytes]) -> int:
        """Index the leading `keys` whose files another process wrote after this index was built
        (a directory several instances share: a prefill instance writes, a decode instance
        reads); stops at the first key with no file. Returns how many were added."""
        added = 0
        for key in keys:
            with self._lock:
                if key in self._index:
                    continue
            try:
                st = os.stat(self._path(key))
            except OSError:
                break
            with self._key_lock(key), self._lock:
                if key not in self._index:
                    self._index.insert(key, None, st.st_blocks * 512 or self.charged_bytes(st.st_size))
                    added += 1
        return added

    def forget_owner(self, owner_id: str) -> None:
        self._unlink_quietly(self._owner_path(owner_id))

    def forget_missing(self) -> int:
        """Drop from the index every entry whose file is gone: another process (`kvtier cache
        purge`) deleted it behind this one's back. Without it the index keeps counting the
        space and answering lookups for those keys, and a later put of one of them is skipped
        as already stored. One stat per entry, outside `_lock`; returns how many were dropped."""
        with self._lock:
            keys = list(self._index)
        dropped = 0
        for key in keys:
            path = self._path(key)
            if path.exists():
                continue
            with self._key_lock(key):  # a put installs under it: a file back meanwhile is newer
                if path.exists():
                    continue
                with self._lock:
                    dropped += self._forget(key)
        return dropped

    @staticmethod
    def _unlink_quietly(path: str | Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _forget(self, key: bytes) -> bool:
        """Drop a key from the index (lock held). True when it was there."""
        return self._index.pop(key) is not None

    def _take_victims(self, limit_bytes: int, keep: bytes | None) -> list[bytes]:
        """Take LRU entries other than `keep` out of the index until the rest fits in
        `limit_bytes` (lock held). The caller removes their files after releasing the lock
        (`_remove_files`)."""
        return [entry.key for entry in self._index.evict_to(limit_bytes, keep=keep)]

    def _remove_files(self, keys: list[bytes], *, evicted: bool) -> None:
        """Unlink the files of keys already taken out of the index, except where a put has
        installed the key again meanwhile (that file is the newer entry)."""
        if evicted and keys:
            self._count(evictions=len(keys))
        for key in keys:
            self._before_io("unlink", key)  # before the key lock: a newer put of the key may land now
            with self._key_lock(key):
                with self._lock:
                    if key in self._index:
                        continue
                self._unlink_quietly(self._path(key))
            if self.watch is not None:
                self.watch(key, False)

    # -- backend -------------------------------------------------------------------------------------
    def _error_kind(self, exc: BaseException) -> str:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
            return "disk_full"
        return super()._error_kind(exc)

    def _contains_prefix(self, keys: list[bytes]) -> int:
        with self._lock:
            return self._index.count_prefix(keys)

    def _get(self, key: bytes) -> bytes | None:
        with self._lock:
            if self._index.touch(key) is None:
                return None
        path = self._path(key)
        data = self._read(key, path)
        if data is None:  # deleted or evicted since the lookup, or removed behind our back
            with self._key_lock(key):
                if not path.exists():  # not installed again meanwhile (puts install under the key lock)
                    with self._lock:
                        self._forget(key)
        return data

    def _read(self, key: bytes, path: Path) -> bytes | None:
        """The whole file, or None when it is gone. An unlink or replace racing the read leaves
        the open file intact, so this is the old frame or the new one, never a mix."""
        self._before_io("read", key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
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

    def charged_bytes(self, nbytes: int) -> int:
        """What a file of `nbytes` costs on the file system before it is written: rounded up to
        whole blocks (the reservation; the index then holds the real st_blocks * 512)."""
        block = self._fs_block_bytes
        return -(-nbytes // block) * block

    def _put(self, key: bytes, payload: bytes, ttl_s: float | None) -> bool:
        size = self.charged_bytes(len(payload))  # what the file system charges, not the apparent size
        if size > self._capacity_bytes:
            self._count_error("too_large")
            return False
        with self._lock:  # room first: a full file system must not hold the new file and the victims
            old = self._index.peek(key)  # replaced by this put: its bytes are not in the way
            limit = self._effective_capacity_bytes - self._reserved_bytes - size + (0 if old is None else old.nbytes)
            victims = self._take_victims(limit, keep=key)
            self._reserved_bytes += size
        installed = False
        try:
            self._remove_files(victims, evicted=True)
            try:
                tmp, allocated = self._write_temp(key, payload)
            except OSError as exc:
                if exc.errno not in _NO_SPACE_ERRNOS:
                    raise
                self._make_room_after_disk_full(key, size, exc)
                tmp, allocated = self._write_temp(key, payload)  # full again: a real failure (gate trips)
                self._count_error("disk_full")  # resolved by eviction: counted, gate stays closed
            self._install(key, tmp, size, allocated or size)
            installed = True
        finally:
            if not installed:
                with self._lock:
                    self._reserved_bytes -= size
        return True

    def _make_room_after_disk_full(self, key: bytes, size: int, exc: OSError) -> None:
        """ENOSPC below the capacity: what is stored now is what the file system holds. Lower the
        effective capacity to it and evict the payload's size plus a margin; re-raise `exc` when
        there is nothing of ours to evict."""
        with self._lock:
            if not any(k != key for k in self._index):
                raise exc
            held_bytes = self._index.usage_bytes + self._reserved_bytes - size
            self._effective_capacity_bytes = min(self._effective_capacity_bytes, held_bytes)
            room_bytes = size + max(size // 8, _ENOSPC_MARGIN_BYTES)
            victims = self._take_victims(self._index.usage_bytes - room_bytes, keep=key)
        self._remove_files(victims, evicted=True)

    def _write_temp(self, key: bytes, payload: bytes) -> tuple[Path, int]:
        """Write `payload` to a new 0600 temp file beside the entry's path; returns its path and
        the bytes the file system allocated for it (st_blocks * 512; 0 when not known yet)."""
        path = self._path(key)
        tmp = path.parent / f".{path.stem}.{os.getpid()}.{next(self._tmp_ids)}{_TMP_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self._before_io("write", key)
        try:
            fd = os.open(tmp, flags, 0o600)  # the umask can only clear bits: never wider than 0600
        except FileNotFoundError:  # the first entry of this fan-out directory (or it was removed)
            _make_private_dir(path.parent)
            fd = os.open(tmp, flags, 0o600)
        try:
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view) :]
                if self.fsync:
                    os.fsync(fd)
                allocated = os.fstat(fd).st_blocks * 512
            finally:
                os.close(fd)
        except BaseException:
            self._unlink_quietly(tmp)
            raise
        return tmp, allocated

    def _install(self, key: bytes, tmp: Path, size: int, allocated: int) -> None:
        """Rename the temp file into place and index it at its `allocated` bytes (what the cap
        and usage count), under the key's lock; `size` is the reservation it replaces."""
        path = self._path(key)
        with self._key_lock(key):
            self._before_io("replace", key)
            try:
                os.replace(tmp, path)
            except BaseException:
                self._unlink_quietly(tmp)
                raise
            with self._lock:
                self._reserved_bytes -= size
                self._index.insert(key, None, allocated)  # a replaced entry frees its bytes
        if self.fsync:
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _delete(self, key: bytes) -> bool:
        with self._key_lock(key):
            with self._lock:
                existed = self._forget(key)
            self._before_io("unlink", key)
            self._unlink_quietly(self._path(key))
        return existed

    def _keys(self) -> Iterable[bytes]:
        with self._lock:
            return list(self._index)

    def _clear(self) -> int:
        with self._lock:
            keys = [entry.key for entry in self._index.clear()]
        self._remove_files(keys, evicted=False)
        return len(keys)

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def usage_bytes(self) -> int:
        """What the entries cost on the file system: the sum of their allocated bytes
        (st_blocks * 512), which the capacity caps; not their apparent sizes."""
        return self._index.usage_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def effective_capacity_bytes(self) -> int:
        """The capacity puts evict to: `capacity_bytes`, or less after the file system filled up
        below it (what it held then; until a restart)."""
        return self._effective_capacity_bytes

    def __len__(self) -> int:
        return len(self._index)
