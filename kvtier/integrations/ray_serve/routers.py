"""Ray Serve request routers for kvtier engine replicas (they run in the process that holds the
DeploymentHandle: the ingress replica).

`KVEventRouter` places a request on the replica that holds the longest stored prefix of its
prompt, as the replicas' own KV events say (kvtier.kv_events: vLLM's wire format). Each replica
publishes its events on a ZMQ port of its node and reports `kv_events_endpoint`,
`kv_events_replay_endpoint`, `block_size` and `fingerprint` through Ray Serve's routing stats
(`record_routing_stats`); the router subscribes to each replica it sees (first a replay of the
replica's buffered batches from sequence 0, then the live stream) and keeps, per replica, the
block hashes that replica holds on its device pool, host memory or local disk. Blocks in the
shared Redis tier (locality REMOTE) are left out: every replica restores them alike, so they
say nothing about where to go.

A request's block hashes are computed the way the replica computes its block keys: the prompt's
token ids by kvtier's own tokenization (`request.routing_token_ids`), chained from
`root_key(fingerprint, salt)` by `kvtier.kvcache.keys.chain_keys`, each key's last 8 bytes
(`kvtier.kv_events.block_hash`), with the effective salt the ingress resolved
(`ForwardedRequest.cache_salt`).

Choice, per request: the replicas with the longest match (at least one block) rank first, the
rest after, unless the replicas' queue lengths differ by more than `imbalanced_threshold`
(as Ray's PrefixCacheAffinityRouter: the queue lengths Ray's router caches or probes), or no
replica holds a block of the prompt: then Ray's power-of-two choices. A replica that dies or
leaves the deployment leaves the router's view with its blocks.

Every router here also honours `ForwardedRequest.replica` (an admin call the ingress fans out to
each replica): such a request goes to that replica only. `PinnablePrefixRouter` is Ray's
PrefixCacheAffinityRouter unchanged but for that, `PinnablePow2Router` Ray's default router.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import msgspec
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from kvtier.integrations.ray_serve.request import (
    ForwardedRequest,
    loaded_routing_tokenizer,
    prompt_of,
    routing_token_ids,
    routing_tokenizer,
)
from kvtier.kv_events import END_SEQ, REMOTE, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, block_hash
from kvtier.kvcache.keys import chain_keys, root_key

logger = logging.getLogger("kvtier.ray_serve.router")


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    if pending_request is None:
        return None
    for arg in pending_request.args or ():
        if isinstance(arg, ForwardedRequest):
            return arg
    return None


def _pinned(router: RequestRouter, candidates: list[RunningReplica], req: ForwardedRequest | None) -> Any:
    """None when `req` is not pinned; else the ranks that send it to its replica only (empty while
    that replica cannot take it: Ray retries with backoff, the ingress bounds the wait)."""
    if req is None or req.replica is None:
        return None
    return [[r for r in candidates if r.replica_id.to_full_id_str() == req.replica]]


class PinnablePow2Router(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default power-of-two-choices router, plus pinned admin calls. A replica chosen
    for a request goes to that request (RequestRouter's matching), not to the oldest waiting one
    (FIFOMixin's), so that a pinned call never lands elsewhere."""

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        RequestRouter._fulfill_next_pending_request(self, replica, request_metadata)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        pinned = _pinned(self, candidate_replicas, _forwarded(pending_request))
        if pinned is not None:
            return pinned
        return await super().choose_replicas(candidate_replicas, pending_request)


class PinnablePrefixRouter(PrefixCacheAffinityRouter):
    """Ray's PrefixCacheAffinityRouter (ray.serve.llm's, imported from its module so that vLLM need
    not be installed), plus pinned admin calls; admin calls carry no prompt."""

    async def choose_replicas(  # type: ignore[override]  # Ray's annotation says one rank; it returns ranks
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        req = _forwarded(pending_request)
        pinned = _pinned(self, candidate_replicas, req)
        if pinned is not None:
            return pinned
        if not self._has_text(pending_request):  # admin calls, token-id prompts: no text to match
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self,  # type: ignore[arg-type]  # as Ray's own prefix router calls it
                candidate_replicas,
                pending_request,
            )
        return await super().choose_replicas(candidate_replicas, pending_request)  # type: ignore[return-value]

    def _has_text(self, pending_request: PendingRequest | None) -> bool:
        req = _forwarded(pending_request)
        if pending_request is None or prompt_of(req) is None:
            return False
        return bool(self._extract_text_from_request(pending_request))

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if self._has_text(pending_request):
            super().on_request_routed(pending_request, replica_id, result)


class _ReplicaBlocks:
    """One replica's KV events, followed on a thread: the block hashes it holds locally."""

    def __init__(self, name: str, endpoint: str, replay_endpoint: str | None) -> None:
        import zmq

        self.name, self.endpoint, self.replay_endpoint = name, endpoint, replay_endpoint
        self.lock = threading.Lock()
        self.media: dict[int, set[str]] = {}
        """block hash -> the local media that hold it (GPU, CPU, STORAGE)."""
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # closing (or collecting) it never blocks on a socket
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{name}", daemon=True)
        self._thread.start()

    def holds(self, hashes: list[int]) -> int:
        """How many of `hashes`, from the first on, this replica holds."""
        n = 0
        with self.lock:
            for h in hashes:
                if h not in self.media:
                    break
                n += 1
        return n

    def close(self) -> None:
        self._stop.set()

    def _apply(self, payload: bytes) -> None:
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError:
            logger.warning("KV events from %s: an undecodable batch ignored", self.endpoint)
            return
        with self.lock:
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    if ev.locality == REMOTE:
                        continue
                    for h in ev.block_hashes:
                        self.media.setdefault(h, set()).add(ev.medium or "")
                elif isinstance(ev, BlockRemoved):
                    if ev.locality == REMOTE:
                        continue
                    for h in ev.block_hashes:
                        held = self.media.get(h)
                        if held is not None:
                            held.discard(ev.medium or "")
                            if not held:
                                del self.media[h]
                elif isinstance(ev, AllBlocksCleared):
                    self.media.clear()

    def _replay(self, start: int) -> int:
        """Apply the replica's buffered batches from `start`; the next sequence number expected."""
        import zmq

        if self.replay_endpoint is None:
            return start
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while not self._stop.is_set():
                if not dealer.poll(1000):
                    continue
                frames = dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _, seq, payload = frames
                if seq == END_SEQ:
                    break
                self._apply(payload)
                start = int.from_bytes(seq, "big") + 1
        finally:
            dealer.close()
        return start

    def _run(self) -> None:
        import zmq

        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        try:
            sub.connect(self.endpoint)
            expected = self._replay(0)
            while not self._stop.is_set():
                if not sub.poll(500):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq < expected:
                    continue  # had it from the replay
                if seq > expected:
                    expected = self._replay(expected)  # missed some: catch up
                    if seq < expected:
                        continue
                self._apply(frames[2])
                expected = seq + 1
        except Exception:
            logger.exception("KV events from %s: the subscriber stopped", self.endpoint)
        finally:
            sub.close()
            self._ctx.term()


class KVEventRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Longest stored prefix from the replicas' KV events, with a queue-imbalance guard and
    power-of-two choices as the fallback (see the module docstring)."""

    def initialize_state(
        self, model: str | None = None, chat_template: str | None = None, imbalanced_threshold: float = 8, **_: Any
    ) -> None:
        """`model`: the checkpoint the replicas serve (its tokenizer: `routing_tokenizer`);
        `chat_template`: the replicas' --chat-template; `imbalanced_threshold`: a queue-length
        difference beyond which load wins over cache affinity."""
        self._model = model
        self._chat_template = chat_template
        self._imbalanced_threshold = float(imbalanced_threshold)
        self._blocks: dict[ReplicaID, _ReplicaBlocks] = {}
        self._hashes: dict[str, list[int]] = {}
        self._tokenizer = loaded_routing_tokenizer(model, chat_template)
        if self._tokenizer is None:
            # not loaded by the ingress: it loads on a thread, and until it is there requests go
            # by load alone; the event loop that routes every request of this process never waits
            threading.Thread(target=self._load_tokenizer, name="kv-router-tokenizer", daemon=True).start()

    def _load_tokenizer(self) -> None:
        self._tokenizer = routing_tokenizer(self._model, self._chat_template)

    # -- what the router knows of each replica
    def _follow(self, replicas: Iterable[RunningReplica]) -> None:
        for r in replicas:
            stats = r.routing_stats or {}
            endpoint = stats.get("kv_events_endpoint")
            known = self._blocks.get(r.replica_id)
            if endpoint is None or (known is not None and known.endpoint == endpoint):
                continue
            if known is not None:
                known.close()
            self._blocks[r.replica_id] = _ReplicaBlocks(
                r.replica_id.unique_id, endpoint, stats.get("kv_events_replay_endpoint")
            )

    def _forget(self, replica_id: ReplicaID) -> None:
        blocks = self._blocks.pop(replica_id, None)
        if blocks is not None:
            blocks.close()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for gone in set(self._blocks) - {r.replica_id for r in replicas}:
            self._forget(gone)
        self._follow(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    # -- the request's block hashes
    def _request_hashes(self, pending_request: PendingRequest, req: ForwardedRequest, stats: dict) -> list[int]:
        key = pending_request.metadata.internal_request_id
        hashes = self._hashes.get(key)
        if hashes is not None:
            return hashes
        hashes = []
        ids = routing_token_ids(self._tokenizer, req)
        if ids:
            bs = int(stats["block_size"])
            root = root_key(bytes.fromhex(stats["fingerprint"]), req.cache_salt)
            hashes = [block_hash(k) for k in chain_keys(root, ids, bs, num_blocks=len(ids) // bs)]
        if len(self._hashes) > 10_000:  # requests cancelled before they were routed
            self._hashes.clear()
        self._hashes[key] = hashes
        return hashes

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        req = _forwarded(pending_request)
        pinned = _pinned(self, candidate_replicas, req)
        if pinned is not None:
            return pinned
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self,  # type: ignore[arg-type]  # as Ray's own prefix router calls it
            candidate_replicas,
            pending_request,
        )
        if req is None or pending_request is None or prompt_of(req) is None:
            return fallback
        self._follow(candidate_replicas)
        stats = next((r.routing_stats for r in candidate_replicas if (r.routing_stats or {}).get("fingerprint")), None)
        if stats is None:
            return fallback
        hashes = self._request_hashes(pending_request, req, stats)
        if not hashes:
            return fallback
        matched = {}
        for r in candidate_replicas:
            blocks = self._blocks.get(r.replica_id)
            matched[r.replica_id] = blocks.holds(hashes) if blocks is not None else 0
        best = max(matched.values(), default=0)
        if best == 0 or await self._imbalanced(candidate_replicas):
            return fallback
        first = [r for r in candidate_replicas if matched[r.replica_id] == best]
        rest = [r for r in candidate_replicas if matched[r.replica_id] != best]
        return [first, rest] if rest else [first]

    async def _imbalanced(self, replicas: list[RunningReplica]) -> bool:
        """Whether the replicas' queue lengths differ by more than the threshold (as Ray's prefix
        router: cached lengths where fresh, probed otherwise)."""
        if self._imbalanced_threshold == float("inf") or len(replicas) < 2:
            return False
        lengths: list[int] = []
        probe = []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if q is None:
                probe.append(r)
            else:
                lengths.append(q)
        if probe:
            lengths += [q for _, q in await self._probe_queue_lens(probe, 0) if q is not None]
        return bool(lengths) and max(lengths) - min(lengths) > self._imbalanced_threshold

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if pending_request is not None:
            self._hashes.pop(pending_request.metadata.internal_request_id, None)
