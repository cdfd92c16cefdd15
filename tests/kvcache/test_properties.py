"""Stateful property tests: the pool, the index and the manager against simple models.

Tokens come from a three-letter alphabet and pools are tiny, so prefixes are shared, prompts
diverge inside blocks and almost every allocation evicts something.

The manager model keeps a *shadow KV*: for every block id, what each slot holds, written as
(root key, all tokens up to and including that position). A cached or matched block must hold
exactly the KV its key names, whatever copies, forks and evictions happened before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.kvcache import (
    BlockPool,
    KVCacheManager,
    NoFreeBlocksError,
    PrefixIndex,
    chain_keys,
    hash_id_key,
    root_key,
)
from kvtier.sched.output import BlockCopy

ROOTS = [root_key(b"model-a"), root_key(b"model-a", "salt")]
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=12)
# A prompt is often an earlier one cut anywhere and continued: shared prefixes, mid-block
# divergence, and identical prompts admitted in the same step (duplicate blocks).
BASE = st.integers(-1, 99)
KEEP = st.sampled_from([0.0, 0.3, 0.5, 0.8, 1.0, 1.0])
SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pick(items: list, i: int):
    return items[i % len(items)]


def prompt(history: list[list[int]], base: int, keep: float, tokens: list[int]) -> list[int]:
    if base < 0 or not history:
        out = tokens
    else:
        old = pick(history, base)
        out = old[: round(keep * len(old))] + tokens[: 2 if keep == 1.0 else len(tokens)]
        out = out if keep < 1.0 or base % 3 else old  # the same prompt again
    history.append(out)
    return out


# ============================================================================ pool + index
@dataclass
class PoolReq:
    root: bytes
    tokens: list[int]
    by_ids: bool
    """Keys from hash ids and nodes without tokens (trace replay) instead of token keys."""
    block_ids: list[int] = field(default_factory=list)


class PoolIndexMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), bs=st.integers(2, 4), policy=st.sampled_from(["lru", "lfu"]))
    def setup(self, num_blocks: int, bs: int, policy: str) -> None:
        self.bs = bs
        self.pool = BlockPool(num_blocks, PrefixIndex(policy))
        self.reqs: dict[int, PoolReq] = {}
        self.next_id = 0
        self.ever_cached: dict[bytes, tuple[bytes, tuple[int, ...] | None]] = {}  # key -> (parent, tokens)
        self.history: list[list[int]] = []

    # ------------------------------------------------------------------ helpers
    def keys_of(self, req: PoolReq, num_blocks: int) -> list[bytes]:
        if not req.by_ids:
            return chain_keys(req.root, req.tokens, self.bs, num_blocks=num_blocks)
        keys, parent = [], req.root
        for i in range(min(num_blocks, len(req.tokens) // self.bs)):
            hid = int("".join(map(str, req.tokens[i * self.bs : (i + 1) * self.bs])), 3)
            parent = hash_id_key(parent, hid)
            keys.append(parent)
        return keys

    def allocate_one_by_one(self, num: int) -> list[int]:
        """Allocate, checking that each eviction took an evictable leaf and only when no
        empty block was left."""
        index = self.pool.index
        out = []
        for _ in range(num):
            num_empty = self.pool.num_free_blocks - index.num_evictable
            before = {n.key: (n.num_children, index.is_evictable(n.key)) for n in index.nodes()}
            [b] = self.pool.allocate(1)
            gone = set(before) - {n.key for n in index.nodes()}
            if num_empty > 0:
                assert not gone, "evicted a cached block while empty ones were left"
            else:
                assert len(gone) == 1
                [victim] = gone
                assert before[victim] == (0, True), "evicted a block that was not an evictable leaf"
            out.append(b)
        return out

    def register(self, req: PoolReq, start: int, end: int) -> None:
        """The request computed its full blocks start..end-1: cache them."""
        keys = self.keys_of(req, end)
        index = self.pool.index
        for i in range(start, end):
            parent = keys[i - 1] if i else req.root
            tokens = None if req.by_ids else req.tokens[i * self.bs : (i + 1) * self.bs]
            expect = keys[i] not in index and (i == 0 or parent in index)
            assert self.pool.cache_block(req.block_ids[i], keys[i], parent, tokens, i == 0) == expect
            if expect:
                self.ever_cached[keys[i]] = (parent, None if tokens is None else tuple(tokens))

    # ------------------------------------------------------------------ rules
    @rule(base=BASE, keep=KEEP, tokens=TOKENS, root=st.sampled_from(ROOTS), by_ids=st.booleans())
    def admit(self, base: int, keep: float, tokens: list[int], root: bytes, by_ids: bool) -> None:
        tokens = prompt(self.history, base, keep, tokens)
        req = PoolReq(root, tokens, by_ids)
        num_blocks = cdiv(len(tokens), self.bs)
        keys = self.keys_of(req, num_blocks)
        hits = self.pool.index.match_keys(keys[: (len(tokens) - 1) // self.bs])
        for node in hits:
            assert node.key in self.ever_cached
            if not by_ids:
                assert node.tokens == tuple(tokens[len(req.block_ids) * self.bs :][: self.bs])
            self.pool.ref(node.block_id)
            self.pool.index.record_hit(node)
            req.block_ids.append(node.block_id)
        need = num_blocks - len(hits)
        if need > self.pool.num_free_blocks:
            try:
                self.pool.allocate(need)
                raise AssertionError("allocate did not refuse")
            except NoFreeBlocksError:
                pass
            self.pool.free_blocks(req.block_ids)
            if self.reqs:
                self.free(0)  # preempt
            return
        req.block_ids += self.allocate_one_by_one(need)
        self.reqs[self.next_id] = req
        self.next_id += 1
        self.register(req, len(hits), len(tokens) // self.bs)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99), extra=TOKENS)
    def grow(self, i: int, extra: list[int]) -> None:
        rid = pick(sorted(self.reqs), i)
        req = self.reqs[rid]
        old_full = len(req.tokens) // self.bs
        need = cdiv(len(req.tokens) + len(extra), self.bs) - len(req.block_ids)
        if need > self.pool.num_free_blocks:
            self.free(i + 1)  # preempt
            return
        req.block_ids += self.allocate_one_by_one(need)
        req.tokens = req.tokens + extra
        self.register(req, old_full, len(req.tokens) // self.bs)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        rid = pick(sorted(self.reqs), i)
        self.pool.free_blocks(self.reqs.pop(rid).block_ids)

    @precondition(lambda self: len(self.pool.index) > 0)
    @rule(i=st.integers(0, 999))
    def purge(self, i: int) -> None:
        index = self.pool.index
        key = pick(sorted(n.key for n in index.nodes()), i)
        expect = index.is_evictable(key) and index.is_leaf(key)
        assert self.pool.evict_cached(key) == expect
        assert (key in index) != expect

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        live: dict[int, int] = {}
        for req in self.reqs.values():
            assert len(req.block_ids) == cdiv(len(req.tokens), self.bs)
            for b in req.block_ids:
                live[b] = live.get(b, 0) + 1
        self.pool.check_integrity(live)
        assert sum(1 for b in self.pool.blocks if b.ref_cnt > 0) == len(live)
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_blocks
        index = self.pool.index
        for node in index.nodes():
            assert (node.parent, node.tokens) == self.ever_cached[node.key]
            assert node.is_first or node.parent in index, "a cached block is unreachable"
        # Every block a live request holds and that is cached is cached under its own key.
        for req in self.reqs.values():
            keys = self.keys_of(req, len(req.block_ids))
            for i, b in enumerate(req.block_ids):
                key = self.pool.blocks[b].key
                assert key is None or key == keys[i]


TestPoolIndex = PoolIndexMachine.TestCase
TestPoolIndex.settings = SETTINGS


# ============================================================================ manager
Slot = tuple[bytes, tuple[int, ...]]


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def kv(root: bytes, tokens: list[int], pos: int) -> Slot:
    """What the KV of `tokens[pos]` depends on: the model/salt and every token up to it."""
    return root, tuple(tokens[: pos + 1])


@dataclass
class Req:
    root: bytes
    tokens: list[int]
    num_computed: int
    """Tokens whose KV is (or, once this request's pending copy has run, will be) in its blocks."""
    block_ids: list[int]
    copy_pending: bool = False


class ManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), bs=st.integers(2, 4), policy=st.sampled_from(["lru", "lfu"]))
    def setup(self, num_blocks: int, bs: int, policy: str) -> None:
        self.bs = bs
        self.m = KVCacheManager(num_blocks, bs, eviction_policy=policy)
        self.reqs: dict[str, Req] = {}
        self.pending: dict[str, list[tuple[BlockCopy, list[Slot]]]] = {}  # per destination request
        self.in_flight: list[BlockCopy] = []
        self.shadow: dict[int, list[Slot | None]] = {b: [None] * bs for b in range(num_blocks)}
        self.known: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}  # key -> (root, tokens through it)
        self.next_id = 0
        self.history: list[list[int]] = []

    # ------------------------------------------------------------------ helpers
    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def snapshot(self) -> tuple:
        m = self.m
        return (
            [(b.ref_cnt, b.key) for b in m.pool.blocks],
            m.num_free_blocks,
            m.live_references(),
            sorted(n.key for n in m.index.nodes()),
            {r: list(m.block_ids(r)) for r in self.reqs},
        )

    def compute(self, rid: str) -> None:
        """Run the request's uncomputed tokens through the 'model' and cache its full blocks."""
        req, bs = self.reqs[rid], self.bs
        assert not req.copy_pending
        others = {b for r, o in self.reqs.items() if r != rid for b in o.block_ids}
        for pos in range(req.num_computed, len(req.tokens)):
            b = req.block_ids[pos // bs]
            assert b not in others, f"{rid} writes into block {b}, shared with another request"
            assert self.m.pool.blocks[b].key is None, f"{rid} writes into cached block {b}"
            self.shadow[b][pos % bs] = kv(req.root, req.tokens, pos)
        req.num_computed = len(req.tokens)
        self.m.cache_blocks(rid, req.tokens, req.num_computed)
        keys = chain_keys(req.root, req.tokens, bs)
        for j, key in enumerate(keys):
            self.known[key] = (req.root, tuple(req.tokens[: (j + 1) * bs]))
        # Right after cache_blocks, every full block of the request is cached (by it or an equal copy).
        assert len(self.m.index.match_keys(keys)) == len(keys)

    def check_match(self, tokens: list[int], root: bytes):
        m, bs = self.m, self.bs
        match = m.match(tokens, root)
        n = match.num_cached_tokens(bs)
        assert n < max(len(tokens), 1), "the last prompt token must be computed"
        keys = chain_keys(root, tokens, bs)
        assert match.keys == keys[: len(match.block_ids)]
        # Longest: every cached full block within tokens[:-1] is matched.
        assert len(match.block_ids) == min(len(m.index.match_keys(keys)), max(len(tokens) - 1, 0) // bs)
        for j, b in enumerate(match.block_ids):
            node = m.index.get(m.pool.blocks[b].key)
            assert node.tokens == tuple(tokens[j * bs : (j + 1) * bs])
            assert self.shadow[b] == [kv(root, tokens, j * bs + s) for s in range(bs)]
        # Longest partial: no cached child of the last matched block shares more tokens.
        start = len(match.block_ids) * bs
        parent = keys[len(match.block_ids) - 1] if match.block_ids else root
        rest = tokens[start : min(len(tokens) - 1, start + bs)]
        best = max((common(n.tokens, rest) for n in m.index.nodes() if n.parent == parent and n.tokens), default=0)
        assert match.partial_tokens == best
        if match.partial_src is not None:
            start, src = len(match.block_ids) * bs, match.partial_src
            assert 0 < match.partial_tokens < bs
            node = m.index.get(m.pool.blocks[src].key)
            assert node.tokens[: match.partial_tokens] == tuple(tokens[start:n])
            assert node.parent == (keys[len(match.block_ids) - 1] if match.block_ids else root)
            assert self.shadow[src][: match.partial_tokens] == [kv(root, tokens, p) for p in range(start, n)]
        return match

    # ------------------------------------------------------------------ rules
    @rule(base=BASE, keep=KEEP, tokens=TOKENS, root=st.sampled_from(ROOTS), copies=st.integers(1, 2))
    def admit(self, base: int, keep: float, tokens: list[int], root: bytes, copies: int) -> None:
        """Admit a prompt (twice in one step: both compute the same blocks); preempt the oldest
        request when the pool is short."""
        tokens = prompt(self.history, base, keep, tokens)
        for _ in range(copies):
            if not self.admit_one(tokens, root) and self.reqs:
                self.free(0)

    def admit_one(self, tokens: list[int], root: bytes) -> bool:
        m, bs = self.m, self.bs
        match = self.check_match(tokens, root)
        n = match.num_cached_tokens(bs)
        rid = self.new_id()
        # the oracle: admission takes the new blocks and references the matched ones, so a
        # matched block that is evictable now stops counting as free too
        evictable = m.index.is_evictable
        need = cdiv(len(tokens), bs) - len(match.block_ids) + sum(evictable(k) for k in match.keys)
        if match.partial_src is not None:
            need += evictable(m.pool.blocks[match.partial_src].key)
        can = need <= m.num_free_blocks
        before = self.snapshot()
        ok = m.allocate_new(rid, tokens, root, match, len(tokens) - n)
        assert ok == can
        if not ok:
            assert self.snapshot() == before
            return False
        table = list(m.block_ids(rid))
        assert table[: len(match.block_ids)] == match.block_ids
        assert len(table) == cdiv(len(tokens), bs)
        self.reqs[rid] = Req(root, list(tokens), n, table)
        if match.partial_src is not None:
            dst = table[len(match.block_ids)]
            start = len(match.block_ids) * bs
            want = [kv(root, tokens, p) for p in range(start, n)]
            self.pending[rid] = [(BlockCopy(match.partial_src, dst, match.partial_tokens), want)]
            self.reqs[rid].copy_pending = True
        return True

    def computed(self) -> list[str]:
        return sorted(r for r, q in self.reqs.items() if not q.copy_pending and q.num_computed == len(q.tokens))

    @precondition(lambda self: self.computed())
    @rule(i=st.integers(0, 99), extra=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def decode(self, i: int, extra: list[int]) -> None:
        rid = pick(self.computed(), i)
        req = self.reqs[rid]
        before = self.snapshot()
        if not self.m.allocate_more(rid, len(req.tokens) + len(extra)):
            assert self.snapshot() == before
            self.free(i + 1)  # preempt someone (maybe this request)
            return
        table = list(self.m.block_ids(rid))
        assert table[: len(req.block_ids)] == req.block_ids
        assert len(table) == cdiv(len(req.tokens) + len(extra), self.bs)
        req.block_ids = table
        req.tokens = req.tokens + extra
        self.compute(rid)

    @precondition(lambda self: self.computed())
    @rule(i=st.integers(0, 99), frac=st.floats(0, 1))
    def fork(self, i: int, frac: float) -> None:
        m, bs = self.m, self.bs
        pid = pick(self.computed(), i)
        p = self.reqs[pid]
        n = int(frac * p.num_computed)
        full, rem = divmod(n, bs)
        cid = self.new_id()
        before = self.snapshot()
        if not m.fork(pid, cid, n):
            assert rem and m.num_free_blocks == 0
            assert self.snapshot() == before
            return
        table = list(m.block_ids(cid))
        assert table[:full] == p.block_ids[:full] and len(table) == full + (rem > 0)
        self.reqs[cid] = Req(p.root, p.tokens[:n], n, table, copy_pending=rem > 0)
        if rem:
            want = [kv(p.root, p.tokens, pos) for pos in range(full * bs, n)]
            self.pending[cid] = [(BlockCopy(p.block_ids[full], table[full], rem), want)]

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        rid = pick(sorted(self.reqs), i)
        self.m.free(rid)
        del self.reqs[rid]
        self.pending.pop(rid, None)

    @rule(abort=st.integers(-1, 99))
    def step(self, abort: int) -> None:
        """One engine step: copies, forward pass (compute everything), cache, unlock."""
        m = self.m
        copies = m.take_copies()
        want = [c for cs in self.pending.values() for c, _ in cs]
        assert sorted(map(repr, copies)) == sorted(map(repr, want))
        for cs in self.pending.values():
            for c, content in cs:
                assert m.pool.blocks[c.src_block].ref_cnt > 0, "copy source not locked"
                assert self.shadow[c.src_block][: c.num_tokens] == content, "copy source was overwritten"
                self.shadow[c.dst_block][: c.num_tokens] = content
        self.in_flight += copies
        self.pending.clear()
        for req in self.reqs.values():
            req.copy_pending = False
        if abort >= 0 and self.reqs:  # a request aborted while its copy is in flight
            self.free(abort)
        for rid in sorted(self.reqs):
            self.compute(rid)
        m.end_step()
        self.in_flight = []

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        m, bs = self.m, self.bs
        m.check_integrity()
        live: dict[int, int] = {}
        for req in self.reqs.values():
            for b in req.block_ids:
                live[b] = live.get(b, 0) + 1
        for cs in self.pending.values():
            for c, _ in cs:
                live[c.src_block] = live.get(c.src_block, 0) + 1
        for c in self.in_flight:
            live[c.src_block] = live.get(c.src_block, 0) + 1
        m.pool.check_integrity(live)
        for rid, req in self.reqs.items():
            assert m.block_ids(rid) == req.block_ids
        assert sum(1 for b in m.pool.blocks if b.ref_cnt > 0) == len(live)
        assert m.num_free_blocks + m.pool.num_used_blocks == m.num_blocks
        # Every cached block holds the KV its key names, and is reachable.
        for node in m.index.nodes():
            root, tokens = self.known[node.key]
            assert node.tokens == tokens[-bs:]
            assert self.shadow[node.block_id] == [kv(root, list(tokens), len(tokens) - bs + s) for s in range(bs)]
            assert node.is_first or node.parent in m.index
        # Evicted keys are gone for good: no match reaches past them.
        for key, (root, tokens) in self.known.items():
            if key not in m.index:
                depth = len(tokens) // bs
                assert len(m.index.match_keys(chain_keys(root, list(tokens), bs))) < depth


TestManager = ManagerMachine.TestCase
TestManager.settings = SETTINGS
