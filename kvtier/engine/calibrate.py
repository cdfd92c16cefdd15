"""A short calibration at start-up that seeds the cost model's moving averages: prefill speed
(two forward passes over free blocks), host-to-device copy speed, and a put/get round trip of
a few blocks on each storage tier. Takes well under a second on the reference model."""

from __future__ import annotations

import logging
import os
import time

import torch

from kvtier.sched.output import ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)


def calibrate(runner, tiers, max_tokens: int = 256) -> None:
    bs = runner.block_size
    n = min(max_tokens, (runner.num_blocks - 1) * bs // 2)
    if n >= bs:
        blocks = list(range((2 * n) // bs + 1))
        vocab = runner.arch.vocab_size
        ids = [int(i) for i in torch.randint(0, vocab, (2 * n,))]
        est = tiers.cost.prefill
        for start, num in ((0, n), (0, n), (n, max(bs, n // 8))):
            seq = ScheduledSeq("calibrate", ids[start : start + num], start, blocks, True)
            t0 = time.perf_counter()
            runner.execute(SchedulerOutput(seqs=[seq]))
            est.observe(est.features(num, start), time.perf_counter() - t0)
    # host -> device: a restore writes its blocks in one call
    blocks = list(range(min(8, runner.num_blocks)))
    kvs = runner.read_block_list(blocks)
    runner.write_block_list(blocks, kvs)  # warm
    t0 = time.perf_counter()
    runner.write_block_list(blocks, kvs)
    dt = time.perf_counter() - t0
    if dt > 0:
        tiers.cost.h2d.update(len(blocks) * runner.kv_bytes_per_block / dt)
    kv = kvs[0]
    host = tiers.tiers.get("host")
    if host is not None:
        t0 = time.perf_counter()
        for _ in range(8):
            kv.clone()
        dt = time.perf_counter() - t0
        if dt > 0:
            tiers.cost.tiers["host"].observe_read(8 * runner.kv_bytes_per_block, dt)
        tiers.cost.tiers["host"].observe_lookup(1e-6)
    for name in ("disk", "remote"):
        tier = tiers.tiers.get(name)
        if tier is None:
            continue
        from kvtier.tiers.codec import decode, encode

        key = os.urandom(16)
        data = encode(kv, fingerprint=tiers.fingerprint, key=key)
        t0 = time.perf_counter()
        ok = tier.put(key, data)
        t1 = time.perf_counter()
        n_found = tier.contains_prefix([key])
        t2 = time.perf_counter()
        got = tier.get(key)
        if got is not None:
            decode(got, fingerprint=tiers.fingerprint, key=key)
        t3 = time.perf_counter()
        tier.delete(key)
        if ok and n_found and got is not None:
            tiers.cost.tiers[name].observe_lookup(t2 - t1)
            tiers.cost.tiers[name].observe_read(len(data), t3 - t2)
        else:
            logger.warning("calibration of the %s tier failed; it starts unhealthy or empty", name)
        del t0
