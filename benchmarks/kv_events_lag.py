"""KV events: how long after the engine caches a block a subscriber on loopback sees it, and what
publishing costs the engine.

    python benchmarks/kv_events_lag.py --requests 64 --repeats 3 [--contended]

One engine (the reference model, in this process) serves batches of requests with shared
prefixes, with events on; a subscriber thread (ZMQ SUB on 127.0.0.1) stamps each batch on
arrival. Lag = arrival - the time the block was cached, where the engine stamps its cache
insertions (the index listener's call) and the batch carries them; reported p50/p99/max over all
blocks. The same workload with events off gives the cost: generate() seconds, medians of the
repeats, interleaved (off, on, off, on, ...). `--contended` runs benchmarks/corunner.py (one busy
core) meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import msgspec  # noqa: E402
import zmq  # noqa: E402

from kvtier import LLM, SamplingParams  # noqa: E402
from kvtier.kv_events import BlockStored, KVEventBatch, KVEventRecorder, block_hash  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StampedRecorder(KVEventRecorder):
    """The engine's recorder, also noting when each block was cached (for the lag only)."""

    cached_at: dict[int, float]

    def stored(self, key, parent, tokens, is_first, owner=None):  # type: ignore[no-untyped-def]
        self.cached_at[block_hash(key)] = time.perf_counter()
        super().stored(key, parent, tokens, is_first, owner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the reference model)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contended", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.model is None:
        from build_reference_model import ensure_reference_model

        args.model = str(ensure_reference_model())
    corunner = subprocess.Popen([sys.executable, str(HERE / "corunner.py")]) if args.contended else None
    rng = random.Random(0)
    shared = [rng.randrange(3, 30000) for _ in range(256)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    port = _port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    common = dict(dtype="float32", block_size=16, num_device_blocks=2048, max_num_seqs=16)
    llm_on = LLM(args.model, kv_events_config=config, **common)
    assert llm_on.engine.kv_events is not None
    stamped = StampedRecorder(16, llm_on.engine.kv_events.publisher)
    stamped.cached_at = {}
    llm_on.engine.kv_events = stamped
    llm_on.engine.kv.index.listener = stamped
    assert stamped.publisher is not None
    stamped.publisher._flush = stamped.flush
    llm_off = LLM(args.model, **common)
    lags: list[float] = []
    stop = threading.Event()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)

    def listen() -> None:
        while not stop.is_set():
            if sub.poll(100):
                _, _, payload = sub.recv_multipart()
                now = time.perf_counter()
                for ev in decoder.decode(payload).events:
                    if isinstance(ev, BlockStored) and ev.medium == "GPU":
                        for h in ev.block_hashes:
                            t = stamped.cached_at.pop(h, None)
                            if t is not None:
                                lags.append(now - t)

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    time.sleep(0.5)  # the subscription takes hold
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    for rep in range(args.repeats):
        prompts = [
            {"prompt_token_ids": shared[: rng.randrange(64, 256)] + [rng.randrange(3, 30000) for _ in range(64)]}
            for _ in range(args.requests)
        ]
        for name, llm in (("off", llm_off), ("on", llm_on)):
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            llm.generate(prompts, sp)
            seconds[name].append(time.perf_counter() - t0)
        print(f"repeat {rep}: off {seconds['off'][-1]:.2f} s, on {seconds['on'][-1]:.2f} s", flush=True)
    time.sleep(0.5)
    stop.set()
    thread.join()
    if corunner is not None:
        corunner.terminate()
    lags.sort()
    q = lambda f: round(1000 * lags[min(len(lags) - 1, int(f * len(lags)))], 2)  # noqa: E731
    report = {
        "machine": {"cpus": os.cpu_count(), "load_1m": os.getloadavg()[0], "contended": args.contended},
        "blocks": len(lags),
        "lag_ms": {"p50": q(0.5), "p99": q(0.99), "max": round(1000 * lags[-1], 2)},
        "generate_s": {k: [round(x, 3) for x in v] for k, v in seconds.items()},
        "median_s": {k: round(statistics.median(v), 3) for k, v in seconds.items()},
        "on_over_off": round(statistics.median(seconds["on"]) / statistics.median(seconds["off"]), 3),
        "published_batches": stamped.publisher.num_published,
        "dropped_batches": stamped.publisher.num_dropped,
    }
    llm_on.close()
    llm_off.close()
    sub.close(linger=0)
    ctx.term()
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
