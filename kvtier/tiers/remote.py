"""RemoteTier: a Redis / Valkey server or cluster that several engine processes share.

    entry  "<key_prefix>:<fingerprint hex>:<key hex>" -> codec frame   (SET ... PX ttl)

Nothing process-local is needed for correctness: every process that loads the same model and
configuration computes the same keys, and every frame carries its fingerprint and key, which
the codec checks. Entries expire by TTL and by the server's own maxmemory policy (configure
`maxmemory-policy allkeys-lru` on a dedicated server); this tier never evicts.

URLs:
    redis://[user:password@]host:port/db     rediss://...  (TLS)
    valkey://...  valkeys://...              the same protocol
    redis+cluster://host:port[,host:port...] Redis Cluster (also rediss+cluster, valkey+cluster,
    redis://host:port?cluster=1              and valkeys+cluster); db must be 0

Failures: socket timeouts are TierError kind "timeout", refused or reset connections
"connection"; the health gate then skips the server for a backoff. redis-py's connection pool
reconnects by itself once the server is back; a cluster client is rebuilt after a connection
failure, so a restarted cluster is rediscovered. Connection errors are retried once at once
(a pooled socket may be stale after a server restart); timeouts are never retried.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import Any, Iterable
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvtier.tiers.base import FaultConfig, HealthGate, Tier

logger = logging.getLogger(__name__)

_SCHEMES = {"redis": ("redis", False), "rediss": ("rediss", False), "valkey": ("redis", False),
            "valkeys": ("rediss", False), "redis+cluster": ("redis", True),
            "rediss+cluster": ("rediss", True), "valkey+cluster": ("redis", True),
            "valkeys+cluster": ("rediss", True)}
_BATCH = 512
_PREFIX_LUA = """
for i, name in ipairs(KEYS) do
    if redis.call('EXISTS', name) == 0 then return i - 1 end
end
return #KEYS
"""  # keys per SCAN page and per UNLINK pipeline in clear()


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def parse_url(url: str) -> tuple[str, bool]:
    """(a redis-py URL, whether it names a cluster). Raises ValueError with the accepted forms."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"unsupported remote tier URL {url!r}: use redis://, rediss://, valkey://, "
                         f"valkeys:// or their +cluster forms (redis+cluster://h1:p1,h2:p2)")
    base_scheme, cluster = _SCHEMES[scheme]
    query = parse_qsl(parts.query, keep_blank_values=True)
    rest = []
    for name, value in query:
        if name == "cluster":
            cluster = cluster or value.lower() in ("1", "true", "yes", "on")
        else:
            rest.append((name, value))
    return urlunsplit((base_scheme, parts.netloc, parts.path, urlencode(rest), "")), cluster


class RemoteTier(Tier):
    def __init__(self, url: str, *, fingerprint: bytes, ttl_s: float | None = None,
                 timeout_s: float = 1.0, faults: FaultConfig | None = None,
                 key_prefix: str = "kvtier", health: HealthGate | None = None,
                 name: str = "remote") -> None:
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
        if self.cluster:
            self._cluster_startup()  # a bad URL fails here, not in a worker thread
        self._client: Any = None if self.cluster else self._make_client()  # cluster: lazily
        # standalone servers answer contains_prefix with one script call, stopping at the first
        # miss: 3x faster than 128 pipelined EXISTS (redis-py reloads it after a server restart).
        # A cluster cannot run it: the keys live in different slots.
        self._prefix_script = None if self.cluster else self._client.register_script(_PREFIX_LUA)
        # usage_bytes bookkeeping (see usage_bytes)
        self._sizes_lock = threading.Lock()
        self._sizes: dict[bytes, tuple[int, float | None]] = {}  # key -> (bytes, expiry)
        self._expiries: list[tuple[float, bytes]] = []  # heap
        self._usage_bytes = 0

    # -- client ----------------------------------------------------------------------------------------
    def _client_options(self) -> dict[str, Any]:
        return dict(socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                    retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)))

    def _cluster_startup(self) -> dict[str, Any]:
        """RedisCluster arguments from the URL (checked at construction, used lazily)."""
        parts = urlsplit(self._redis_url)
        userinfo, _, hosts = parts.netloc.rpartition("@")
        username, _, password = userinfo.partition(":")
        if parts.path not in ("", "/", "/0"):
            raise ValueError(f"a Redis Cluster has only db 0, got {self.url!r}")
        nodes = []
        for hostport in hosts.split(","):
            host, sep, port = hostport.strip().rpartition(":")
            if not sep:
                host, port = port, "6379"
            if not host or not port.isdigit():
                raise ValueError(f"bad cluster node {hostport!r} in {self.url!r}; expected host:port")
            nodes.append(ClusterNode(host.strip("[]"), int(port)))
        return dict(startup_nodes=nodes, ssl=parts.scheme == "rediss",
                    username=unquote(username) or None, password=unquote(password) or None)

    def _make_client(self) -> Any:
        if not self.cluster:
            return redis.Redis.from_url(self._redis_url, **self._client_options())
        return RedisCluster(**self._cluster_startup(), **self._client_options())

    def _redis(self) -> Any:
        client = self._client
        if client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = self._make_client()  # a cluster connects here: may raise
                client = self._client
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
            except Exception:
                pass

    def _name(self, key: bytes) -> bytes:
        return self._name_prefix + key.hex().encode()

    # -- backend ----------------------------------------------------------------------------------------
    def _error_kind(self, exc: BaseException) -> str:
        if isinstance(exc, redis.TimeoutError):
            return "timeout"
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
        client = self._redis()
        return client.pipeline() if self.cluster else client.pipeline(transaction=False)

    def _contains_prefix(self, keys: list[bytes]) -> int:
        names = [self._name(key) for key in keys]
        if self._prefix_script is not None:
            try:
                return int(self._prefix_script(keys=names, client=self._redis()))
            except redis.ResponseError as exc:  # scripting disabled (some managed services)
                logger.info("remote tier %s: Lua unavailable (%s); using pipelined EXISTS", self.name, exc)
                self._prefix_script = None
        # one round trip (per node in a cluster); EXISTS per key works across slots
        pipe = self._pipeline()
        for name in names:
            pipe.exists(name)
        for i, found in enumerate(pipe.execute()):
            if not found:
                return i
        return len(keys)

    def _get(self, key: bytes) -> bytes | None:
        return self._redis().get(self._name(key))

    # -- ownership sets (purge by tenant) ------------------------------------------------------
    def _owner_set(self, owner_id: str) -> bytes:
        return self._name_prefix + b"owner:" + owner_id.encode()

    def record_owner(self, owner_id: str, keys: list[bytes]) -> None:
        """Remember that `keys` belong to `owner_id` (a Redis set shared by every process)."""
        if not keys or not self._gate.allow():
            return
        try:
            self._redis().sadd(self._owner_set(owner_id), *[k.hex() for k in keys])
        except Exception as exc:
            self._fail("record_owner", exc)

    def owner_keys(self, owner_id: str) -> list[bytes]:
        if not self._gate.allow():
            return []
        try:
            members = self._redis().smembers(self._owner_set(owner_id))
        except Exception as exc:
            self._fail("owner_keys", exc)
            return []
        out = []
        for m in members:
            try:
                out.append(bytes.fromhex(m.decode() if isinstance(m, bytes) else m))
            except ValueError:
                continue
        return out

    def forget_owner(self, owner_id: str) -> None:
        try:
            self._redis().unlink(self._owner_set(owner_id))
        except Exception as exc:
            self._fail("forget_owner", exc)

    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        pipe = self._pipeline()  # GET per key: valid across cluster slots
        for key in keys:
            pipe.get(self._name(key))
        return pipe.execute()

    def _put(self, key: bytes, payload: bytes, ttl_s: float | None) -> bool:
        ttl_s = self.ttl_s if ttl_s is None else ttl_s
        px = max(1, round(ttl_s * 1000)) if ttl_s is not None else None
        self._redis().set(self._name(key), payload, px=px)
        self._account(key, len(payload), ttl_s)
        return True

    def _delete(self, key: bytes) -> bool:
        existed = bool(self._redis().unlink(self._name(key)))
        self._account(key, 0, None)
        return existed

    def _keys(self) -> Iterable[bytes]:
        pattern = _glob_escape(self._name_prefix.decode()) + "*"
        cut = len(self._name_prefix)
        for name in self._redis().scan_iter(match=pattern, count=_BATCH):
            try:
                yield bytes.fromhex(name[cut:].decode())
            except ValueError:
                continue  # someone else's key under our prefix

    def _clear(self) -> int:
        pattern = _glob_escape(self._name_prefix.decode()) + "*"
        names = list(self._redis().scan_iter(match=pattern, count=_BATCH))
        num_removed = 0
        for start in range(0, len(names), _BATCH):
            pipe = self._pipeline()
            for name in names[start:start + _BATCH]:
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
    def _account(self, key: bytes, nbytes: int, ttl_s: float | None) -> None:
        now = time.monotonic()
        expiry = now + ttl_s if ttl_s is not None else None
        with self._sizes_lock:
            old = self._sizes.pop(key, None)
            if old is not None:
                self._usage_bytes -= old[0]
            if nbytes:
                self._sizes[key] = (nbytes, expiry)
                self._usage_bytes += nbytes
                if expiry is not None:
                    heapq.heappush(self._expiries, (expiry, key))
            self._prune_expired(now)

    def _prune_expired(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            expiry, key = heapq.heappop(self._expiries)
            entry = self._sizes.get(key)
            if entry is not None and entry[1] == expiry:
                del self._sizes[key]
                self._usage_bytes -= entry[0]

    @property
    def usage_bytes(self) -> int:
        """Approximate: bytes of the entries THIS instance wrote that have neither been deleted
        by it nor passed their TTL. Blind to other processes and to the server's own evictions
        (asking the server, MEMORY USAGE per key, would cost a round trip per entry)."""
        with self._sizes_lock:
            self._prune_expired(time.monotonic())
            return self._usage_bytes
