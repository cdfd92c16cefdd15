"""KVCacheManager: the facade the scheduler talks to.

It keeps, per request, the block table and the chained keys of its full blocks, and answers
`match` / `allocate` / `cache_blocks` / `fork` / `free` with plain values. Token-granular reuse:
when a prompt diverges inside a cached block, the matching leading tokens are copied into the
request's own new block (a `BlockCopy` the runner executes before the step's forward pass)::

    prompt:       [ A ........ ][ B ........ ][ C' ..|xx ]
    cached:       [ A ........ ][ B ........ ][ C  ..|.. ]
                   hit (shared)  hit (shared)  copy the first 4 tokens of C, compute the rest
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.kvcache.block_pool import BlockCopy, BlockLoad, BlockPool, BlockToStore
from kvtier.kvcache.keys import BlockKey, block_key
from kvtier.kvcache.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from kvtier.identity import Tenancy
    from kvtier.lora import LoRARequest


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixMatch:
    """Cached KV for the start of a token sequence (never its last token).

    Valid until the pool changes: pass it to `allocate_new` before allocating anything else
    (another admission may evict the blocks it names)."""

    block_ids: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)
    partial_src: int | None = None
    partial_tokens: int = 0
    partial_key: BlockKey | None = None
    """Key of `partial_src` (lets `allocate_new` detect a stale match)."""

    def num_cached_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size + self.partial_tokens


@dataclass(slots=True)
class _ReqBlocks:
    root: BlockKey
    block_ids: list[int]
    keys: list[BlockKey]
    """Chained keys of the request's leading full blocks that were computed (or hit)."""
    num_registered: int
    """Leading blocks known to be in the index (this request's block or an equal one)."""
    owner: Tenancy | None = None
    """The tenancy the blocks this request computes belong to (kvtier.identity)."""
    lora: LoRARequest | None = None
    """The adapter the blocks this request computes were computed with (for the KV events)."""


@dataclass
class PrefixCacheStats:
    queries_tokens: int = 0
    hits_tokens: int = 0
    partial_hit_tokens: int = 0
    queries_requests: int = 0
    hit_requests: int = 0


class KVCacheManager:
    """The scheduler's view of the device KV cache: per-request block tables over a `BlockPool`
    and a `PrefixIndex`, which it owns.

    Called by the Scheduler (and by the simulator and tests directly) on the one thread that
    owns the engine; it is not thread-safe and holds no tensors. Protocol per step: `match`
    then, right away, `allocate_new` (or `allocate_restore`) to admit; `allocate_more` to grow;
    `take_copies` and `take_loads` for the runner before the forward pass and `end_step` after
    it; `cache_blocks` once tokens are computed; `free` when a request ends or is preempted.
    With tiers below, `take_blocks_to_store` must be drained before the next forward pass.
    `allocate_new`, `allocate_more` and `fork` are all or nothing: False leaves no trace.

    Invariants (`check_integrity`): every block's reference count equals its live references
    (block tables plus locked copy sources); a request holds no block twice; each registered
    block is cached under the request's own chained key (or, for a forked shared block, under
    a key chained to the block before it); plus BlockPool's and PrefixIndex's invariants."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, eviction_policy: str = "lru"
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.index = PrefixIndex(eviction_policy)
        self.pool = BlockPool(num_blocks, self.index)
        self._reqs: dict[str, _ReqBlocks] = {}
        # Copies waiting to run, per destination request; their sources are locked (ref'd).
        self._pending: dict[str, list[BlockCopy]] = {}
        self._in_flight: list[BlockCopy] = []
        self.stats = PrefixCacheStats()
        # Tiers below the device (see set_store_policy): blocks whose KV must be read out.
        self.store_policy: str | None = None
        self.selective_min_hits = 2
        self._to_store: list[BlockToStore] = []
        self._restored_keys: set[BlockKey] = set()
        self._loads: dict[str, list[BlockLoad]] = {}

    # ------------------------------------------------------------------ properties
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, req_id: str) -> list[int]:
        return self._reqs[req_id].block_ids

    def has_request(self, req_id: str) -> bool:
        return req_id in self._reqs

    # ------------------------------------------------------------------ match
    def match(self, tokens: Sequence[int], root: BlockKey) -> PrefixMatch:
        """Longest cached prefix of tokens[:-1] (the last token is always computed)."""
        m = PrefixMatch()
        if not self.enable_prefix_caching or len(tokens) < 2:
            return m
        bs = self.block_size
        limit = len(tokens) - 1
        parent = root
        get = self.index.get
        for i in range(limit // bs):
            key = block_key(parent, tokens[i * bs : (i + 1) * bs])
            node = get(key)
            if node is None:
                break
            m.block_ids.append(node.block_id)
            m.keys.append(key)
            parent = key
        start = len(m.block_ids) * bs
        rest = tokens[start : min(limit, start + bs)]
        hit = self.index.best_partial(parent, rest)
        if hit is not None and hit.num_tokens > 0:
            m.partial_src = hit.node.block_id
            m.partial_tokens = hit.num_tokens
            m.partial_key = hit.node.key
        return m

    # ------------------------------------------------------------------ allocate
    def _admit_cost(self, match: PrefixMatch, num_tokens: int) -> int:
        """Free blocks that admitting `num_tokens` total (cached + new) tokens would consume."""
        num_new = cdiv(num_tokens, self.block_size) - len(match.block_ids)
        # Matched blocks that are now evictable stop counting as free once referenced. (Pinned
        # ones never counted; the match is a chain from the root, so referencing it pins no
        # block outside it.)
        evictable = self.index.is_evictable
        reclaimed = sum(1 for k in match.keys if evictable(k))
        if match.partial_src is not None:
            src_key = self.pool.blocks[match.partial_src].key
            reclaimed += src_key is not None and evictable(src_key)
        return num_new + reclaimed

    def _check_fresh(self, match: PrefixMatch) -> None:
        blocks = self.pool.blocks
        stale = len(match.block_ids) != len(match.keys) or any(
            blocks[b].key != k for b, k in zip(match.block_ids, match.keys)
        )
        if match.partial_src is not None:
            src_key = blocks[match.partial_src].key
            stale = stale or src_key is None or (match.partial_key is not None and src_key != match.partial_key)
        if stale:
            raise ValueError(
                "stale PrefixMatch: a block it names was evicted since match(); "
                "call match() again right before allocate_new()"
            )

    def allocate_new(
        self,
        req_id: str,
        tokens: Sequence[int],
        root: BlockKey,
        match: PrefixMatch,
        num_new_tokens: int,
        owner: Tenancy | None = None,
        lora: LoRARequest | None = None,
    ) -> bool:
        """Admit a request: reference its cached prefix, lock a partial-copy source and take
        blocks for `num_new_tokens` more tokens. All or nothing; False if the pool is short."""
        assert req_id not in self._reqs, f"request {req_id} already holds blocks"
        self._check_fresh(match)
        num_cached = match.num_cached_tokens(self.block_size)
        if self._admit_cost(match, num_cached + num_new_tokens) > self.pool.num_free_blocks:
            return False
        for b in match.block_ids:
            self.pool.ref(b)
        for b, key in zip(match.block_ids, match.keys):
            node = self.index.get(key)
            assert node is not None and node.block_id == b  # _check_fresh: the match is current
            self.index.record_hit(node)
            if self.store_policy == "selective" and node.hits == self.selective_min_hits:
                self._to_store.append(BlockToStore(b, node.key, node.owner))
        num_new = cdiv(num_cached + num_new_tokens, self.block_size) - len(match.block_ids)
        if match.partial_src is not None:
            self.pool.ref(match.partial_src)  # lock until the copy has run
        new = self.pool.allocate(num_new)
        state = _ReqBlocks(root, list(match.block_ids) + new, list(match.keys), len(match.keys), owner, lora)
        self._reqs[req_id] = state
        if match.partial_src is not None:
            self._pending.setdefault(req_id, []).append(BlockCopy(match.partial_src, new[0], match.partial_tokens))
        s = self.stats
        s.queries_requests += 1
        s.queries_tokens += len(tokens)
        s.hits_tokens += num_cached
        s.partial_hit_tokens += match.partial_tokens
        s.hit_requests += num_cached > 0
        return True

    def allocate_more(self, req_id: str, num_total_tokens: int) -> bool:
        """Grow a running request's block table to hold `num_total_tokens`. All or nothing."""
        state = self._reqs[req_id]
        need = cdiv(num_total_tokens, self.block_size) - len(state.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        state.block_ids.extend(self.pool.allocate(need))
        return True

    # ------------------------------------------------------------------ cache / fork / free
    def cache_blocks(self, req_id: str, tokens: Sequence[int], num_computed_tokens: int) -> None:
        """Register the request's blocks that became full and computed. A block whose key is
        already cached (another request computed the same block) stays uncached; if that other
        copy is evicted later, the next call registers this request's copy instead."""
        if not self.enable_prefix_caching:
            return
        state = self._reqs[req_id]
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(state.block_ids))
        keys = state.keys
        while len(keys) < num_full:
            i = len(keys)
            parent = keys[-1] if keys else state.root
            keys.append(block_key(parent, tokens[i * bs : (i + 1) * bs]))
        index = self.index
        start = min(state.num_registered, num_full)
        if start == num_full and (start == 0 or keys[start - 1] in index):
            return  # the common case: nothing new, and the chain is still cached
        # An equal block cached by someone else may have been evicted since (only leaves go, so
        # the missing keys are a suffix): register our own copies again.
        while start > 0 and keys[start - 1] not in index:
            start -= 1
        for i in range(start, num_full):
            key = keys[i]
            if key not in index:
                parent = keys[i - 1] if i else state.root
                if (
                    self.pool.cache_block(
                        state.block_ids[i],
                        key,
                        parent,
                        tokens[i * bs : (i + 1) * bs],
                        is_first=(i == 0),
                        owner=state.owner,
                        lora=state.lora,
                    )
                    and self.store_policy == "write_through"
                ):
                    if key in self._restored_keys:
                        self._restored_keys.discard(key)  # it came from a tier: already there
                    else:
                        self._to_store.append(BlockToStore(state.block_ids[i], key, state.owner))
        state.num_registered = len(keys)

    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int) -> bool:
        """Give `child_id` the parent's first `num_computed_tokens` tokens of KV: full blocks
        shared, the partial last block copied. False if no block is free for the copy."""
        assert child_id not in self._reqs, f"request {child_id} already holds blocks"
        p = self._reqs[parent_id]
        bs = self.block_size
        assert num_computed_tokens <= len(p.block_ids) * bs, f"{parent_id} holds fewer tokens than that"
        full, rem = divmod(num_computed_tokens, bs)
        if rem and self.pool.num_free_blocks < 1:
            return False
        shared = p.block_ids[:full]
        for b in shared:
            self.pool.ref(b)
        blocks = list(shared)
        if rem:
            src = p.block_ids[full]
            self.pool.ref(src)  # lock until the copy has run
            dst = self.pool.allocate(1)[0]
            blocks.append(dst)
            self._pending.setdefault(child_id, []).append(BlockCopy(src, dst, rem))
        self._reqs[child_id] = _ReqBlocks(
            p.root, blocks, list(p.keys[:full]), min(p.num_registered, full), p.owner, p.lora
        )
        return True

    def free(self, req_id: str) -> None:
        """Release everything the request holds: blocks, pending copies and their locks."""
        for copy in self._pending.pop(req_id, ()):
            self.pool.free_block(copy.src_block)
        self._loads.pop(req_id, None)
        state = self._reqs.pop(req_id, None)
        if state is not None:
            self.pool.free_blocks(state.block_ids)

    # ------------------------------------------------------------------ tiers below
    def set_store_policy(self, policy: str | None, selective_min_hits: int = 2) -> None:
        """Which blocks `take_blocks_to_store` reports: 'write_through' (each block once it is
        full and computed), 'write_back' (each block the device evicts), 'selective' (each
        block on its Nth hit), or None (no tiers)."""
        self.store_policy = policy
        self.selective_min_hits = selective_min_hits
        self.pool.eviction_log = [] if policy == "write_back" else None

    def take_blocks_to_store(self) -> list[BlockToStore]:
        """Blocks whose KV is intact now and must be read before the next forward pass, copy or
        load (an evicted block may already belong to someone else)."""
        log = self.pool.eviction_log
        if log:
            self._to_store.extend(log)
            log.clear()
        out, self._to_store = self._to_store, []
        return out

    def allocate_restore(
        self,
        req_id: str,
        tokens: Sequence[int],
        root: BlockKey,
        match: PrefixMatch,
        restore_keys: list[BlockKey],
        owner: Tenancy | None = None,
        lora: LoRARequest | None = None,
    ) -> bool:
        """Admit a request whose next `len(restore_keys)` blocks will be loaded from a tier:
        reference its device prefix (full blocks only) and take blocks for the restore."""
        full = PrefixMatch(list(match.block_ids), list(match.keys))
        return self.allocate_new(req_id, tokens, root, full, len(restore_keys) * self.block_size, owner, lora)

    def finish_restore(self, req_id: str, restore_keys: list[BlockKey], tensors: list[object]) -> int:
        """The load finished with `tensors` for the leading restore blocks (maybe fewer than
        asked). Queues them for the runner (`take_loads`); returns how many blocks loaded."""
        state = self._reqs[req_id]
        first = len(state.keys)
        loads = [BlockLoad(req_id, state.block_ids[first + i], kv) for i, kv in enumerate(tensors)]
        if loads:
            self._loads[req_id] = loads
            self._restored_keys.update(restore_keys[: len(tensors)])
        return len(loads)

    def take_loads(self) -> list[BlockLoad]:
        """Restored KV to write into the pool before this step's forward pass."""
        out: list[BlockLoad] = []
        for loads in self._loads.values():
            out.extend(loads)
        self._loads.clear()
        return out

    # ------------------------------------------------------------------ step protocol
    def take_copies(self) -> list[BlockCopy]:
        """Copies for the runner to execute before this step's forward pass."""
        out: list[BlockCopy] = []
        for copies in self._pending.values():
            out.extend(copies)
        self._pending.clear()
        self._in_flight.extend(out)
        return out

    def end_step(self) -> None:
        """The runner has executed the taken copies: unlock their sources."""
        for copy in self._in_flight:
            self.pool.free_block(copy.src_block)
        self._in_flight.clear()

    # ------------------------------------------------------------------ checks
    def live_references(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for state in self._reqs.values():
            for b in state.block_ids:
                refs[b] = refs.get(b, 0) + 1
        for copies in list(self._pending.values()) + [self._in_flight]:
            for c in copies:
                refs[c.src_block] = refs.get(c.src_block, 0) + 1
        return refs

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.live_references())
        for req_id, state in self._reqs.items():
            assert len(set(state.block_ids)) == len(state.block_ids), f"{req_id} holds a block twice"
            assert len(state.keys) <= len(state.block_ids), f"{req_id} has keys past its blocks"
            assert state.num_registered == len(state.keys), f"{req_id}: registered count is off"
            blocks = self.pool.blocks
            for i, b in enumerate(state.block_ids):
                key = blocks[b].key
                if key is None:
                    continue
                if i < len(state.keys):
                    assert state.keys[i] == key, f"{req_id}: block {b} is cached under a key that is not its own"
                else:  # a block shared by fork may be registered by the sharer that got further
                    node = self.index.get(key)
                    assert node is not None, f"{req_id}: block {b} has a key the index does not know"
                    prev = (
                        state.keys[i - 1]
                        if 0 < i <= len(state.keys)
                        else (blocks[state.block_ids[i - 1]].key if i else state.root)
                    )
                    assert prev is None or node.parent == prev, (
                        f"{req_id}: block {b} is cached under a key that is not its own"
                    )
