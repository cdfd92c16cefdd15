"""KV events: what an instance's caches hold, published in vLLM 0.32's wire format, so the routers
that place requests by cache state (vllm-router's `kv_aware`, Dynamo's KV router, llm-d's
precise prefix-cache scorer) see kvtier instances as they see vLLM ones.

    engine thread                                      publisher thread
    -------------                                      ----------------
    PrefixIndex insert/remove  --.                     ZMQ PUB   (topic, seq: 8 bytes big-endian,
    tier put/delete/evict (any  --> KVEventRecorder -->           payload: msgpack KVEventBatch)
      thread: `Tier.watch`)     |   (pending events;   ZMQ ROUTER replay: [b"", start_seq] ->
    tenant purge, cache reset --'    one batch a step)  every buffered batch from start_seq, then
                                                        [b"", b"", -1 (signed 8 bytes), b""]

Wire format (vLLM 0.32, `vllm/distributed/kv_events.py`): a batch is the array
`[ts, [events...], data_parallel_rank]`; each event a map tagged `"type"`: `BlockStored`
(`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`,
`lora_name`, then `extra_keys`, `group_idx`, ... left out when unset), `BlockRemoved`
(`block_hashes`, `medium`, ...), `AllBlocksCleared`. The structs below are written to encode
exactly as vLLM's do (tests/test_kv_events.py decodes kvtier's stream with vLLM's own structs).

What is published, per medium (vLLM's names):

    GPU       the engine's device pool (its prefix index): a block cached, a block evicted
    CPU       the host tier                                   LOCAL
    STORAGE   the disk tier (locality LOCAL) and the Redis / Valkey tier (locality REMOTE)

A block stored in several tiers is announced once per medium, under one hash; a removal names
the medium it left. Block hashes are 64-bit ints: the last 8 bytes of kvtier's 16-byte chained,
salted block key (the first 4 are a run tag that neighbouring blocks share). `token_ids` and
`block_size` are exact, so a router that rebuilds its own hashes from tokens (vllm-router does)
matches prompts against them. `parent_block_hash` is None for a first block.

LoRA: a block computed under an adapter carries the adapter's `lora_id` (its LoRARequest's
`lora_int_id`) and `lora_name`, as vLLM's block pool fills them from the request; None for the
base model. kvtier's block keys hold the adapter's content digest, not its name, so an adapter
served under two names (the same files) shares its blocks: a block carries the id and name of
the request that computed it first.

Salts: vLLM publishes a request's `cache_salt` in clear in the first block's `extra_keys`.
kvtier never does (a salt is a tenant's secret: whoever reads the stream would learn it); the
first block of a salted chain carries `(salt_digest(salt),)` instead, a 16-hex-digit keyed
digest, so a consumer that knows a request's salt can compute the same value, and one that
does not learns nothing. Unsalted chains carry no extra keys, as in vLLM.

What is not published: blocks already on disk or in Redis when the engine starts (their tokens
are not known until a request touches them again: then the device announces them), and Redis
entries that expire by Redis's own TTL or that another instance deletes (Redis tells no one;
a router learns of them when this instance's own purge or eviction removes them). A tenant
purge removes every block of the tenant that this instance announced, on every medium; a
prefix-cache reset removes the device's blocks (`AllBlocksCleared` when nothing is left on any
medium).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

import msgspec

logger = logging.getLogger("kvtier.kv_events")

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"

TIER_MEDIA: dict[str, tuple[str, str]] = {
    "host": (MEDIUM_CPU, LOCAL),
    "disk": (MEDIUM_STORAGE, LOCAL),
    "remote": (MEDIUM_STORAGE, REMOTE),
}
"""kvtier's tiers as vLLM's media (and locality relative to this instance)."""


# -- the wire format (vLLM 0.32's msgspec structs, field for field) ------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One event; encodes as a map with its class name under "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


FLUSH_DELAY_S = 0.005
"""How long the publisher waits after a wake-up before it flushes events that arrived between
steps, so that a burst of tier writes goes out as one batch (well inside a router's patience)."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay marker (vLLM's)."""


def block_hash(key: bytes) -> int:
    """A kvtier block key as the 64-bit block hash the events carry."""
    return int.from_bytes(key[-8:], "big")


def salt_digest(cache_salt: str) -> str:
    """What the events carry for a salted chain instead of the salt (see the module docstring)."""
    return hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=8, key=b"kvtier-kv-events").hexdigest()


# -- configuration -----------------------------------------------------------------------------
@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: the same fields, defaults and meaning (`--kv-events-config`)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    """"zmq" or "null"; unset: "zmq" when events are enabled, else "null"."""
    endpoint: str = "tcp://*:5557"
    """PUB address: bound when it holds "*" or "::" or is ipc:// or inproc://, else connected
    (vLLM's rule)."""
    replay_endpoint: str | None = None
    """ROUTER address for replays (always bound); None: no replay."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """The PUB socket's high-water mark."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread; past it a batch is dropped (and counted)
    rather than stalling the engine step."""
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"kv_events_config: {name} must be a positive integer")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"kv_events_config: endpoint must be a ZMQ address, got {self.endpoint!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig | None:
        """From what `LLM(kv_events_config=...)` and `--kv-events-config` take: a config, a dict
        or a JSON object; unknown fields are an error (never silently ignored)."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_events_config: not a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("kv_events_config: expected a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown fields {unknown}; known: {sorted(known)}")
        return cls(**value)


def _is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# -- the publisher -----------------------------------------------------------------------------
class ZmqEventPublisher:
    """PUB + ROUTER replay on a thread of its own: the engine thread only queues a batch."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0, flush: Callable[[], None] | None = None):
        import zmq

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._flush = flush
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._topic = config.topic.encode("utf-8")
        self.num_published = 0
        self.num_dropped = 0
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # closing (or collecting) it never blocks on a socket
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self.endpoint = config.endpoint
        if _is_bind_endpoint(config.endpoint):
            self._pub.bind(config.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(config.endpoint)
        self._replay = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "KV events: publishing on %s%s (topic %r)",
            self.endpoint,
            f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
            config.topic,
        )

    def publish(self, batch: KVEventBatch) -> None:
        """Queue a batch (never blocks: a full queue drops it, counted in num_dropped)."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
            os.write(self._wake_w, b"b")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the thread is awake
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events: the publisher is behind; %d batches dropped", self.num_dropped)

    def wake(self) -> None:
        """Ask the publisher thread to flush the recorder soon (events that arrived between
        steps: a tier write, an idle engine's purge). Any thread; never blocks."""
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"w")
            except (BlockingIOError, OSError):
                pass

    def _run(self) -> None:
        """Sleeps until there is work: a queued batch, a wake-up or a replay request (no
        periodic wake-ups: on a small CPU machine a thread that wakes 100 times a second costs
        the compute threads their barriers)."""
        import zmq

        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._replay is not None and self._replay in ready:
                try:
                    self._serve_replay()
                except Exception:  # a bad replay request must not stop publishing
                    logger.exception("KV events: replay failed")
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                if self._wake_pending and self._flush is not None and self._running:
                    time.sleep(FLUSH_DELAY_S)  # let a burst of tier writes land in one batch
                    self._wake_pending = False
                    self._flush()
            while True:
                try:
                    batch = self._queue.get_nowait()
                except queue.Empty:
                    break
                if batch is None:
                    return
                try:
                    seq = next(self._seq)
                    payload = encoder.encode(batch)
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                    self.num_published += 1
                except Exception:  # keep publishing; back off a little
                    logger.exception("KV events: publishing failed")
                    time.sleep(0.1)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: a replay request of %d frames (expected 3) ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Publish what is queued (within `timeout_s`), then close the sockets."""
        if not self._running:
            return
        self._running = False
        if self._flush is not None:
            self._flush()
        self._queue.put(None)
        try:
            os.write(self._wake_w, b"q")
        except BlockingIOError:
            pass
        self._thread.join(timeout_s)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)


# -- the recorder ------------------------------------------------------------------------------
_GPU = 1
_MEDIA_BITS: dict[tuple[str, str | None], int] = {
    (MEDIUM_GPU, None): _GPU,
    (MEDIUM_CPU, LOCAL): 2,
    (MEDIUM_STORAGE, LOCAL): 4,
    (MEDIUM_STORAGE, REMOTE): 8,
}


@dataclass(slots=True)
class _Block:
    parent: int | None
    tokens: bytes
    """array('q') of the block's token ids."""
    extra: tuple[str] | None
    owner_id: str | None
    media: int = 0
    """Bits of _MEDIA_BITS: where the block is announced."""
    lora_id: int | None = None
    lora_name: str | None = None


class KVEventRecorder:
    """Turns cache changes into events and hands one batch per engine step to the publisher.

    Called from the engine thread (the device pool's prefix index, purges, resets) and from the
    tiers' I/O threads (`Tier.watch`, the host tier's watch): one lock. Keeps, per announced
    block, its parent hash, tokens, salt digest and owner, while any medium holds it and for a
    while after (a write-back store reaches the host tier just after the device evicted the
    block); a tier store of a block whose tokens it never saw is not announced."""

    KEEP_GONE = 65_536
    """Blocks no medium holds whose tokens are kept for a later tier store."""

    def __init__(self, block_size: int, publisher: ZmqEventPublisher | None) -> None:
        self.block_size = block_size
        self.publisher = publisher
        self._lock = threading.Lock()
        self._blocks: dict[int, _Block] = {}
        self._gone: deque[int] = deque()
        self._pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self.num_unannounced = 0
        """Tier stores of blocks whose tokens were never seen here (not published)."""

    # -- the device pool (kvtier.kvcache.prefix_index.PrefixIndex.listener) ----------------------
    def stored(
        self,
        key: bytes,
        parent: bytes,
        tokens: Sequence[int] | None,
        is_first: bool,
        owner: Any = None,
        lora: Any = None,
    ) -> None:
        if tokens is None:
            return
        info = self.describe(key, parent, tokens, is_first, owner, lora)
        with self._lock:
            self._announce(block_hash(key), info, MEDIUM_GPU, None)

    def describe(
        self, key: bytes, parent: bytes, tokens: Sequence[int], is_first: bool, owner: Any = None, lora: Any = None
    ) -> _Block:
        """Learn a block's parent, tokens, tenant (`owner`: anything with `cache_salt` and
        `owner_id`) and adapter (`lora`: anything with `lora_int_id` and `lora_name`, kvtier's
        LoRARequest or vLLM's; None: the base model), so that a tier's later store of it can be
        announced; announces nothing itself (the vLLM connector: the scheduler knows the tokens,
        the workers the tiers)."""
        salt = getattr(owner, "cache_salt", None)
        info = _Block(
            None if is_first else block_hash(parent),
            array("q", tokens).tobytes(),
            (salt_digest(salt),) if is_first and salt is not None else None,
            getattr(owner, "owner_id", None),
            lora_id=getattr(lora, "lora_int_id", None),
            lora_name=getattr(lora, "lora_name", None),
        )
        h = block_hash(key)
        with self._lock:
            old = self._blocks.get(h)
            if old is not None:
                info.media = old.media
            self._blocks[h] = info
        return info

    def removed(self, key: bytes) -> None:
        with self._lock:
            self._retract(block_hash(key), MEDIUM_GPU, None)

    # -- the tiers (Tier.watch / HostTier.watch) -----------------------------------------------
    def tier_watch(self, tier: str) -> Callable[[bytes, bool], None]:
        medium, locality = TIER_MEDIA[tier]

        def watch(key: bytes, present: bool) -> None:
            h = block_hash(key)
            with self._lock:
                if not present:
                    self._retract(h, medium, locality)
                else:
                    info = self._blocks.get(h)
                    if info is None:
                        self.num_unannounced += 1
                        return
                    self._announce(h, info, medium, locality)
            if self.publisher is not None:
                self.publisher.wake()  # an I/O thread's write: it goes out without waiting for a step

        return watch

    # -- bulk changes ------------------------------------------------------------------------
    def purge_owner(self, owner_id: str) -> int:
        """Every announced block of the tenant leaves every medium (a tenant purge); how many."""
        with self._lock:
            hashes = [h for h, info in self._blocks.items() if info.owner_id == owner_id and info.media]
            for h in hashes:
                for medium, locality in _MEDIA_BITS:
                    self._retract(h, medium, locality)
        return len(hashes)

    def purge_all(self) -> None:
        """Everything leaves every medium (a purge of every tenant): one AllBlocksCleared."""
        with self._lock:
            for info in self._blocks.values():
                info.media = 0
            self._blocks.clear()
            self._gone.clear()
            self._pending = [AllBlocksCleared()]

    def cleared_if_empty(self) -> None:
        """After a reset: when no medium holds anything, say so in one AllBlocksCleared (the
        per-block removals queued since the last batch are then redundant)."""
        with self._lock:
            if any(info.media for info in self._blocks.values()):
                return
            self._pending = [e for e in self._pending if isinstance(e, BlockStored)]
            self._pending.append(AllBlocksCleared())

    # -- batches -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Hand what is pending to the publisher as one batch (the end of an engine step)."""
        with self._lock:
            if not self._pending:
                return
            events, self._pending = self._pending, []
        if self.publisher is not None:
            self.publisher.publish(KVEventBatch(time.time(), events))

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The pending events, taken (the vLLM connector hands them to vLLM's publisher)."""
        with self._lock:
            events, self._pending = self._pending, []
        return events

    # -- internals (lock held) -----------------------------------------------------------------
    def _announce(self, h: int, info: _Block, medium: str, locality: str | None) -> None:
        bit = _MEDIA_BITS[(medium, locality)]
        if info.media & bit:
            return
        info.media |= bit
        last = self._pending[-1] if self._pending else None
        tokens = array("q")
        tokens.frombytes(info.tokens)
        if (
            isinstance(last, BlockStored)
            and last.medium == medium
            and last.locality == locality
            and info.parent == last.block_hashes[-1]
            and info.extra is None
            and info.lora_id == last.lora_id
            and info.lora_name == last.lora_name
        ):  # the next block of the same chain: one event, as vLLM sends a request's new blocks
            last.block_hashes.append(h)
            last.token_ids.extend(tokens)
            if last.extra_keys is not None:
                last.extra_keys.append(None)
            return
        self._pending.append(
            BlockStored(
                block_hashes=[h],
                parent_block_hash=info.parent,
                token_ids=tokens.tolist(),
                block_size=self.block_size,
                lora_id=info.lora_id,
                medium=medium,
                lora_name=info.lora_name,
                extra_keys=[info.extra] if info.extra is not None else None,
                locality=locality,
            )
        )

    def _retract(self, h: int, medium: str, locality: str | None) -> None:
        info = self._blocks.get(h)
        bit = _MEDIA_BITS[(medium, locality)]
        if info is None or not info.media & bit:
            return
        info.media &= ~bit
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved) and last.medium == medium and last.locality == locality:
            last.block_hashes.append(h)
        else:
            self._pending.append(BlockRemoved(block_hashes=[h], medium=medium, locality=locality))
        if not info.media:
            self._gone.append(h)
            while len(self._gone) > self.KEEP_GONE:
                old = self._gone.popleft()
                kept = self._blocks.get(old)
                if kept is not None and not kept.media:
                    del self._blocks[old]

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.shutdown()
