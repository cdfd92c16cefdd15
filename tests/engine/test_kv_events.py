"""KV events from kvtier's engine (kvtier.kv_events): a subscriber that knows only the stream
rebuilds, per medium, exactly what the engine's device pool and tiers hold; replay, restarts,
purges, resets, eviction pressure; nothing published when events are off; LoRA blocks carry
their adapter's id and name."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from engineutil import clean
from lorautil import make_adapter

from kvtier import LLM, LoRARequest, SamplingParams
from kvtier.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
    KVEventsConfig,
    block_hash,
    salt_digest,
)
from kvtier.kvcache.keys import chain_keys, root_key
from kvtier.lora import lora_fingerprint

zmq = pytest.importorskip("zmq")

BS = 4
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Subscriber:
    """An independent consumer: per medium, block hash -> (parent hash, token ids)."""

    def __init__(self, port: int, replay_port: int | None = None) -> None:
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)  # closing (or collecting) it never waits on a socket
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.replay_port = replay_port
        self.media: dict[tuple[str | None, str | None], dict[int, tuple[int | None, tuple[int, ...]]]] = {}
        self.seqs: list[int] = []
        self.payloads: list[bytes] = []
        self.cleared = 0

    def drain(self, settle_s: float = 0.3, until: Callable[[], bool] | None = None, timeout_s: float = 15.0) -> None:
        """Take every message until none arrives for `settle_s` (and, with `until`, until it holds
        or `timeout_s` has passed: the engine publishes from a thread that a loaded machine may
        hold back longer than `settle_s`). A gap in the sequence numbers (messages sent before the
        subscription took hold: ZMQ's slow joiner) is filled from the replay socket first, as a
        consumer should; so is a first drain (catch up, then follow)."""
        deadline = time.monotonic() + timeout_s
        self._drain(settle_s)
        while until is not None and not until() and time.monotonic() < deadline:
            self._drain(settle_s)

    def _drain(self, settle_s: float) -> None:
        if not self.seqs and self.replay_port is not None:
            for s, p in self.replay(0):
                self._take(s, p)
        while self.sub.poll(int(settle_s * 1000)):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == b""
            seq = int.from_bytes(seq_bytes, "big")
            if self.seqs and seq <= self.seqs[-1]:
                continue  # had it from the replay
            expected = self.seqs[-1] + 1 if self.seqs else 0
            if seq > expected and self.replay_port is not None:
                for s, p in self.replay(expected):
                    if s < seq:
                        self._take(s, p)
            self._take(seq, payload)

    def _take(self, seq: int, payload: bytes) -> None:
        self.seqs.append(seq)
        self.payloads.append(payload)
        self.apply(DECODER.decode(payload))

    def apply(self, batch: KVEventBatch) -> None:
        assert batch.data_parallel_rank == 0
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                where = self.media.setdefault((ev.medium, ev.locality), {})
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    where[h] = (parent, tuple(ev.token_ids[i * BS : (i + 1) * BS]))
                    parent = h
            elif isinstance(ev, BlockRemoved):
                where = self.media.setdefault((ev.medium, ev.locality), {})
                for h in ev.block_hashes:
                    assert h in where, f"removed {h} from {ev.medium} without a store"
                    del where[h]
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.cleared += 1
                self.media.clear()

    def longest_prefix(self, medium: tuple[str | None, str | None], tokens: list[int]) -> int:
        """Blocks of `tokens` the stream says `medium` holds, from the first on (as a router
        that rebuilds chains from token ids: parent link + tokens)."""
        where = self.media.get(medium, {})
        by_link = {(parent, toks): h for h, (parent, toks) in where.items()}
        parent: int | None = None
        n = 0
        for i in range(len(tokens) // BS):
            h = by_link.get((parent, tuple(tokens[i * BS : (i + 1) * BS])))
            if h is None:
                break
            parent, n = h, n + 1
        return n

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        try:
            dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            got = []
            while True:
                assert dealer.poll(15000), "no replay answer"
                empty, topic, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    assert topic == b"" and payload == b""
                    break
                got.append((int.from_bytes(seq, "big"), payload))
            return got
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _events_llm(model: Path, port: int, replay: int | None = None, **kw: Any) -> LLM:
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    if replay is not None:
        config["replay_endpoint"] = f"tcp://*:{replay}"
    return LLM(str(model), dtype="float32", block_size=BS, kv_events_config=config, **kw)


def _prompts(rng: random.Random, n: int, shared: list[int]) -> list[list[int]]:
    return [
        shared[: rng.randrange(0, len(shared))] + [rng.randrange(0, 256) for _ in range(rng.randrange(6, 30))]
        for _ in range(n)
    ]


def test_a_subscriber_sees_exactly_what_the_device_and_each_tier_hold(byte_model_dir: Path, tmp_path: Path) -> None:
    port, replay = _port(), _port()
    sub = Subscriber(port, replay)
    llm = _events_llm(
        byte_model_dir,
        port,
        replay,
        num_device_blocks=24,  # eviction pressure: the prompts below need several times this
        host_cache_bytes=1 << 20,
        disk_cache_dir=str(tmp_path / "disk"),
    )
    try:
        rng = random.Random(3)
        shared = [rng.randrange(0, 256) for _ in range(40)]
        for batch in [_prompts(rng, 6, shared) for _ in range(6)]:
            llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
        llm.engine.tiers.flush()
        sub.drain()
        assert sub.seqs == list(range(len(sub.seqs))) and sub.seqs, "seq counts from 0, one per batch"
        core = llm.engine
        device = {block_hash(n.key) for n in core.kv.index.nodes()}
        assert set(sub.media[("GPU", None)]) == device
        host = {block_hash(k) for k in core.tiers.tiers["host"].keys()}
        assert set(sub.media[("CPU", "LOCAL")]) == host and host
        disk = {block_hash(k) for k in core.tiers.tiers["disk"].keys()}
        assert set(sub.media[("STORAGE", "LOCAL")]) == disk and disk
        assert sum(1 for p in sub.payloads if b"BlockRemoved" in p) > 0, "evictions were published"
        # 200 probes: the longest prefix the stream shows equals what the engine would serve
        root = root_key(core.runner.fingerprint, None)
        for probe in _prompts(random.Random(4), 200, shared):
            keys = chain_keys(root, probe, BS)
            on_device = len(core.kv.index.match_keys(keys))
            assert sub.longest_prefix(("GPU", None), probe) == on_device
            in_host = core.tiers.tiers["host"].contains_prefix(keys, count=False)
            assert sub.longest_prefix(("CPU", "LOCAL"), probe) == in_host
        # replay from seq 2 gives the same payloads as the live stream
        replayed = sub.replay(2)
        assert [s for s, _ in replayed] == sub.seqs[2:]
        assert [p for _, p in replayed] == sub.payloads[2:]
        clean(llm)
    finally:
        llm.close()
        sub.close()


def test_purge_reset_salts_and_restart(byte_model_dir: Path) -> None:
    port, replay = _port(), _port()
    sub = Subscriber(port, replay)
    llm = _events_llm(byte_model_dir, port, replay, num_device_blocks=64)
    try:
        core = llm.engine
        a = list(range(10, 30))
        core.add_request(a, GREEDY, tenant="acme", cache_salt="s3cret")
        core.add_request(list(range(40, 60)), GREEDY)
        while core.has_unfinished:
            core.step()

        def device_view() -> set[int]:
            return {block_hash(n.key) for n in core.kv.index.nodes()}

        sub.drain(until=lambda: set(sub.media.get(("GPU", None), {})) == device_view())
        gpu = sub.media[("GPU", None)]
        assert set(gpu) == device_view() and len(gpu) >= 8
        first_blocks = [p for p in sub.payloads if b"extra_keys" in p]
        assert first_blocks, "the salted chain's first block carries extra keys"
        assert all(b"s3cret" not in p for p in sub.payloads), "a salt never goes out in clear"
        assert salt_digest("s3cret").encode() in first_blocks[0]
        core.tenants.purge("acme")  # everything of the tenant leaves the routers' view
        sub.drain(until=lambda: set(sub.media[("GPU", None)]) == device_view())
        left = sub.media[("GPU", None)]
        assert set(left) == device_view()
        assert left and all(n.owner.tenant is None for n in core.kv.index.nodes())
        assert core.reset_prefix_cache() == len(left)
        sub.drain(until=lambda: sub.cleared >= 1)
        assert sub.cleared == 1 and not sub.media, "nothing left anywhere: AllBlocksCleared"
        clean(llm)
    finally:
        llm.close()
        sub.close()
    # a restarted engine starts its sequence numbers at 0 again
    sub = Subscriber(port, replay)
    llm = _events_llm(byte_model_dir, port, replay, num_device_blocks=64)
    try:
        llm.generate([{"prompt_token_ids": list(range(70, 90))}], GREEDY)
        sub.drain(until=lambda: bool(sub.seqs))
        assert sub.seqs and sub.seqs[0] == 0
        clean(llm)
    finally:
        llm.close()
        sub.close()


def test_lora_blocks_carry_the_adapters_id(byte_model_dir: Path, tmp_path: Path) -> None:
    """As vLLM 0.32's block pool fills BlockStored from the request: lora_id is the adapter's
    lora_int_id and lora_name its name, on the device and on the tiers that store the blocks
    after it; the base model's blocks (the same tokens, another chain) carry None."""
    pytest.importorskip("peft", reason="PEFT writes the adapter (pip install 'kvtier[test]')")
    adapter = LoRARequest("sql", 7, str(make_adapter(byte_model_dir, tmp_path / "sql", seed=1)))
    port, replay = _port(), _port()
    sub = Subscriber(port, replay)
    llm = _events_llm(
        byte_model_dir, port, replay, num_device_blocks=64, host_cache_bytes=1 << 20, enable_lora=True, max_loras=1
    )
    try:
        core = llm.engine
        p = list(range(10, 30))
        llm.generate([{"prompt_token_ids": p}], GREEDY, lora_request=adapter)
        llm.generate([{"prompt_token_ids": p}], GREEDY)
        core.tiers.flush()
        weights = core.loras.get(adapter)
        chains = {
            lora_id: [block_hash(k) for k in chain_keys(root_key(fp, None), p, BS)]
            for lora_id, fp in (
                (7, lora_fingerprint(core.runner.fingerprint, weights.key)),
                (None, core.runner.fingerprint),
            )
        }
        want = {h for hashes in chains.values() for h in hashes}
        media = [("GPU", None), ("CPU", "LOCAL")]
        sub.drain(until=lambda: all(want <= set(sub.media.get(m, {})) for m in media))
        seen: dict[tuple[str | None, int], tuple[int | None, str | None]] = {}
        for payload in sub.payloads:
            for ev in DECODER.decode(payload).events:
                if isinstance(ev, BlockStored):
                    for h in ev.block_hashes:
                        seen[(ev.medium, h)] = (ev.lora_id, ev.lora_name)
        assert set(chains[7]).isdisjoint(chains[None]), "the adapter's blocks are its own"
        for medium in ("GPU", "CPU"):
            assert [seen[(medium, h)] for h in chains[7]] == [(7, "sql")] * len(chains[7]), medium
            assert [seen[(medium, h)] for h in chains[None]] == [(None, None)] * len(chains[None]), medium
        clean(llm)
    finally:
        llm.close()
        sub.close()


def test_a_chain_that_changes_adapter_name_is_split() -> None:
    """An adapter served under two names (the same files) shares its blocks, so one chain may be
    extended under another LoRARequest: its blocks go out in separate events, each with the id
    and name of the request that computed it (one event of a chain carries one lora_id)."""
    rec = KVEventRecorder(BS, None)
    a, alias = LoRARequest("a", 1, "/adapters/a"), LoRARequest("a-alias", 9, "/adapters/a")
    keys = chain_keys(root_key(b"fp", None), list(range(12)), BS)
    rec.stored(keys[0], b"", [0, 1, 2, 3], True, None, a)
    rec.stored(keys[1], keys[0], [4, 5, 6, 7], False, None, a)
    rec.stored(keys[2], keys[1], [8, 9, 10, 11], False, None, alias)
    stored = [e for e in rec.take() if isinstance(e, BlockStored)]
    assert [(e.block_hashes, e.parent_block_hash, e.lora_id, e.lora_name) for e in stored] == [
        ([block_hash(keys[0]), block_hash(keys[1])], None, 1, "a"),
        ([block_hash(keys[2])], block_hash(keys[1]), 9, "a-alias"),
    ]
    watch = rec.tier_watch("host")  # a tier's store of the block: the same id and name
    watch(keys[2], True)
    assert [(e.medium, e.lora_id, e.lora_name) for e in rec.take() if isinstance(e, BlockStored)] == [
        ("CPU", 9, "a-alias")
    ]


def test_nothing_is_published_when_events_are_off(byte_model_dir: Path) -> None:
    port = _port()
    sub = Subscriber(port)
    for config in (None, {"enable_kv_cache_events": False, "endpoint": f"tcp://*:{port}"}):
        with LLM(
            str(byte_model_dir), dtype="float32", block_size=BS, num_device_blocks=32, kv_events_config=config
        ) as llm:
            assert llm.engine.kv_events is None
            llm.generate([{"prompt_token_ids": list(range(10, 30))}], GREEDY)
            clean(llm)
            sub.drain(0.2)
    assert sub.seqs == []
    with socket.socket() as s:  # the port was never bound
        s.bind(("0.0.0.0", port))
    sub.close()


def test_config_is_vllms() -> None:
    c = KVEventsConfig()
    assert (c.enable_kv_cache_events, c.publisher, c.endpoint, c.replay_endpoint) == (
        False,
        "null",
        "tcp://*:5557",
        None,
    )
    assert (c.buffer_steps, c.hwm, c.max_queue_size, c.topic) == (10_000, 100_000, 100_000, "")
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv"}') == KVEventsConfig(
        True, "zmq", topic="kv"
    )
    with pytest.raises(ValueError, match="unknown fields"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "endpiont": "tcp://*:1"})
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig(True, "nats")
