"""BlockPool: device block ids and their reference counts.

Every block is in exactly one of these states:

    free       ref_cnt == 0, no key        in `_free` (a heap: lowest id first, O(log n))
    in use     ref_cnt  > 0                owned by one or more requests
    cached     ref_cnt == 0, has a key     evictable; still hittable until the index evicts it
    pinned     ref_cnt == 0, has a key     a cached ancestor of an in-use cached block: hittable,
                                           not evictable, counted as used (rare; prefix_index.py)

Allocation takes free blocks first and only then asks the index to evict a cached one, so a
cached prefix survives as long as empty blocks remain. Free blocks are handed out lowest id
first, so that a request's blocks lie in ascending, mostly adjacent order in the pool even after
evictions and resets have returned blocks in any order: the decode kernel streams adjacent
blocks at memory speed and pays a prefetch on every jump (benchmarks/block_layout.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.kvcache.keys import BlockKey
from kvtier.kvcache.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from kvtier.identity import Tenancy
    from kvtier.lora import LoRARequest


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    key: BlockKey | None = None
    """Set while the block is registered in the prefix index."""


class BlockPool:
    """Physical device blocks: which are free, referenced, cached or pinned (the module
    docstring's four states) and how many references each has.

    Owns the `Block` records and the free queue; the `PrefixIndex` it is given owns the cached
    blocks' keys and picks eviction victims. Only the KVCacheManager (and the simulator and
    tests, which drive it directly) calls it, on the one thread that owns the cache manager
    (the engine thread); it is not thread-safe. Blocks are ids only: no tensors live here.

    Invariants (`check_integrity`): every block is in exactly one state; a free block has no
    reference and no key; a keyed block is the index node of that key and is evictable exactly
    when it is unreferenced and not pinned; free + used == num_blocks. A block's reference
    count equals the live references the manager records (block tables and locked copy
    sources)."""

    def __init__(self, num_blocks: int, index: PrefixIndex | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks))  # a heap; sorted is a valid heap
        self.index = index
        self.num_evicted_blocks = 0
        self.eviction_log: list[BlockToStore] | None = None
        """When a list, every eviction appends the evicted block: write-back saves its KV first."""

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take: empty ones plus evictable cached ones."""
        return len(self._free) + (self.index.num_evictable if self.index is not None else 0)

    @property
    def num_used_blocks(self) -> int:
        """Referenced blocks plus pinned cached ones."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    # ------------------------------------------------------------------ allocate / free
    def allocate(self, num: int) -> list[int]:
        """Take `num` blocks (ref_cnt 1 each). All or nothing."""
        if num > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {num} blocks, {self.num_free_blocks} free")
        out: list[int] = []
        for _ in range(num):
            if self._free:
                block = self.blocks[heapq.heappop(self._free)]
            else:
                node = self.index.evict_one() if self.index is not None else None
                if node is None:  # cannot happen: every evictable subtree has an evictable leaf
                    for bid in out:
                        self.free_block(bid)
                    raise NoFreeBlocksError("no evictable leaf block")
                block = self.blocks[node.block_id]
                if self.eviction_log is not None:
                    self.eviction_log.append(BlockToStore(block.block_id, node.key, node.owner))
                block.key = None
                self.num_evicted_blocks += 1
            block.ref_cnt = 1
            out.append(block.block_id)
        return out

    def ref(self, block_id: int) -> None:
        """Take one more reference (a prefix hit or a fork)."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            if block.key is None:
                raise ValueError(f"block {block_id} is free; allocate it instead")
            assert self.index is not None  # only the index sets a block's key
            self.index.set_in_use(block.key)
        block.ref_cnt += 1

    def free_block(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes cached (if keyed) or free."""
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise ValueError(f"block {block_id} freed more often than referenced")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.key is not None:
                assert self.index is not None  # only the index sets a block's key
                self.index.set_evictable(block.key)
            else:
                heapq.heappush(self._free, block_id)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Free a request's blocks last-first, so that its tail is evicted before its head."""
        for block_id in reversed(block_ids):
            self.free_block(block_id)

    # ------------------------------------------------------------------ caching
    def cache_block(
        self,
        block_id: int,
        key: BlockKey,
        parent: BlockKey,
        tokens: Sequence[int] | None,
        is_first: bool,
        owner: Tenancy | None = None,
        lora: LoRARequest | None = None,
    ) -> bool:
        """Register an in-use, full block under `key`. False if the key was cached already
        (the block then stays an ordinary uncached block) or the parent is gone."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0 and block.key is None, "only in-use, uncached blocks can be cached"
        if self.index is None or self.index.insert(key, parent, block_id, tokens, is_first, owner, lora) is None:
            return False
        block.key = key
        return True

    def evict_cached(self, key: BlockKey) -> bool:
        """Drop one unreferenced cached leaf now (purges); False if referenced or not a leaf."""
        node = self.index.remove_evictable(key) if self.index is not None else None
        if node is None:
            return False
        block = self.blocks[node.block_id]
        block.key = None
        heapq.heappush(self._free, block.block_id)
        return True

    def evict_all(self) -> int:
        """Evict every unreferenced cached block (leaves first); returns how many."""
        n = 0
        while self.index is not None:
            node = self.index.evict_one()
            if node is None:
                break
            block = self.blocks[node.block_id]
            if self.eviction_log is not None:
                self.eviction_log.append(BlockToStore(block.block_id, node.key, node.owner))
            block.key = None
            heapq.heappush(self._free, block.block_id)
            self.num_evicted_blocks += 1
            n += 1
        return n

    # ------------------------------------------------------------------ checks
    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Every block in exactly one state; counts add up; refs match `expected_refs`."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice in the free queue"
        index = self.index
        num_cached_free = 0
        num_pinned = 0
        for block in self.blocks:
            in_free = block.block_id in free
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            node = index.get(block.key) if index is not None and block.key is not None else None
            if block.key is not None:
                assert node is not None and node.block_id == block.block_id, (
                    f"block {block.block_id} and the index disagree"
                )
                assert node.in_use == (block.ref_cnt > 0), f"index thinks block {block.block_id} in_use={node.in_use}"
            if in_free:
                assert block.ref_cnt == 0 and block.key is None, f"free block {block.block_id} is in use or cached"
            elif block.ref_cnt == 0:
                assert index is not None and node is not None, (
                    f"block {block.block_id} is lost: unreferenced, uncached, not free"
                )
                if index.is_evictable(node.key):
                    num_cached_free += 1
                else:
                    assert node.num_held_children > 0, f"cached block {block.block_id} is not evictable"
                    num_pinned += 1
            elif index is not None and node is not None:
                assert not index.is_evictable(node.key), f"in-use block {block.block_id} is evictable"
            if expected_refs is not None:
                want = expected_refs.get(block.block_id, 0)
                assert block.ref_cnt == want, f"block {block.block_id}: ref_cnt {block.ref_cnt}, live references {want}"
        if index is not None:
            assert num_cached_free == index.num_evictable, "evictable count mismatch"
            for cached in index.nodes():
                assert self.blocks[cached.block_id].key == cached.key, f"index names block {cached.block_id} wrongly"
            index.check_integrity()
        used = sum(1 for b in self.blocks if b.ref_cnt > 0) + num_pinned
        assert used == self.num_used_blocks, "used blocks miscounted"
        assert used + self.num_free_blocks == self.num_blocks, "free + used != total"


@dataclass(slots=True)
class BlockCopy:
    """Copy the first `num_tokens` slots of block `src_block` into `dst_block` (every layer, K
    and V) before a step's forward pass: token-granular prefix reuse and forks. The cache
    manager makes them; the runner executes them (SchedulerOutput.block_copies)."""

    src_block: int
    dst_block: int
    num_tokens: int


@dataclass(slots=True)
class BlockToStore:
    """A device block whose KV a tier below must store (KVCacheManager.take_blocks_to_store):
    one just computed (write-through), one hit often enough (selective) or one the pool evicted
    (write-back, `BlockPool.eviction_log`). The KV in `block_id` is intact until the next
    forward pass, copy or load, which may reuse the block: read it before then."""

    block_id: int
    key: BlockKey
    owner: Tenancy | None
    """The tenancy the block belongs to (kvtier.identity; tiers encrypt with its tenant's key)."""


@dataclass(slots=True)
class BlockLoad:
    """KV restored from a tier below for one block of request `req_id`: the runner writes `kv`
    into device block `block_id` before the step's forward pass (SchedulerOutput.block_loads)."""

    req_id: str
    block_id: int
    kv: Any
    """The block's KV as the tier returned it (the runner's block layout)."""
