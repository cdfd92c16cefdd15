"""PrefixIndex: chained block keys -> cached blocks, a radix tree over blocks.

Each cached block is a node whose parent is the block before it (or a root key that stands for
model + salt). Lookups walk keys from the root; token-granular matching looks among the children
of the last matched node for the one sharing the most leading tokens. The index holds no
tensors and no reference counts: the pool tells it which blocks are referenced (`set_in_use`)
or not (`set_evictable`) and it picks victims among the unreferenced ones, leaves first.

A node is *held* while its block is in use or any child is held. Only unheld nodes are in the
policy (evictable), so every evictable node's whole subtree is evictable and leaves-first
eviction can always reach it: the pool may count every policy entry as free. An unreferenced
node with a held child is *pinned*: cached, hittable, but neither free nor evictable. That
happens when a request hangs its block under an equal block that another request computed
(two requests computed the same block; see KVCacheManager.cache_blocks) and that other copy is
then freed::

    index:   A (ref 0, pinned) -> B (ref 1, request R2)      A is R1's copy, R1 has finished
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.kvcache.keys import BlockKey
from kvtier.kvcache.policy import EvictionPolicy, make_policy

if TYPE_CHECKING:
    from kvtier.identity import Tenancy
    from kvtier.lora import LoRARequest


class IndexListener(Protocol):
    """What a PrefixIndex tells of its changes (a block cached under a key, a key removed)."""

    def stored(
        self,
        key: BlockKey,
        parent: BlockKey,
        tokens: Sequence[int] | None,
        is_first: bool,
        owner: Any = None,
        lora: Any = None,
    ) -> None: ...

    def removed(self, key: BlockKey) -> None: ...


@dataclass(slots=True)
class CachedBlock:
    key: BlockKey
    parent: BlockKey
    block_id: int
    tokens: tuple[int, ...] | None
    """The block's tokens (None when the index is driven by keys alone, e.g. a trace)."""
    is_first: bool
    """True when `parent` is a root key rather than another cached block."""
    num_children: int = 0
    hits: int = 0
    in_use: bool = True
    """The block is referenced (set by the pool through set_in_use / set_evictable)."""
    num_held_children: int = 0
    """Children that are in use or have a descendant in use; > 0 pins an unreferenced node."""
    owner: Tenancy | None = None
    """The tenancy of the request that computed the block (kvtier.identity; the tiers fence and
    record it by its owner id and encrypt it with its tenant's key)."""
    created: float = 0.0
    """time.monotonic() when it was cached (per-tenant TTLs)."""

    @property
    def held(self) -> bool:
        return self.in_use or self.num_held_children > 0


@dataclass(slots=True)
class PartialHit:
    node: CachedBlock
    num_tokens: int


@dataclass
class IndexStats:
    inserts: int = 0
    evictions: int = 0
    duplicate_inserts: int = 0


class PrefixIndex:
    """The logical prefix cache: which block keys are cached, in which device block, under
    which parent, and which unheld nodes the eviction policy may take (leaves first).

    Owns the `CachedBlock` nodes and the eviction policy; holds no reference counts and no
    tensors. Driven by its `BlockPool` (`set_in_use` / `set_evictable`, `evict_one`) and read by
    the KVCacheManager (`get`, `best_partial`) on the engine thread; not thread-safe.

    Invariants (`check_integrity`): every non-first node's parent is cached; child and held-child
    counts match the nodes; a node is in the policy exactly when it is not held; the first-token
    child map matches the nodes."""

    def __init__(self, policy: str | EvictionPolicy = "lru") -> None:
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy
        self._nodes: dict[BlockKey, CachedBlock] = {}
        # parent key -> first token -> child keys; lets partial matching skip unrelated children.
        self._children: dict[BlockKey, dict[int, list[BlockKey]]] = {}
        self.stats = IndexStats()
        self.listener: IndexListener | None = None
        """Told of every block cached and removed (kvtier.kv_events.KVEventRecorder); called on
        the index's own thread, after the change."""

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def get(self, key: BlockKey) -> CachedBlock | None:
        return self._nodes.get(key)

    def nodes(self) -> Iterable[CachedBlock]:
        return self._nodes.values()

    @property
    def num_evictable(self) -> int:
        """Unreferenced nodes that eviction can reach (pinned ones excluded)."""
        return len(self.policy)

    def is_evictable(self, key: BlockKey) -> bool:
        return key in self.policy

    def match_keys(self, keys: Sequence[BlockKey]) -> list[CachedBlock]:
        """Longest run of `keys` (from the first) that is cached."""
        out: list[CachedBlock] = []
        nodes = self._nodes
        for key in keys:
            node = nodes.get(key)
            if node is None:
                break
            out.append(node)
        return out

    def best_partial(self, parent: BlockKey, tokens: Sequence[int]) -> PartialHit | None:
        """The cached child of `parent` sharing the most leading tokens with `tokens` (>= 1)."""
        if not tokens:
            return None
        by_first = self._children.get(parent)
        if not by_first:
            return None
        best: PartialHit | None = None
        for key in by_first.get(tokens[0], ()):
            node = self._nodes[key]
            if node.tokens is None:
                continue
            n = _common_prefix_len(node.tokens, tokens)
            if best is None or n > best.num_tokens:
                best = PartialHit(node, n)
        return best

    def is_leaf(self, key: BlockKey) -> bool:
        return self._nodes[key].num_children == 0

    # ------------------------------------------------------------------ updates
    def insert(
        self,
        key: BlockKey,
        parent: BlockKey,
        block_id: int,
        tokens: Sequence[int] | None,
        is_first: bool,
        owner: Tenancy | None = None,
        lora: LoRARequest | None = None,
    ) -> CachedBlock | None:
        """Cache the in-use block `block_id` under `key`. Returns None if the key is already
        cached (the caller keeps its block uncached) or if the parent is not cached (it would
        be unreachable). `lora`: the adapter the block was computed with, only for the
        listener (the key holds the adapter already)."""
        if key in self._nodes:
            self.stats.duplicate_inserts += 1
            return None
        if not is_first:
            parent_node = self._nodes.get(parent)
            if parent_node is None:
                return None
            parent_node.num_children += 1
        node = CachedBlock(
            key,
            parent,
            block_id,
            tuple(tokens) if tokens is not None else None,
            is_first,
            owner=owner,
            created=time.monotonic(),
        )
        self._nodes[key] = node
        self._propagate_held(node, +1)
        first_tok = node.tokens[0] if node.tokens else None
        if first_tok is not None:
            self._children.setdefault(parent, {}).setdefault(first_tok, []).append(key)
        self.stats.inserts += 1
        if self.listener is not None:
            self.listener.stored(key, parent, node.tokens, is_first, owner, lora)
        return node

    def set_evictable(self, key: BlockKey) -> None:
        """The block lost its last reference."""
        node = self._nodes[key]
        assert node.in_use, f"block {node.block_id} is already unreferenced"
        node.in_use = False
        if node.num_held_children == 0:
            self.policy.add(key, node.hits)
            self._propagate_held(node, -1)

    def set_in_use(self, key: BlockKey) -> None:
        """The block got its first reference (a hit or a lock)."""
        node = self._nodes[key]
        assert not node.in_use, f"block {node.block_id} is already referenced"
        node.in_use = True
        if node.num_held_children == 0:
            self.policy.remove(key)
            self._propagate_held(node, +1)

    def _propagate_held(self, node: CachedBlock, delta: int) -> None:
        """`node` became held (+1) or unheld (-1): update its ancestors. O(1) unless an
        ancestor's own state changes, which a request holding its whole chain never causes."""
        nodes = self._nodes
        while not node.is_first:
            parent = nodes[node.parent]
            parent.num_held_children += delta
            if parent.in_use or parent.num_held_children != (1 if delta > 0 else 0):
                return  # the parent's held state did not change
            if delta > 0:
                self.policy.remove(parent.key)
            else:
                self.policy.add(parent.key, parent.hits)
            node = parent

    def record_hit(self, node: CachedBlock) -> None:
        node.hits += 1

    def evict_one(self) -> CachedBlock | None:
        """Remove the policy's preferred evictable leaf; returns it (its block is now free)."""
        key = self.policy.pop_victim(self.is_leaf)
        if key is None:
            return None
        return self._remove(key)

    def remove_evictable(self, key: BlockKey) -> CachedBlock | None:
        """Evict one named block if it is an unreferenced leaf (used by purges and TTLs)."""
        if key not in self.policy or not self.is_leaf(key):
            return None
        self.policy.remove(key)
        return self._remove(key)

    def _remove(self, key: BlockKey) -> CachedBlock:
        node = self._nodes.pop(key)
        assert not node.held and node.num_children == 0, f"evicting block {node.block_id}, not a free leaf"
        if not node.is_first:
            self._nodes[node.parent].num_children -= 1
        if node.tokens:
            by_first = self._children[node.parent]
            siblings = by_first[node.tokens[0]]
            siblings.remove(key)
            if not siblings:
                del by_first[node.tokens[0]]
                if not by_first:
                    del self._children[node.parent]
        self.stats.evictions += 1
        if self.listener is not None:
            self.listener.removed(key)
        return node

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Reachability, child counts, held counts, policy membership, the first-token map."""
        nodes = self._nodes
        children: dict[BlockKey, list[CachedBlock]] = {}
        for key, node in nodes.items():
            assert node.key == key, "node stored under a foreign key"
            if not node.is_first:
                assert node.parent in nodes, f"cached block {node.block_id} is unreachable: parent evicted"
                children.setdefault(node.parent, []).append(node)
        held: dict[BlockKey, bool] = {}

        def is_held(node: CachedBlock) -> bool:  # iterative post-order: chains can be long
            stack = [node]
            while stack:
                top = stack[-1]
                pending = [c for c in children.get(top.key, ()) if c.key not in held]
                if pending:
                    stack.extend(pending)
                    continue
                stack.pop()
                held[top.key] = top.in_use or any(held[c.key] for c in children.get(top.key, ()))
            return held[node.key]

        for key, node in nodes.items():
            kids = children.get(key, ())
            assert node.num_children == len(kids), f"child count of block {node.block_id} is wrong"
            num_held = sum(1 for c in kids if is_held(c))
            assert node.num_held_children == num_held, f"held-child count of block {node.block_id} is wrong"
            assert (key in self.policy) == (not is_held(node)), (
                f"block {node.block_id}: evictable is {key in self.policy}, held is {is_held(node)}"
            )
        assert len(self.policy) == sum(1 for k in nodes if not held[k]), "policy holds a block the index does not"
        by_parent: dict[BlockKey, dict[int, set[BlockKey]]] = {}
        for key, node in nodes.items():
            if node.tokens:
                by_parent.setdefault(node.parent, {}).setdefault(node.tokens[0], set()).add(key)
        mapped = {p: {t: set(ks) for t, ks in m.items()} for p, m in self._children.items()}
        assert mapped == by_parent, "first-token child map disagrees with the nodes"


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
