"""RemoteTier: a Redis / Valkey server or cluster that several engine processes share.

    entry  "<key_prefix>:<fingerprint hex>:<key hex>" -> codec frame   (SET ... PX ttl)
    in a cluster  "<key_prefix>:<fingerprint hex>:{<key[:4] hex>}<key hex>"

In a cluster the braces make key[:4], the key's run tag (kvcache/keys.py), the hash tag: a run
of about 32 consecutive blocks of a chain lives on one master, so losing a master cuts a chain
at its first run there, not at its first block there (docs/benchmarks.md, "Redis Cluster
failure domain"). Configure `cluster-require-full-coverage no` so the other masters keep
serving while one is down.

Nothing process-local is needed for correctness: every process that loads the same model and
configuration computes the same keys, and every frame carries its fingerprint and key, which
the codec checks. Entries expire by TTL and by the server's own maxmemory policy (configure
`maxmemory-policy allkeys-lru` on a dedicated server); this tier never evicts.

URLs:
    redis://[user:password@]host:port/db     rediss://...  (TLS)
    valkey://...  valkeys://...              the same protocol
    redis+cluster://host:port[,host:port...] Redis Cluster (also rediss+cluster, valkey+cluster,
    redis://host:port?cluster=1              and valkeys+cluster); db must be 0

Query options, the same for a server and a cluster (redis-py's names; anything else is a
ValueError): ssl_ca_certs, ssl_ca_path, ssl_cert_reqs (required / optional / none),
ssl_certfile, ssl_keyfile, ssl_password, ssl_check_hostname (the ssl_* ones need a TLS scheme),
socket_timeout, socket_connect_timeout (override `timeout_s`), socket_keepalive, client_name,
max_connections, protocol; user and password come from the URL's userinfo.

Failures: socket timeouts are TierError kind "timeout", refused or reset connections
"connection"; the health gate then skips the server for a backoff. redis-py's connection pool
reconnects by itself once the server is back; a cluster client is rebuilt after a connection
failure, so a restarted cluster is rediscovered. Connection errors are retried once at once
(a pooled socket may be stale after a server restart); timeouts are never retried.

usage_bytes after an outage: a server that restarted has lost (no persistence) or reloaded its
entries, so the sizes this instance accounted may name keys that are gone. Whenever the gate
reopens after failures, the tier resyncs: one pipelined EXISTS per 512 accounted keys,
forgetting the missing ones (this works the same for every node of a cluster, and also
catches the server's own evictions at that moment). A restart that no operation noticed
(redis-py reconnects a dead pooled socket by itself) is caught on a single server by its
run_id: every new connection reads INFO server, and a run_id other than the last one seen
triggers the same resync.
"""

from __future__ import annotations

import functools
import heapq
import logging
import ssl
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url as redis_parse_url
from redis.retry import Retry

from kvtier.kvcache.keys import TAG_BYTES
from kvtier.tiers.base import Tier
from kvtier.tiers.errors import TierError
from kvtier.tiers.faults import FaultConfig
from kvtier.tiers.health import HealthGate

logger = logging.getLogger(__name__)

_SCHEMES = {
    "redis": ("redis", False),
    "rediss": ("rediss", False),
    "valkey": ("redis", False),
    "valkeys": ("rediss", False),
    "redis+cluster": ("redis", True),
    "rediss+cluster": ("rediss", True),
    "valkey+cluster": ("redis", True),
    "valkeys+cluster": ("rediss", True),
}
_TLS_OPTIONS = {
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_cert_reqs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_check_hostname",
}
_URL_OPTIONS = _TLS_OPTIONS | {
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "client_name",
    "max_connections",
    "protocol",
}
_BATCH = 512
"""Keys per SCAN page and per UNLINK pipeline (clear, unlink) and per EXISTS pipeline (resync)."""
_PREFIX_LUA = """
for i, name in ipairs(KEYS) do
    if redis.call('EXISTS', name) == 0 then return i - 1 end
end
return #KEYS
"""


def glob_escape(text: str | bytes) -> bytes:
    """`text` matched literally in a SCAN / KEYS pattern: the one escaping rule for every name
    kvtier matches (a backslash before each of * ? [ ] and backslash)."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    return b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in raw)


def parse_url(url: str) -> tuple[str, bool]:
    """(a redis-py URL, whether it names a cluster). Raises ValueError with the accepted forms."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(
            f"unsupported remote tier URL {url!r}: use redis://, rediss://, valkey://, "
            f"valkeys:// or their +cluster forms (redis+cluster://h1:p1,h2:p2)"
        )
    base_scheme, cluster = _SCHEMES[scheme]
    query = parse_qsl(parts.query, keep_blank_values=True)
    rest = []
    for name, value in query:
        if name == "cluster":
            cluster = cluster or value.lower() in ("1", "true", "yes", "on")
        elif name not in _URL_OPTIONS:
            raise ValueError(
                f"unknown option {name!r} in remote tier URL {url!r}; accepted: "
                f"cluster, {', '.join(sorted(_URL_OPTIONS))}"
            )
        elif name in _TLS_OPTIONS and base_scheme != "rediss":
            raise ValueError(f"{name} in {url!r} needs a TLS URL: use rediss:// (or rediss+cluster://, valkeys://)")
        else:
            rest.append((name, value))
    return urlunsplit((base_scheme, parts.netloc, parts.path, urlencode(rest), "")), cluster


def _client_options(timeout_s: float) -> dict[str, Any]:
    return dict(
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
    )


def _cluster_startup(redis_url: str, url: str) -> dict[str, Any]:
    """RedisCluster arguments from a parsed URL (`redis_url`, from parse_url; `url`: as given,
    for messages): the startup nodes, and the URL's TLS, auth and socket options converted
    exactly as redis-py's from_url converts them for a single server."""
    parts = urlsplit(redis_url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"a Redis Cluster has only db 0, got {url!r}")
    nodes = []
    for hostport in hosts.split(","):
        host, sep, port = hostport.strip().rpartition(":")
        if not sep:
            host, port = port, "6379"
        if not host or not port.isdigit():
            raise ValueError(f"bad cluster node {hostport!r} in {url!r}; expected host:port")
        nodes.append(ClusterNode(host.strip("[]"), int(port)))
    # one node in the URL, so that redis-py parses the options: same names, same types
    host = f"[{nodes[0].host}]" if ":" in nodes[0].host else nodes[0].host  # IPv6
    one = urlunsplit(
        (parts.scheme, (userinfo + "@" if userinfo else "") + f"{host}:{nodes[0].port}", "", parts.query, "")
    )
    options = redis_parse_url(one)
    for name in ("host", "port", "db", "connection_class"):
        options.pop(name, None)
    return dict(startup_nodes=nodes, ssl=parts.scheme == "rediss", **options)


def connect(url: str, *, timeout_s: float = 1.0, on_connect: Any = None) -> Any:
    """A redis-py client for a remote tier URL (the forms in the module doc: a server or a
    cluster), with the options every kvtier client uses: `timeout_s` to connect and per
    command (the URL's socket options win, as redis-py's from_url does), one immediate retry of
    a connection error. `on_connect`: redis-py's connect hook (a single server only)."""
    redis_url, cluster = parse_url(url)
    if not cluster:
        hook = {} if on_connect is None else {"redis_connect_func": on_connect}
        return redis.Redis.from_url(redis_url, **hook, **_client_options(timeout_s))
    return RedisCluster(**{**_client_options(timeout_s), **_cluster_startup(redis_url, url)})


def _scripting_refused(exc: redis.ResponseError) -> bool:
    """Does this error say the server will never run scripts for us (not a passing state)?"""
    msg = str(exc).lower()
    return (
        msg.startswith(("unknown command", "err unknown command", "noperm"))
        or "no permissions" in msg
        or "disabled" in msg
    )


@dataclass(slots=True)
class _Written:
    """What this instance accounts for one entry it wrote (usage_bytes)."""

    nbytes: int
    expiry: float | None
    """time.monotonic() when the server drops it (None: no TTL)."""


class RemoteTier(Tier):
    """Codec frames in a Redis / Valkey server or cluster that several processes share (the
    naming, URLs and recovery: the module doc).

    Stores: nothing of the entries locally; the server holds them (with their TTL) and
    per-tenant owner sets. Locally only a client and the sizes of the entries this instance
    wrote (`usage_bytes`, approximate).

    Thread-safety: every method may be called from any thread; redis-py's connection pool
    serves concurrent callers. `_client_lock` guards (re)building the client, `_sizes_lock`
    the accounted sizes; neither is held during a round trip. Every operation may block on
    the network, up to `timeout_s` per command (plus one immediate retry of a connection
    error), and on injected faults.

    Failures: as every Tier (base.py): timeouts, connection, TLS, cluster and server errors
    are counted by kind, trip the health gate and degrade to a miss or a dropped write. The
    purge helpers (`owner_keys` / `forget_owner` with `strict`, `unlink`, `clear(strict=True)`)
    raise TierError instead, so that a purge that could not reach the server is recorded as
    pending rather than taken as done."""

    def __init__(
        self,
        url: str,
        *,
        fingerprint: bytes,
        ttl_s: float | None = None,
        timeout_s: float = 1.0,
        faults: FaultConfig | None = None,
        key_prefix: str = "kvtier",
        health: HealthGate | None = None,
        name: str = "remote",
    ) -> None:
        """`ttl_s`: default expiry of entries (None: never; the server's maxmemory policy
        evicts). `timeout_s`: connect and per-command socket timeout."""
        super().__init__(name, faults=faults, health=health)
        if len(fingerprint) != 16:
            raise ValueError(f"fingerprint must be 16 bytes, got {len(fingerprint)}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        self.url = url
        self.fingerprint = bytes(fingerprint)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.key_prefix = key_prefix
        self._redis_url, self.cluster = parse_url(url)
        self._name_prefix = f"{key_prefix}:{self.fingerprint.hex()}:".encode()
        self._client_lock = threading.Lock()
        self._resync_due = False  # the server restarted or came back: resync sizes (module doc)
        self._server_run_id: str | None = None
        if self.cluster:
            self._cluster_startup()  # a bad URL fails here, not in a worker thread
        self._client: Any = None if self.cluster else self._make_client()  # cluster: lazily
        # standalone servers answer contains_prefix with one script call, stopping at the first
        # miss, instead of one pipelined EXISTS per key (redis-py reloads it after a server
        # restart). A cluster cannot run it: the keys live in different slots.
        self._prefix_script = None if self._client is None else self._client.register_script(_PREFIX_LUA)
        # usage_bytes bookkeeping (see usage_bytes)
        self._sizes_lock = threading.Lock()
        self._sizes: dict[bytes, _Written] = {}
        self._expiries: list[tuple[float, bytes]] = []  # heap
        self._usage_bytes = 0

    # -- client ----------------------------------------------------------------------------------------
    def _on_connect(self, connection: Any) -> None:
        """redis-py's connect hook (single server): set the connection up as usual, then note
        whether the server restarted since the last connection (see the module doc)."""
        connection.on_connect()
        connection.send_command("INFO", "server")
        try:
            info = connection.read_response()
        except redis.ResponseError:  # an ACL without INFO (it is @dangerous): no restart check
            return
        text = info.decode() if isinstance(info, bytes) else str(info)
        run_id = next((line[7:].strip() for line in text.splitlines() if line.startswith("run_id:")), None)
        if run_id is not None:
            if self._server_run_id is not None and run_id != self._server_run_id:
                self._resync_due = True
            self._server_run_id = run_id

    def _cluster_startup(self) -> dict[str, Any]:
        """RedisCluster arguments from this tier's URL (see the module function)."""
        return _cluster_startup(self._redis_url, self.url)

    def _make_client(self) -> Any:
        return connect(self.url, timeout_s=self.timeout_s, on_connect=None if self.cluster else self._on_connect)

    def client(self) -> Any:
        """The redis-py client (a server's or a cluster's; a cluster's is built here on first
        use, and again after a connection failure). Call it inside an operation passed to
        `call`, so that its errors go through the health gate as the tier's own do."""
        client = self._client
        if client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = self._make_client()  # a cluster connects here: may raise
                client = self._client
        if self._resync_due:  # inside the current gated operation: its errors are reported
            self._resync_due = False
            self._resync_sizes(client)
        return client

    def _drop_cluster_client(self) -> None:
        """After a connection failure, rebuild a cluster client on the next probe (topology)."""
        if not self.cluster:
            return
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001, S110 - a dead connection may fail to close
                pass

    # -- keyspace (the names in the module doc; every module that touches them asks here) -----------
    @property
    def name_prefix(self) -> bytes:
        """ "<key_prefix>:<fingerprint hex>:": every name of this tier's model configuration."""
        return self._name_prefix

    def entry_name(self, key: bytes) -> bytes:
        """The name of `key`'s entry (in a cluster with its run tag as the hash tag)."""
        if self.cluster:
            return b"%s{%s}%s" % (self._name_prefix, key[:TAG_BYTES].hex().encode(), key.hex().encode())
        return self._name_prefix + key.hex().encode()

    _name = entry_name

    def owner_set_name(self, owner_id: str) -> bytes:
        """The set of the keys recorded for `owner_id` (hex members)."""
        return self.record_name(b"owner:" + owner_id.encode())

    def record_name(self, record: bytes) -> bytes:
        """The name of another record of this model configuration beside the entries (the fleet
        keyring's "datakey:<owner id>" and "keycheck"): the prefix, then `record`."""
        return self._name_prefix + record

    def match(self, pattern: bytes = b"*") -> bytes:
        """A SCAN pattern: this configuration's names (the prefix matched literally) whose rest
        matches the glob `pattern` (b"*": every name, b"datakey:*": the wrapped keys)."""
        return glob_escape(self._name_prefix) + pattern

    @staticmethod
    def owner_sets_match(owner_id: str, key_prefix: str = "kvtier") -> bytes:
        """A SCAN pattern of `owner_id`'s owner sets under `key_prefix`, every fingerprint."""
        return glob_escape(f"{key_prefix}:") + b"*:" + glob_escape(f"owner:{owner_id}")

    @staticmethod
    def fingerprint_of(name: bytes | str, key_prefix: str = "kvtier") -> bytes | None:
        """The fingerprint in a name under `key_prefix` (None: not such a name)."""
        text = name.decode(errors="replace") if isinstance(name, bytes) else name
        head = f"{key_prefix}:"
        if not text.startswith(head):
            return None
        try:
            fingerprint = bytes.fromhex(text[len(head) :].partition(":")[0])
        except ValueError:
            return None
        return fingerprint if len(fingerprint) == 16 else None

    @classmethod
    def owner_fingerprints(
        cls, url: str, owner_id: str, key_prefix: str = "kvtier", timeout_s: float = 1.0
    ) -> set[bytes]:
        """The fingerprints (model configurations) with an owner set of `owner_id` on the
        server or cluster at `url`: what an offline purge must open. Raises redis errors."""
        client = connect(url, timeout_s=timeout_s)
        try:
            names = client.scan_iter(match=cls.owner_sets_match(owner_id, key_prefix), count=1000)
            return {fp for fp in (cls.fingerprint_of(name, key_prefix) for name in names) if fp is not None}
        finally:
            client.close()

    # -- backend ----------------------------------------------------------------------------------------
    def _error_kind(self, exc: BaseException) -> str:
        if isinstance(exc, redis.TimeoutError):
            return "timeout"
        if isinstance(exc, (redis.ConnectionError, redis.exceptions.RedisClusterException)):
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, ssl.SSLError) or "[SSL" in str(exc):
                self._drop_cluster_client()
                return "tls"  # the message names the problem (unknown CA, hostname mismatch)
        if isinstance(exc, redis.ConnectionError):
            self._drop_cluster_client()
            return "connection"
        if isinstance(exc, (redis.exceptions.ClusterError, redis.exceptions.RedisClusterException)):
            self._drop_cluster_client()
            return "cluster"
        if isinstance(exc, redis.ResponseError):
            msg = str(exc)
            if msg.startswith("OOM"):
                return "full"
            if msg.startswith("READONLY"):
                return "readonly"
            return "redis"
        if isinstance(exc, redis.RedisError):
            return "redis"
        return super()._error_kind(exc)

    def _pipeline(self) -> Any:
        client = self.client()
        return client.pipeline() if self.cluster else client.pipeline(transaction=False)

    def _contains_prefix(self, keys: list[bytes]) -> int:
        names = [self.entry_name(key) for key in keys]
        script = self._prefix_script
        if script is not None:
            try:
                return int(script(keys=names, client=self.client()))
            except redis.ResponseError as exc:
                # this call falls back to EXISTS either way (a failure there is the call's);
                # only a server that refuses scripts for good (managed services, an ACL) loses it
                if _scripting_refused(exc):
                    logger.warning(
                        "remote tier %s: the server refuses Lua (%s); contains_prefix "
                        "uses pipelined EXISTS from now on",
                        self.name,
                        exc,
                    )
                    self._prefix_script = None
                else:
                    logger.debug(
                        "remote tier %s: prefix script failed (%s); pipelined EXISTS this time", self.name, exc
                    )
        # one round trip (per node in a cluster); EXISTS per key works across slots
        pipe = self._pipeline()
        for name in names:
            pipe.exists(name)
        for i, found in enumerate(pipe.execute()):
            if not found:
                return i
        return len(keys)

    def _get(self, key: bytes) -> bytes | None:
        return self.client().get(self.entry_name(key))

    # -- ownership sets (purge by tenant) ------------------------------------------------------
    def record_owner(self, owner_id: str, keys: list[bytes]) -> None:
        """Remember that `keys` belong to `owner_id` (a Redis set shared by every process)."""
        if not keys:
            return
        try:
            self.call(
                "record_owner", lambda: self.client().sadd(self.owner_set_name(owner_id), *[k.hex() for k in keys])
            )
        except TierError:
            pass  # counted by call(); the blocks stay readable, only a purge by owner misses them

    def owner_keys(self, owner_id: str, strict: bool = False) -> list[bytes]:
        """The keys recorded for `owner_id`; [] when the server cannot be asked (`strict`:
        raise TierError instead, for a purge that must know)."""
        try:
            members = self.call("owner_keys", lambda: self.client().smembers(self.owner_set_name(owner_id)))
        except TierError:
            if strict:
                raise
            return []
        out = []
        for m in members:
            try:
                out.append(bytes.fromhex(m.decode() if isinstance(m, bytes) else m))
            except ValueError:
                continue
        return out

    def contains_count(self, keys: list[bytes], owner_id: str | None = None) -> int:
        """How many of `keys` the server still holds (pipelined EXISTS, a round trip per batch):
        entries its TTL or eviction removed are not counted, and with `owner_id` they are
        dropped from the owner's set too. 0 when the server cannot be asked."""
        held = 0
        gone: list[bytes] = []
        try:
            for start in range(0, len(keys), _BATCH):
                chunk = keys[start : start + _BATCH]

                def op(chunk: list[bytes] = chunk) -> list[Any]:
                    pipe = self._pipeline()
                    for key in chunk:
                        pipe.exists(self.entry_name(key))
                    return pipe.execute()

                found = self.call("owner_usage", op)
                held += sum(1 for f in found if f)
                gone += [k for k, f in zip(chunk, found) if not f]
            if owner_id is not None and gone:
                members = [k.hex() for k in gone]
                self.call("owner_usage", lambda: self.client().srem(self.owner_set_name(owner_id), *members))
        except TierError:
            return held
        return held

    def drain_owner(self, owner_id: str) -> int:
        """Delete every entry recorded for `owner_id` and its set: rounds of SRANDMEMBER (a
        batch of members, read without removing them), UNLINK of their entries, then SREM of
        those members, until the set is gone. A block recorded while the purge runs is taken
        by a later round, so none survives it. Idempotent: a member leaves the set only after
        its entry is deleted, so a round cut short (TierError, raised) loses nothing for the
        retry. Returns how many entries existed."""
        name = self.owner_set_name(owner_id)
        removed = 0
        while True:
            members = self.call("purge", lambda: self.client().srandmember(name, _BATCH))
            if not members:
                return removed
            keys: list[bytes] = []
            for m in members:
                try:
                    keys.append(bytes.fromhex(m.decode() if isinstance(m, bytes) else m))
                except ValueError:
                    continue  # not one of ours: dropped from the set below
            removed += self.unlink(keys)
            self.call("purge", functools.partial(self._srem, name, list(members)))

    def _srem(self, name: bytes, members: list[Any]) -> int:
        return int(self.client().srem(name, *members))

    def forget_owner(self, owner_id: str, strict: bool = False) -> None:
        """Drop the owner's set (`strict`: raise TierError when the server cannot be asked)."""
        try:
            self.call("forget_owner", lambda: self.client().unlink(self.owner_set_name(owner_id)))
        except TierError:
            if strict:
                raise

    def unlink(self, keys: list[bytes]) -> int:
        """Delete `keys` with pipelined UNLINKs, one round trip per batch of keys, through the
        gate (a purge's bulk delete); returns how many existed. Raises TierError: batches
        before the failing one stay deleted (and counted)."""
        removed = 0
        for start in range(0, len(keys), _BATCH):
            chunk = keys[start : start + _BATCH]

            def op(chunk: list[bytes] = chunk) -> int:
                pipe = self._pipeline()
                for key in chunk:
                    pipe.unlink(self.entry_name(key))  # one key per command: valid across cluster slots
                return sum(pipe.execute())

            n = self.call("purge", op)
            for key in chunk:
                self._account(key, 0, None)
            self._count(deletes=n)
            removed += n
        return removed

    def clear(self, strict: bool = False) -> int:
        """Delete every entry of this tier's fingerprint; returns how many were removed.
        `strict`: raise TierError when the server cannot be asked (a purge of every tenant),
        instead of answering 0."""
        if not strict:
            return super().clear()
        return self.call("purge", self._clear)

    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        pipe = self._pipeline()  # GET per key: valid across cluster slots
        for key in keys:
            pipe.get(self.entry_name(key))
        return pipe.execute()

    def _put(self, key: bytes, payload: bytes, ttl_s: float | None) -> bool:
        ttl_s = self.ttl_s if ttl_s is None else ttl_s
        px = max(1, round(ttl_s * 1000)) if ttl_s is not None else None
        self.client().set(self.entry_name(key), payload, px=px)
        self._account(key, len(payload), ttl_s)
        return True

    def _delete(self, key: bytes) -> bool:
        existed = bool(self.client().unlink(self.entry_name(key)))
        self._account(key, 0, None)
        return existed

    def _keys(self) -> Iterable[bytes]:
        cut = len(self._name_prefix)
        for name in self.client().scan_iter(match=self.match(), count=_BATCH):
            rest = name[cut:]
            if rest[:1] == b"{":  # a cluster name: "{tag}" before the key
                rest = rest[2 + 2 * TAG_BYTES :]
            try:
                yield bytes.fromhex(rest.decode())
            except ValueError:
                continue  # someone else's key under our prefix

    def _clear(self) -> int:
        names = list(self.client().scan_iter(match=self.match(), count=_BATCH))
        num_removed = 0
        for start in range(0, len(names), _BATCH):
            pipe = self._pipeline()
            for name in names[start : start + _BATCH]:
                pipe.unlink(name)  # one key per command: valid across cluster slots
            num_removed += sum(pipe.execute())
        with self._sizes_lock:
            self._sizes.clear()
            self._expiries.clear()
            self._usage_bytes = 0
        return num_removed

    def _close(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- sizes ---------------------------------------------------------------------------------------
    def _on_recovered(self) -> None:
        self._resync_due = True
        try:
            self.call("resync", self.client)  # client() resyncs when due
        except TierError:
            pass  # counted by call(); the next recovery tries again

    def _resync_sizes(self, client: Any) -> None:
        """Forget the accounted sizes of keys the server no longer holds (see module doc)."""
        with self._sizes_lock:
            snapshot = list(self._sizes.items())
        missing: list[tuple[bytes, _Written]] = []
        for start in range(0, len(snapshot), _BATCH):
            batch = snapshot[start : start + _BATCH]
            pipe = client.pipeline() if self.cluster else client.pipeline(transaction=False)
            for key, _ in batch:
                pipe.exists(self.entry_name(key))
            missing += [item for item, found in zip(batch, pipe.execute()) if not found]
        with self._sizes_lock:
            for key, entry in missing:
                if self._sizes.get(key) is entry:  # not rewritten meanwhile
                    del self._sizes[key]
                    self._usage_bytes -= entry.nbytes
        if missing:
            logger.info(
                "remote tier %s: %d accounted entries are gone from the server; usage resynced", self.name, len(missing)
            )

    def _account(self, key: bytes, nbytes: int, ttl_s: float | None) -> None:
        now = time.monotonic()
        expiry = now + ttl_s if ttl_s is not None else None
        with self._sizes_lock:
            old = self._sizes.pop(key, None)
            if old is not None:
                self._usage_bytes -= old.nbytes
            if nbytes:
                self._sizes[key] = _Written(nbytes, expiry)
                self._usage_bytes += nbytes
                if expiry is not None:
                    heapq.heappush(self._expiries, (expiry, key))
            self._prune_expired(now)

    def _prune_expired(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            expiry, key = heapq.heappop(self._expiries)
            entry = self._sizes.get(key)
            if entry is not None and entry.expiry == expiry:
                del self._sizes[key]
                self._usage_bytes -= entry.nbytes

    @property
    def usage_bytes(self) -> int:
        """Approximate: bytes of the entries THIS instance wrote that have neither been deleted
        by it nor passed their TTL. Blind to other processes and to the server's own evictions
        (asking the server, MEMORY USAGE per key, would cost a round trip per entry), except
        after an outage or a reconnect, when it is resynced (see the module doc)."""
        with self._sizes_lock:
            self._prune_expired(time.monotonic())
            return self._usage_bytes
